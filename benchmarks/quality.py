"""Representation quality for a fixed training wall-clock budget, for configs of ``configs/`` and the reference.

    python -m benchmarks.quality --qe 16 --systems fashion_mnist_long quickstart           # 16 quickstart epochs each
    python -m benchmarks.quality --minutes 10 --systems quickstart fashion_mnist_10min reference
    python -m benchmarks.quality --minutes 30 --systems fashion_mnist_30min --out benchmarks/results/quality_30min.png
    python -m benchmarks.quality --minutes 0.2 --systems quickstart reference --eval-subset 2000 --probe-epochs 2 \\
        --out /tmp/q.png                                                                      # a smoke run, minutes

A system is a config name (``configs/<name>.yaml``, model and data as the CLI builds them, ``--override``s added) or
``reference``: the lightly-examples MoCo of ``_common.make_reference`` with the quickstart's model settings, lightly's
per-image ``MoCoV2Transform`` in DataLoader workers (the faster of ``--ref-workers``). For each system:

Budgets: ``--qe N`` gives every system N quickstart-epoch equivalents of training wall time (1 QE: one epoch of
``configs/quickstart.yaml``, 60k images, timed first in the same run), a budget that means the same on a machine
3.5x faster or slower; ``--minutes`` a fixed wall time.

1. speed: a throwaway run times seconds per step (not counted in the budget);
2. plan: ``steps = budget / (s/step)``; the cosine lr schedule spans exactly these steps;
3. train; a callback keeps the training clock (evaluations pause it), re-plans once after ``--replan-at`` of the
   planned steps from the speed measured in the run itself (the machine is shared: its speed drifts between the
   timing and the run), stretching or shrinking the lr schedule to the new step count, stops at the budget if the
   plan was still optimistic, and evaluates the kNN at ``--curve-points`` steps on a small fixed set;
4. evaluate the frozen backbone: weighted kNN top-1 (k 200, T 0.1, cosine: the library's ``knn_counts``), a
   linear probe (the library's ``probe_accuracy``: standardised features, Adam, ``--probe-epochs``) and the same
   probe trained on 1 % of the bank's labels (class-stratified, seeded: ``low_label_probe``).

``--split test`` (default): pretraining on the 60k train images, kNN bank / probe training = the 60k train images
with the evaluation transform, queries = the official 10k test split. ``--split val`` (what recipes are selected on,
never the test split): pretraining, bank and probe training on the first 50k train images, queries = the last 10k.
Baselines with the same evaluation: raw normalised pixels and the randomly initialised encoder (of the first config).
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from benchmarks._common import (
    QE_CONFIG,
    QE_IMAGES,
    QE_OVERRIDES,
    config_path,
    evaluate,
    fashion_mnist,
    features,
    footer,
    from_config,
    header,
    knn_top1,
    make_reference,
    parser,
    print_table,
    quiet,
    reference_loader,
    trainer_kwargs,
)
from benchmarks.timing import seconds_per_step, steps_affordable


# --- the evaluation sets -------------------------------------------------------------------------------------
class Splits:
    """Pretraining images, the final bank and queries, and the curve's small bank and queries of one ``--split``."""

    def __init__(self, split: str, eval_subset: Optional[int], curve_bank: int, curve_queries: int) -> None:
        train = fashion_mnist("train")
        if split == "val":
            self.pretrain = (train[0][:50000], train[1][:50000])
            queries = (train[0][50000:], train[1][50000:])
        else:
            self.pretrain, queries = train, fashion_mnist("test")
        n_bank, n_q = (
            (eval_subset, max(100, eval_subset // 4)) if eval_subset else (len(self.pretrain[1]), len(queries[1]))
        )
        self.bank = tuple(t[:n_bank] for t in self.pretrain)
        self.queries = tuple(t[:n_q] for t in queries)
        self.curve_bank = tuple(t[: min(curve_bank, n_bank)] for t in self.pretrain)
        self.curve_queries = tuple(t[: min(curve_queries, n_q)] for t in queries)
        self.split = split

    def curve(self, module: nn.Module) -> float:
        return knn_top1(*features(module, *self.curve_bank), *features(module, *self.curve_queries))


# --- a system: build, time, fit under the budget ---------------------------------------------------------------
class System:
    """A config (or the reference) trained for ``steps`` with a cosine lr over exactly those steps."""

    def __init__(self, name: str, args, splits: Splits, config: Optional[str] = None, overrides: tuple = ()) -> None:
        self.name, self.args, self.splits, self.workers = name, args, splits, 0
        self.config = config or name  # a config name, or "reference"
        self.overrides = (*args.override, *overrides)

    def build(self, total_steps: int):
        torch.manual_seed(self.args.seed)  # the same initial weights for every system with the same backbone
        if self.config == "reference":  # with the model settings of the first quickstart (fashion_mnist_moco_v2)
            # and the stem of the systems it is compared with (the same architecture for every system)
            model, _ = from_config(config_path("fashion_mnist_moco_v2"), f"--model.stem={self.stem()}", *self.overrides)
            ref = make_reference(model.hparams, self.batch_size(), total_steps)
            loader = reference_loader(*self.splits.pretrain, self.batch_size(), self.workers, seed=self.args.seed)
            return ref, {"train_dataloaders": loader}
        n = len(self.splits.pretrain[1])
        subset = (f"--data.init_args.train_subset={n}", "--data.init_args.val_subset=256")
        model, dm = from_config(config_path(self.config), *self.overrides, *subset)
        return model, {"datamodule": dm}

    def stem(self) -> str:
        """The stem of the first library system of ``--systems`` (the quickstart's without one), ``--override``s
        applied: the reference's backbone is built with it."""
        first = next((s for s in self.args.systems if s != "reference"), "quickstart")
        from moco_lightning.modules.backbones import resolve_stem

        hp = from_config(config_path(first), *self.args.override)[0].hparams
        return resolve_stem(hp.get("stem"), hp.get("cifar_stem", False))

    def batch_size(self) -> int:
        if not hasattr(self, "_batch_size"):
            config = "fashion_mnist_moco_v2" if self.config == "reference" else self.config
            self._batch_size = from_config(config_path(config), *self.overrides)[1].batch_size
        return self._batch_size

    def fit(self, steps: int, callbacks: list, total_steps: Optional[int] = None) -> nn.Module:
        import lightning.pytorch as pl

        model, data = self.build(total_steps or steps)
        trainer = pl.Trainer(**trainer_kwargs(steps, callbacks, precision=getattr(self.args, "precision", "32-true")))
        trainer.fit(model, **data)
        save_dir = getattr(self.args, "save_checkpoints", None)
        if save_dir and total_steps:  # the budgeted run, not a timing run: its final weights, for low_label.py
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(Path(save_dir) / f"{self.name}.ckpt")
        return model

    def seconds_per_step(self) -> float:
        """Wall time per step of a throwaway run: ``--timing-steps`` timed after ``--timing-warmup``."""
        return seconds_per_step(self.fit, self.args.timing_warmup, self.args.timing_steps)


def budget_callback(
    budget_s: float,
    eval_steps: set,
    evaluate_fn: Callable[[nn.Module], float],
    name: str,
    replan_step: Optional[int] = None,
):
    """The training clock (evaluations excluded), the kNN curve, one re-plan at ``replan_step``, the stop at the
    budget."""
    from lightning.pytorch import Callback

    class Budget(Callback):
        def __init__(self) -> None:
            self.train_s, self.curve, self.stopped_at_budget, self.replanned = 0.0, [], False, None

        def on_train_start(self, trainer, pl_module) -> None:
            self.last = time.perf_counter()

        def point(self, pl_module, step: int) -> None:
            t = time.perf_counter()
            acc = evaluate_fn(pl_module)
            self.curve.append((self.train_s, step, acc))
            print(
                f"    [{name}] step {step:5d}, {self.train_s:6.1f} s of training: kNN top-1 {100 * acc:5.2f} % "
                f"(curve set; eval {time.perf_counter() - t:.1f} s)",
                flush=True,
            )

        def replan(self, trainer) -> None:
            from moco_lightning.training.plan import change_length

            step, old = trainer.global_step, trainer.max_steps
            new = steps_affordable(budget_s, step, self.train_s)
            if new != old:  # the lr and momentum schedules stretch over the steps the budget affords
                change_length(trainer.lightning_module, new)
            self.replanned = (step, old, new)
            print(
                f"    [{name}] re-plan at step {step}: {self.train_s / step:.3f} s/step in the run -> {new} steps "
                f"(planned {old})",
                flush=True,
            )

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.train_s += time.perf_counter() - self.last
            if replan_step and trainer.global_step == replan_step and math.isfinite(budget_s):
                self.replan(trainer)
            if self.train_s >= budget_s and not trainer.should_stop:
                trainer.should_stop = self.stopped_at_budget = True
            if trainer.global_step in eval_steps or trainer.should_stop:
                self.point(pl_module, trainer.global_step)
            self.last = time.perf_counter()

        def on_train_end(self, trainer, pl_module) -> None:
            if not self.curve or self.curve[-1][1] != trainer.global_step:
                self.point(pl_module, trainer.global_step)

    return Budget()


def run_system(
    system: System,
    budget_s: float,
    curve_points: int,
    ref_workers=(0, 2),
    sps: Optional[float] = None,
    stop_at_budget: bool = True,
) -> dict:
    """Times (unless ``sps`` is given), plans, trains and evaluates one system; returns its results (with the curve).

    ``stop_at_budget=False``: the planned steps are trained whatever the wall clock says (for runs timed beforehand on
    an idle machine, trained while the machine is shared)."""
    if sps is not None:
        pass
    elif system.config == "reference":
        speeds = {}
        for w in ref_workers:
            system.workers = w
            speeds[w] = system.seconds_per_step()
            print(f"  speed with num_workers={w}: {speeds[w]:.3f} s/step", flush=True)
        system.workers = min(speeds, key=speeds.get)
        sps = speeds[system.workers]
    else:
        sps = system.seconds_per_step()
    total = max(1, int(budget_s / sps))
    batch = system.batch_size()
    epoch = len(system.splits.pretrain[1]) // batch
    eval_steps = {max(1, round(total * i / max(1, curve_points))) for i in range(1, curve_points + 1)}
    print(
        f"  [{system.name}] {sps:.3f} s/step ({batch / sps:.0f} images/s) -> {total} steps = {total / epoch:.2f} "
        f"epochs of {epoch}; cosine lr over {total} steps",
        flush=True,
    )
    replan = max(1, round(total * system.args.replan_at)) if system.args.replan_at > 0 else None
    clock = budget_callback(
        budget_s if stop_at_budget else math.inf, eval_steps, system.splits.curve, system.name, replan
    )
    model = system.fit(total, [clock], total_steps=total)
    steps = clock.curve[-1][1]
    result = evaluate(model, system.splits.bank, system.splits.queries, system.args.probe_epochs, system.args.seed)
    result.update(
        steps=steps,
        epochs=steps / epoch,
        train_s=clock.train_s,
        seconds_per_step=sps,
        images_per_s=batch / sps,
        planned_steps=clock.replanned[2] if clock.replanned else total,
        stopped_at_budget=clock.stopped_at_budget,
        workers=system.workers,
        curve=clock.curve,
    )
    pretext = getattr(getattr(model, "_trainer", None), "callback_metrics", {}).get("train/acc1")
    result["pretext_acc1"] = float(pretext) if pretext is not None else float("nan")
    print(
        f"  [{system.name}] {steps} steps ({steps / epoch:.2f} epochs) in {clock.train_s:.0f} s: kNN "
        f"{100 * result['knn_top1']:.2f} %, probe {100 * result.get('probe_top1', float('nan')):.2f} %, 1 %-label "
        f"linear {100 * result.get('low_label_top1', float('nan')):.2f} %; pretext acc1 at the end "
        f"{result['pretext_acc1']:.3f}\n",
        flush=True,
    )
    return result


def quickstart_epoch_seconds(args, splits: Splits, sps: Optional[float] = None) -> float:
    """The wall time of one quickstart epoch on this machine now (``sps``: its seconds per step, if timed already)."""
    system = System(QE_CONFIG, args, splits, overrides=QE_OVERRIDES)
    sps = system.seconds_per_step() if sps is None else sps
    steps = QE_IMAGES // system.batch_size()
    qe = sps * steps
    print(
        f"1 QE = {qe:.1f} s on this machine now (configs/{QE_CONFIG}.yaml {' '.join(QE_OVERRIDES)}: {sps:.4f} s/step "
        f"x {steps} steps)\n"
    )
    return qe


def baselines(splits: Splits, config: str, args) -> dict:
    torch.manual_seed(args.seed)
    init, _ = from_config(config_path(config), *args.override)
    return {
        name: {
            **evaluate(module, splits.bank, splits.queries, args.probe_epochs, args.seed),
            "curve": [(0.0, 0, splits.curve(module))],
        }
        for name, module in (("raw pixels (normalised)", nn.Flatten()), ("random-init encoder", init))
    }


def write_results(out: Path, results: dict, args, title: str) -> None:
    """The table on stdout, a CSV of every number next to ``out`` and the plot (kNN against training time)."""
    rows = [
        [
            name,
            f"{r['epochs']:.2f}" if "epochs" in r else "-",
            f"{r['train_s']:.0f}" if "train_s" in r else "-",
            f"{r['images_per_s']:.0f}" if "images_per_s" in r else "-",
            f"{100 * r['knn_top1']:.2f}",
            f"{100 * r['probe_top1']:.2f}" if "probe_top1" in r else "-",
            f"{100 * r['low_label_top1']:.2f}" if "low_label_top1" in r else "-",
        ]
        for name, r in results.items()
    ]
    print_table(rows, ["system", "epochs", "train s", "images/s", "kNN top-1 %", "probe top-1 %", "1 %-label linear %"])
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["system", "kind", "step", "train_seconds", "knn_top1", "probe_top1", "split", "low_label_top1"])
        for name, r in results.items():
            for s, step, acc in r.get("curve", []):
                w.writerow([name, "curve", step, f"{s:.2f}", f"{acc:.4f}", "", args.split, ""])
            w.writerow(
                [
                    name,
                    "final",
                    r.get("steps", ""),
                    f"{r.get('train_s', 0):.2f}",
                    f"{r['knn_top1']:.4f}",
                    f"{r.get('probe_top1', float('nan')):.4f}",
                    args.split,
                    f"{r.get('low_label_top1', float('nan')):.4f}",
                ]
            )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, r in results.items():
        pts = r.get("curve", [])
        if len(pts) > 1:
            ax.plot([p[0] / 60 for p in pts], [100 * p[2] for p in pts], "o-", label=name, ms=3)
        elif pts:
            ax.axhline(100 * pts[0][2], ls=":", color="gray", lw=1)
            ax.text(0, 100 * pts[0][2], f" {name}", fontsize=7, color="gray", va="bottom")
    ax.set_xlabel("training wall time (min; evaluations excluded)")
    ax.set_ylabel("kNN top-1 (%, curve set)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    print(f"wrote {out} and {out.with_suffix('.csv')}")


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--split", choices=["val", "test"], default="test", help="val: select on the last 10k train images")
    p.add_argument("--override", action="append", default=[],
                   help="a CLI override for every config (repeatable): --override=--model.stem=cifar")  # fmt: skip
    p.add_argument("--curve-points", type=int, default=5)
    p.add_argument("--curve-bank", type=int, default=10000)
    p.add_argument("--curve-queries", type=int, default=2000)
    p.add_argument("--eval-subset", type=int, default=None, help="smoke runs: banks of N, queries N // 4")
    p.add_argument("--probe-epochs", type=int, default=20)
    p.add_argument("--timing-warmup", type=int, default=3, help="untimed steps before the timed ones")
    p.add_argument("--timing-steps", type=int, default=8, help="timed steps of a speed measurement")
    p.add_argument("--replan-at", type=float, default=0.1,
                   help="re-plan the steps once, after this fraction (0: never)")  # fmt: skip


def main(argv=None) -> None:
    p = parser(__doc__)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--qe", type=float, default=None, help="budget per system in quickstart-epoch equivalents")
    budget.add_argument("--minutes", type=float, default=None, help="training wall-clock budget per system (10)")
    p.add_argument("--systems", nargs="+", default=["quickstart", "reference"])
    p.add_argument("--ref-workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "quality.png"))
    p.add_argument("--save-checkpoints", default=None, help="folder: each system's final weights as <name>.ckpt")
    add_common_args(p)
    args = p.parse_args(argv)
    quiet()
    t0 = time.perf_counter()
    header("Quality for a fixed training wall-clock budget", args)
    splits = Splits(args.split, args.eval_subset, args.curve_bank, args.curve_queries)
    print(
        f"split {args.split}: pretraining on {len(splits.pretrain[1])} images; kNN bank {len(splits.bank[1])}, "
        f"queries {len(splits.queries[1])}; curve set {len(splits.curve_bank[1])} / {len(splits.curve_queries[1])}; "
        f"probe {args.probe_epochs} epochs\n",
        flush=True,
    )
    if args.qe is not None:
        budget_s, label = args.qe * quickstart_epoch_seconds(args, splits), f"{args.qe:g} QE"
    else:
        budget_s, label = 60 * (args.minutes or 10.0), f"{args.minutes or 10.0:g} min"
    first = next((s for s in args.systems if s != "reference"), "quickstart")
    results = baselines(splits, first, args)
    for name in args.systems:
        results[name] = run_system(System(name, args, splits), budget_s, args.curve_points, args.ref_workers)
    write_results(Path(args.out), results, args, f"Fashion-MNIST, {label} per system, split {args.split}")
    footer(t0)


if __name__ == "__main__":
    main()
