"""Representation quality for a fixed wall-clock budget: moco-lightning vs the lightly-examples reference.

    python benchmarks/quality.py                              # 10 min of training per system (~30 min in all)
    python benchmarks/quality.py --minutes 30 --out runs/quality30.png
    python benchmarks/quality.py --minutes 1 --eval-subset 2000 --probe-epochs 3 --out /tmp/q.png   # smoke run

For each system (ours: ``MoCo`` + ``FashionMNISTDataModule``; reference: the lightly-examples MoCo of
``_common.make_reference`` with lightly's per-image ``MoCoV2Transform`` in DataLoader workers; same backbone,
head, batch, K, m, T, lr, weight decay and augmentation strength, same initial weights):

1. speed: a short throwaway run measures seconds per step (for the reference, with each of ``--ref-workers``;
   the fastest is used), not counted in the budget;
2. plan: ``steps = budget / (s/step)``, i.e. ``steps / steps_per_epoch`` epochs; the cosine lr schedule of both
   systems spans exactly these steps (ours: ``lr_schedule='cosine'`` over ``trainer.estimated_stepping_batches``;
   the reference: ``CosineAnnealingLR(T_max=steps)``);
3. train under a plain ``lightning.pytorch`` Trainer; a callback keeps the training clock (evaluation pauses it),
   stops at the budget if the plan was optimistic, and runs the kNN monitor at ``--curve-points`` evenly spaced
   steps (bank: ``--curve-bank`` train images, queries: ``--curve-queries`` test images, evaluation transform);
4. final evaluation of the backbone features: weighted kNN top-1 (k=200, T=0.1, cosine; the library's
   ``knn_counts``; bank = the train split with the evaluation transform, queries = the official 10k test split)
   and a linear probe (a linear layer on frozen, standardised features of the train split, Adam, cosine lr,
   ``--probe-epochs`` epochs, evaluated on the test split).

Baselines with the same evaluation: raw normalised pixels (kNN on the 784 pixel values; ~85.8 % on the full
split) and the randomly initialised encoder. Output: a table, ``--out`` (PNG: kNN top-1 against training wall
time, both systems) and a CSV next to it (every curve point and the final numbers).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    FASHION_MEAN, FASHION_STD, FeatureExtractor, StepClock, add_model_args, describe_model, fashion_mnist, footer,
    header, make_reference, moco_kwargs, print_table, quiet, reference_loader, trainer_kwargs,
)

K_NN, T_NN, NUM_CLASSES = 200, 0.1, 10


# --- evaluation ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def eval_loader(images: Tensor, labels: Tensor, batch_size: int = 512) -> DataLoader:
    """The evaluation transform (normalise only), as the datamodules' ``eval_*_dataloader``."""
    from moco_lightning.datamodules import ImageTensorDataset, NormalizeCollate

    return DataLoader(ImageTensorDataset(images, labels), batch_size=batch_size,
                      collate_fn=NormalizeCollate(FASHION_MEAN, FASHION_STD, 28))


@torch.no_grad()
def raw_features(module: nn.Module, images: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Unnormalised features of ``module`` (eval mode, no grad) for the images, with the library's ``embed``."""
    from moco_lightning.callbacks._utils import embed

    return embed(module, eval_loader(images, labels), torch.device("cpu"), gather=False, normalize=False)


def knn_top1(bank: Tensor, bank_y: Tensor, queries: Tensor, queries_y: Tensor) -> float:
    from moco_lightning.callbacks.knn import knn_counts

    counts = knn_counts(F.normalize(queries, dim=1), queries_y, F.normalize(bank, dim=1), bank_y, NUM_CLASSES,
                        k=K_NN, temperature=T_NN, topk=(1,))
    return counts[0].item() / counts[1].item()


def knn_of(module: nn.Module, bank: tuple[Tensor, Tensor], queries: tuple[Tensor, Tensor]) -> float:
    """kNN top-1 with the library's ``knn_accuracy`` (what the ``KNNMonitor`` callback runs)."""
    from moco_lightning.callbacks.knn import knn_accuracy

    return knn_accuracy(module, eval_loader(*bank), eval_loader(*queries), num_classes=NUM_CLASSES, k=K_NN,
                        temperature=T_NN, device=torch.device("cpu"))["acc1"]


def linear_probe(train_f: Tensor, train_y: Tensor, test_f: Tensor, test_y: Tensor, epochs: int, seed: int) -> float:
    """Top-1 on the test features of a linear layer trained on standardised frozen train features."""
    mean, std = train_f.mean(0), train_f.std(0) + 1e-6
    tr, te = (train_f - mean) / std, (test_f - mean) / std
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        lin = nn.Linear(tr.shape[1], NUM_CLASSES)
    bs = 256
    steps = max(1, epochs * math.ceil(len(tr) / bs))
    opt = torch.optim.Adam(lin.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    with torch.enable_grad():
        for _ in range(epochs):
            perm = torch.randperm(len(tr), generator=g)
            for i in range(0, len(tr), bs):
                idx = perm[i:i + bs]
                loss = F.cross_entropy(lin(tr[idx]), train_y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
    with torch.no_grad():
        return (lin(te).argmax(1) == test_y).float().mean().item()


class Evaluator:
    """The fixed evaluation sets: the curve's (small, during training) and the final one."""

    def __init__(self, args, train: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor]) -> None:
        self.args = args
        self.final_bank = (train[0][:args.eval_bank], train[1][:args.eval_bank])
        self.final_queries = (test[0][:args.eval_queries], test[1][:args.eval_queries])
        self.curve_bank = (train[0][:args.curve_bank], train[1][:args.curve_bank])
        self.curve_queries = (test[0][:args.curve_queries], test[1][:args.curve_queries])

    def curve(self, module: nn.Module) -> float:
        return knn_of(module, self.curve_bank, self.curve_queries)

    def final(self, module: nn.Module) -> dict:
        t = time.perf_counter()
        bank_f, bank_y = raw_features(module, *self.final_bank)
        q_f, q_y = raw_features(module, *self.final_queries)
        out = {"knn_top1": knn_top1(bank_f, bank_y, q_f, q_y),
               "probe_top1": linear_probe(bank_f, bank_y, q_f, q_y, self.args.probe_epochs, self.args.seed),
               "feature_dim": bank_f.shape[1]}
        out["eval_s"] = time.perf_counter() - t
        return out


# --- the two systems ------------------------------------------------------------------------------------------
class System:
    """How to build, fit and evaluate one system."""

    def __init__(self, name: str, args, train: tuple[Tensor, Tensor]) -> None:
        self.name, self.args, self.train = name, args, train
        self.workers = 0

    def build(self, total_steps: int):
        torch.manual_seed(self.args.seed)  # same initial encoder weights for both systems
        if self.name == "ours":
            from moco_lightning import MoCo
            from moco_lightning.datamodules import FashionMNISTDataModule

            model = MoCo(**moco_kwargs(self.args))
            dm = FashionMNISTDataModule(data_dir=self.args.data_dir, batch_size=self.args.batch_size, num_workers=0,
                                        seed=self.args.seed, val_subset=self.args.batch_size)
            return model, model, {"datamodule": dm}
        model = make_reference(self.args, total_steps=total_steps, channels_last=self.args.ref_channels_last)
        loader = reference_loader(*self.train, self.args.batch_size, self.workers, self.args.seed)
        return model, FeatureExtractor(model), {"train_dataloaders": loader}

    def fit(self, max_steps: int, callbacks: list, total_steps: Optional[int] = None) -> tuple[nn.Module, nn.Module]:
        import lightning.pytorch as pl

        model, features, data = self.build(total_steps or max_steps)
        spe = len(self.train[1]) // self.args.batch_size
        with tempfile.TemporaryDirectory() as tmp:
            kw = trainer_kwargs(max_steps, self.args.logger, tmp, callbacks, max_epochs=max(1, math.ceil(max_steps / spe)))
            pl.Trainer(**kw).fit(model, **data)
        return model, features

    def seconds_per_step(self, warmup: int, steps: int) -> float:
        clock = StepClock()
        self.fit(warmup + steps, [clock])
        return clock.seconds(warmup, steps) / steps


class Budget:
    """Lightning callback: the training clock (evaluations excluded), the kNN curve, the stop at the budget."""

    def __new__(cls, *a, **k):
        from lightning.pytorch import Callback

        class _Budget(Callback):
            def __init__(self, budget_s: float, eval_steps: set, evaluate: Callable[[nn.Module], float], spe: int, name: str) -> None:
                self.budget_s, self.eval_steps, self.evaluate, self.spe, self.name = budget_s, eval_steps, evaluate, spe, name
                self.train_s, self.curve, self.stopped_at_budget, self.eval_total = 0.0, [], False, 0.0

            def on_train_start(self, trainer, pl_module) -> None:
                self.last = time.perf_counter()

            def _point(self, pl_module, step: int) -> None:
                t = time.perf_counter()
                acc = self.evaluate(pl_module)
                self.eval_total += time.perf_counter() - t
                self.curve.append((self.train_s, step, step / self.spe, acc))
                print(f"    [{self.name}] step {step:5d} (epoch {step / self.spe:5.2f}), {self.train_s:6.1f} s of training: "
                      f"kNN top-1 {100 * acc:5.2f} % (curve set; eval {time.perf_counter() - t:.1f} s)", flush=True)

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                self.train_s += time.perf_counter() - self.last
                step = trainer.global_step
                if self.train_s >= self.budget_s and not trainer.should_stop:
                    trainer.should_stop = True
                    self.stopped_at_budget = True
                if step in self.eval_steps or trainer.should_stop:
                    self._point(pl_module, step)
                self.last = time.perf_counter()

            def on_train_end(self, trainer, pl_module) -> None:
                if not self.curve or self.curve[-1][1] != trainer.global_step:
                    self._point(pl_module, trainer.global_step)

        return _Budget(*a, **k)


# --- main -------------------------------------------------------------------------------------------------------
def pick_threads(args) -> None:
    """``--threads 0``: time a training step of the backbone with 1 thread and with every core (interleaved, twice)
    and keep the faster for the whole run (both systems). On a shared machine with other jobs running, several
    OpenMP threads wait for each other and one thread can be several times faster; on a free one, all cores win."""
    import os

    from moco_lightning.backbones import build_backbone

    cores = os.cpu_count() or 1
    if args.threads or cores == 1:
        return
    torch.manual_seed(args.seed)
    bb, _ = build_backbone(args.backbone, args.cifar_stem, 1, 28, args.width)
    x = torch.randn(args.batch_size, 1, 28, 28)
    if args.channels_last:
        bb, x = bb.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)

    def step() -> None:
        bb.zero_grad(set_to_none=True)
        bb(x).square().mean().backward()

    times = {1: [], cores: []}
    for _ in range(2):
        for n in times:
            torch.set_num_threads(n)
            step()
            t = time.perf_counter()
            step()
            times[n].append(time.perf_counter() - t)
    best = min(times, key=lambda n: min(times[n]))
    torch.set_num_threads(best)
    args.threads = best
    print("threads: " + ", ".join(f"{n} thread(s) {min(v):.2f} s/step" for n, v in times.items())
          + f" (backbone forward+backward) -> {best} thread(s) for the whole run\n", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    add_model_args(p, threads=0, threads_help="torch intra-op threads (default 0: time a backbone step with 1 thread and "
                   "with all cores first and keep the faster for the whole run, both systems)")
    p.add_argument("--data-dir", default=None, help="folder of the Fashion-MNIST IDX files (default: Debian's)")
    p.add_argument("--minutes", type=float, default=10.0, help="training wall-clock budget per system")
    p.add_argument("--systems", nargs="+", choices=["ours", "reference"], default=["ours", "reference"])
    p.add_argument("--curve-points", type=int, default=5, help="kNN evaluations during training (plus step 0 and the end)")
    p.add_argument("--curve-bank", type=int, default=10000, help="train images in the bank of the curve's kNN")
    p.add_argument("--curve-queries", type=int, default=2000, help="test images classified for the curve's kNN")
    p.add_argument("--eval-bank", type=int, default=60000, help="train images in the final kNN bank / probe training set")
    p.add_argument("--eval-queries", type=int, default=10000, help="test images of the final kNN / probe")
    p.add_argument("--eval-subset", type=int, default=None,
                   help="smoke runs: bank sizes = N, query counts = N // 4 (overrides the four options above)")
    p.add_argument("--probe-epochs", type=int, default=20, help="epochs of the final linear probe")
    p.add_argument("--speed-steps", type=int, default=8, help="timed steps of the speed measurement (after 3 warm-up)")
    p.add_argument("--ref-workers", type=int, nargs="+", default=[0, 2], help="reference DataLoader workers to try")
    p.add_argument("--ref-channels-last", action="store_true", help="run the reference in channels-last too")
    p.add_argument("--logger", choices=["tensorboard", "csv", "none"], default="none")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "quality.png"), help="the PNG (the CSV goes next to it)")
    args = p.parse_args(argv)
    if args.eval_subset:
        args.eval_bank = args.curve_bank = args.eval_subset
        args.eval_queries = args.curve_queries = max(100, args.eval_subset // 4)
    quiet()
    t0 = time.perf_counter()
    header("Quality for a fixed wall-clock budget: moco-lightning vs the lightly-examples pattern", args)
    pick_threads(args)
    budget = 60 * args.minutes
    print(f"model (both): {describe_model(args)}; SGD lr {args.lr} per 256, momentum 0.9, wd {args.weight_decay}, cosine lr")
    print(f"budget: {args.minutes:g} min of training per system (speed measurement and evaluations not counted)")
    print(f"kNN: k={K_NN}, T={T_NN}, cosine; curve set: bank {args.curve_bank} train / {args.curve_queries} test images; "
          f"final: bank {args.eval_bank} train / {args.eval_queries} test images; linear probe: {args.probe_epochs} epochs\n",
          flush=True)

    train, test = fashion_mnist("train", args.data_dir), fashion_mnist("test", args.data_dir)
    ev = Evaluator(args, train, test)
    spe = len(train[1]) // args.batch_size
    results, curves = {}, {}

    # baselines
    t = time.perf_counter()
    flat = nn.Flatten()
    results["raw pixels (normalised)"] = ev.final(flat)
    pixel_curve = ev.curve(flat)
    torch.manual_seed(args.seed)
    from moco_lightning import MoCo

    init = MoCo(**moco_kwargs(args))
    results["random-init encoder"] = ev.final(init)
    init_curve = ev.curve(init)
    del init
    print(f"baselines done in {time.perf_counter() - t:.0f} s: raw pixels kNN {100 * results['raw pixels (normalised)']['knn_top1']:.2f} %, "
          f"random-init encoder kNN {100 * results['random-init encoder']['knn_top1']:.2f} % (final set)\n", flush=True)

    for name in args.systems:
        system = System(name, args, train)
        label = "moco-lightning (ours)" if name == "ours" else "reference (lightly pattern)"
        print(f"-- {label} --", flush=True)
        if name == "reference":
            speeds = {}
            for w in args.ref_workers:
                system.workers = w
                speeds[w] = system.seconds_per_step(3, args.speed_steps)
                print(f"  speed with num_workers={w}: {speeds[w]:.3f} s/step", flush=True)
            system.workers = min(speeds, key=speeds.get)
            sps = speeds[system.workers]
        else:
            sps = system.seconds_per_step(3, args.speed_steps)
        total = max(1, int(budget / sps))
        eval_steps = {max(1, round(total * i / max(1, args.curve_points))) for i in range(1, args.curve_points + 1)}
        print(f"  speed {sps:.3f} s/step ({args.batch_size / sps:.0f} images/s)"
              + (f", num_workers={system.workers}" if name == "reference" else "")
              + f" -> plan {total} steps = {total / spe:.2f} epochs of {spe} steps; cosine lr over {total} steps", flush=True)
        to_features = (lambda m: m) if name == "ours" else FeatureExtractor
        budget_cb = Budget(budget, eval_steps, lambda module: ev.curve(to_features(module)), spe, name)
        _, features = system.fit(total, [budget_cb], total_steps=total)
        steps = budget_cb.curve[-1][1]
        final = ev.final(features)
        final.update(steps=steps, epochs=steps / spe, train_s=budget_cb.train_s, images_per_s=steps * args.batch_size / budget_cb.train_s,
                     planned_steps=total, stopped_at_budget=budget_cb.stopped_at_budget,
                     workers=system.workers if name == "reference" else 0)
        results[label] = final
        curves[label] = [(0.0, 0, 0.0, init_curve)] + budget_cb.curve
        print(f"  trained {steps} steps ({steps / spe:.2f} epochs) in {budget_cb.train_s:.0f} s"
              + (" (stopped at the budget)" if budget_cb.stopped_at_budget else "")
              + f"; final kNN {100 * final['knn_top1']:.2f} %, linear probe {100 * final['probe_top1']:.2f} % "
              f"(final evaluation {final['eval_s']:.0f} s)\n", flush=True)

    # report
    rows = []
    for label, r in results.items():
        rows.append([label, f"{r['epochs']:.2f}" if "epochs" in r else "-", str(r.get("steps", "-")),
                     f"{r['train_s']:.0f}" if "train_s" in r else "-", f"{r['images_per_s']:.0f}" if "images_per_s" in r else "-",
                     f"{100 * r['knn_top1']:.2f}", f"{100 * r['probe_top1']:.2f}"])
    print(f"final evaluation: kNN bank {args.eval_bank} train images, {args.eval_queries} test queries; probe trained on "
          f"the same {args.eval_bank} train features")
    print_table(rows, ["system", "epochs", "steps", "train s", "images/s", "kNN top-1 %", "linear probe top-1 %"])

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    csv_path = out.with_suffix(".csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["system", "kind", "step", "epoch", "train_seconds", "knn_top1", "probe_top1", "bank", "queries"])
        for label, pts in curves.items():
            for s, step, ep, acc in pts:
                w.writerow([label, "curve", step, f"{ep:.4f}", f"{s:.2f}", f"{acc:.4f}", "", args.curve_bank, args.curve_queries])
        w.writerow(["raw pixels (normalised)", "curve", "", "", "", f"{pixel_curve:.4f}", "", args.curve_bank, args.curve_queries])
        for label, r in results.items():
            w.writerow([label, "final", r.get("steps", ""), f"{r['epochs']:.4f}" if "epochs" in r else "",
                        f"{r['train_s']:.2f}" if "train_s" in r else "", f"{r['knn_top1']:.4f}", f"{r['probe_top1']:.4f}",
                        args.eval_bank, args.eval_queries])
    plot(out, curves, pixel_curve, init_curve, args)
    print(f"wrote {out} and {csv_path}")
    footer(t0)


def plot(out: Path, curves: dict, pixel_curve: float, init_curve: float, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for (label, pts), style in zip(curves.items(), ("o-", "s--")):
        ax.plot([p[0] / 60 for p in pts], [100 * p[3] for p in pts], style, label=label)
    ax.axhline(100 * pixel_curve, color="gray", ls=":", label=f"raw pixels ({100 * pixel_curve:.1f} %)")
    ax.axhline(100 * init_curve, color="gray", ls="-.", lw=0.8, label=f"random-init encoder ({100 * init_curve:.1f} %)")
    ax.set_xlabel("training wall time (min; evaluations excluded)")
    ax.set_ylabel("kNN top-1 (%)")
    ax.set_title(f"Fashion-MNIST, {args.minutes:g} min per system: kNN (k={K_NN}, T={T_NN}), bank {args.curve_bank}, "
                 f"{args.curve_queries} test", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.text(0.01, 0.005, describe_model(args) + f"; torch threads {torch.get_num_threads()}", fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(out)
    plt.close(fig)


if __name__ == "__main__":
    main()
