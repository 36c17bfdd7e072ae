"""The MoCo paper's ablations in miniature, on Fashion-MNIST, each run with the same step budget.

    python -m benchmarks.ablations                                                # the 10 runs (~50 min on 2 cores)
    python -m benchmarks.ablations --steps 40 --eval-subset 2000 --out /tmp/abl.png  # smoke run

He et al. (CVPR 2020, https://arxiv.org/abs/1911.05722) argue by comparison; this script repeats each comparison
on a CPU-sized problem, every run a config override of ``configs/fashion_mnist_moco_v2.yaml`` (the MoCo v2 recipe of
the first quickstart: m 0.99, K 4096, split BN):

- momentum m of the key encoder (§4.1): m in {0, 0.9, 0.99, 0.999};
- dictionary (queue) size K (Fig. 3): K in {256, 1024, 4096, 16384};
- shuffling BN (§3.3, Fig. A.1): split BN (the one-device stand-in for shuffle BN) on vs off;
- the three dictionary mechanisms at ~256 negatives (Fig. 3): end-to-end (``moco_lightning.EndToEnd``: the 255
  other keys of the batch), memory bank (``moco_lightning.MemoryBankMoCo``: 256 negatives sampled from one stored
  feature per training image, bank momentum 0.5) and the MoCo queue (K 256).

Every run starts from the same weights, sees the same batches and stops after ``--steps`` optimizer steps with a
cosine lr over them; evaluation as ``quality.py --split test``. Output: the table, a CSV (written as each run ends;
``--resume`` skips the runs it holds) and a PNG next to it.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

import torch

from benchmarks._common import (
    config_path,
    evaluate,
    footer,
    from_config,
    header,
    parser,
    print_table,
    quiet,
    trainer_kwargs,
)
from benchmarks.quality import Splits

BASE = "fashion_mnist_moco_v2"
DEFAULT = "default: m 0.99, K 4096, split BN"
E2E, BANK = "--model.class_path=moco_lightning.EndToEnd", "--model.class_path=moco_lightning.MemoryBankMoCo"
# name -> (groups, overrides of the base config). The default run is in every group but the last.
RUNS = {
    DEFAULT: (("momentum", "K", "BN"), []),
    "m 0": (("momentum",), ["--model.momentum=0"]),
    "m 0.9": (("momentum",), ["--model.momentum=0.9"]),
    "m 0.999": (("momentum",), ["--model.momentum=0.999"]),
    "K 256": (("K", "mechanism"), ["--model.queue_size=256"]),
    "K 1024": (("K",), ["--model.queue_size=1024"]),
    "K 16384": (("K",), ["--model.queue_size=16384"]),
    "BN off": (("BN",), ["--model.shuffle_bn=off"]),
    "end-to-end (batch)": (("mechanism",), [E2E]),
    "memory bank": (
        ("mechanism",),
        [BANK, "--model.num_negatives=256", "--model.memory_bank_size=60000", "--model.bank_momentum=0.5"],
    ),
}
# What the paper (ImageNet-1M, ResNet-50, linear top-1 %) and the official CIFAR-10 demo report, for the README.
PAPER = {
    "m 0": "fails to train",
    "m 0.9": "55.2",
    DEFAULT: "57.8 (m 0.99)",
    "m 0.999": "59.0",
    "K 256": "lower than larger K (Fig. 3)",
    "K 1024": "lower than larger K (Fig. 3)",
    "K 16384": "higher than K 4096 on ImageNet (Fig. 3); CIFAR demo: saturates at 4096",
    "BN off": "cheats the pretext task, lower accuracy (§3.3, Fig. A.1); CIFAR demo: -4 at 800 ep",
    "end-to-end (batch)": "close to the queue at equal K (Fig. 3), but K limited by the batch",
    "memory bank": "below the queue at every K (Fig. 3)",
}
FIELDS = ["run", "groups", "overrides", "steps", "train_s", "final_loss", "knn_top1", "probe_top1", "paper"]


def mechanism_config(class_path: str) -> Path:
    """The base config for another dictionary mechanism: its model section with only the settings ``class_path``'s
    class accepts (EndToEnd and MemoryBankMoCo have no queue, momentum encoder or shuffle BN), everything else the
    base's, in a temporary file."""
    import importlib
    import tempfile

    import yaml

    from moco_lightning.training.compat import constructor_arguments

    module, _, name = class_path.rpartition(".")
    accepted = constructor_arguments(getattr(importlib.import_module(module), name))
    config = yaml.safe_load(config_path(BASE).read_text())
    model = config["model"]
    args = model.get("init_args", {k: v for k, v in model.items() if k != "class_path"})
    config["model"] = {"class_path": class_path, "init_args": {k: v for k, v in args.items() if k in accepted}}
    path = Path(tempfile.mkdtemp()) / f"{BASE}_{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def train(overrides: list, args, n_images: int) -> dict:
    import lightning.pytorch as pl

    torch.manual_seed(args.seed)
    mechanism = [o.split("=", 1)[1] for o in overrides if o.startswith("--model.class_path=")]
    config = mechanism_config(mechanism[0]) if mechanism else config_path(BASE)
    rest = [o for o in overrides if not o.startswith("--model.class_path=")]
    model, dm = from_config(config, *rest, f"--data.init_args.train_subset={n_images}")
    trainer = pl.Trainer(**trainer_kwargs(args.steps, []))
    t = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    return {
        "model": model,
        "steps": trainer.global_step,
        "train_s": time.perf_counter() - t,
        "final_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
    }


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=1400, help="optimizer steps per run (234 steps = 1 epoch at batch 256)")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), metavar="RUN")
    p.add_argument("--eval-subset", type=int, default=None, help="smoke runs: bank N train images, N // 4 test queries")
    p.add_argument("--probe-epochs", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="keep the runs already in the CSV and run only the others")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "ablations.png"))
    args = p.parse_args(argv)
    quiet()
    t0 = time.perf_counter()
    header(f"The MoCo paper's ablations in miniature (Fashion-MNIST, configs/{BASE}.yaml)", args)
    splits = Splits("test", args.eval_subset, 1, 1)
    out, csv_path = Path(args.out), Path(args.out).with_suffix(".csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if args.resume and csv_path.exists():
        with open(csv_path, newline="") as f:
            done = {row["run"]: row for row in csv.DictReader(f)}

    def record(name: str, groups: str, overrides: str, result: dict) -> None:
        done[name] = {
            "run": name,
            "groups": groups,
            "overrides": overrides,
            "paper": PAPER.get(name, ""),
            **{k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in result.items() if k in FIELDS},
        }
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(done.values())

    torch.manual_seed(args.seed)
    for name, module in (
        ("raw pixels", torch.nn.Flatten()),
        ("random-init encoder", from_config(config_path(BASE))[0]),
    ):
        if name not in done:
            record(name, "baseline", "", evaluate(module, splits.bank, splits.queries, args.probe_epochs, args.seed))
    for name in args.runs:
        if name in done:
            continue
        groups, overrides = RUNS[name]
        print(f"-- {name} ({' '.join(overrides) or 'the base config'})", flush=True)
        r = train(overrides, args, len(splits.pretrain[1]))
        r.update(evaluate(r.pop("model"), splits.bank, splits.queries, args.probe_epochs, args.seed))
        record(name, " ".join(groups), " ".join(overrides), r)
        print(
            f"   {r['steps']} steps in {r['train_s']:.0f} s, final loss {r['final_loss']:.3f}: kNN "
            f"{100 * r['knn_top1']:.2f} %, probe {100 * r['probe_top1']:.2f} %",
            flush=True,
        )
    rows = [
        [
            n,
            r["groups"],
            r.get("final_loss", "") and f"{float(r['final_loss']):.3f}",
            f"{100 * float(r['knn_top1']):.2f}",
            f"{100 * float(r['probe_top1']):.2f}",
            r.get("paper", ""),
        ]
        for n, r in done.items()
    ]
    print_table(
        rows, ["run", "groups", "final loss", "kNN top-1 %", "probe top-1 %", "paper (ImageNet, R50, linear top-1 %)"]
    )
    plot(out, done, args)
    print(f"wrote {out} and {csv_path}")
    footer(t0)


def plot(out: Path, rows: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("key-encoder momentum m", ["m 0", "m 0.9", DEFAULT, "m 0.999"], ["0", "0.9", "0.99", "0.999"]),
        ("queue size K", ["K 256", "K 1024", DEFAULT, "K 16384"], ["256", "1024", "4096", "16384"]),
        ("BatchNorm of the encoders", ["BN off", DEFAULT], ["off", "split BN\n(8 x 32)"]),
        (
            "dictionary, ~256 negatives",
            ["end-to-end (batch)", "memory bank", "K 256"],
            ["end-to-end\n(batch)", "memory\nbank", "MoCo queue\n(K 256)"],
        ),
    ]
    base = {n: 100 * float(rows[n]["knn_top1"]) for n in ("raw pixels", "random-init encoder") if n in rows}
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.8), dpi=120, sharey=True)
    for ax, (title, names, ticks) in zip(axes, panels):
        present = [(t, 100 * float(rows[n]["knn_top1"]), n) for n, t in zip(names, ticks) if n in rows]
        if present:
            bars = ax.bar(
                range(len(present)),
                [v for _, v, _ in present],
                alpha=0.85,
                color=["tab:orange" if n == DEFAULT else "tab:blue" for _, _, n in present],
            )
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
            ax.set_xticks(range(len(present)), [t for t, _, _ in present], fontsize=7)
        for (label, v), ls in zip(base.items(), (":", "-.")):
            ax.axhline(v, color="gray", ls=ls, lw=1, label=f"{label} ({v:.1f})")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    values = [100 * float(r["knn_top1"]) for r in rows.values()]
    axes[0].set_ylim(max(0.0, min(values) - 5), min(100.0, max(values) + 3))
    axes[0].set_ylabel("kNN top-1 on the 10k test split (%)")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.text(0.01, 0.005, f"Fashion-MNIST, {args.steps} steps per run, configs/{BASE}.yaml", fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out)
    plt.close(fig)


if __name__ == "__main__":
    main()
