"""The MoCo paper's ablations in miniature, on Fashion-MNIST, each run with the same step budget.

    python benchmarks/ablations.py                                  # the 10 runs (~50 min on 2 cores)
    python benchmarks/ablations.py --steps 40 --eval-subset 2000 --out /tmp/abl.png   # smoke run (~3 min)

He et al., "Momentum Contrast for Unsupervised Visual Representation Learning", CVPR 2020
(https://arxiv.org/abs/1911.05722) argue by comparison; this script repeats each comparison on a CPU-sized problem:

- momentum m of the key encoder (§4.1, Table "momentum"): m in {0, 0.9, 0.99, 0.999};
- dictionary (queue) size K (Fig. 3): K in {256, 1024, 4096, 16384};
- shuffling BN (§3.3, Fig. A.1): split BN (the one-device stand-in for shuffle BN) on vs off;
- the three dictionary mechanisms at equal numbers of negatives (Fig. 3): end-to-end (``dictionary="batch"``:
  the 255 other keys of the batch of 256), memory bank (InstDisc: 256 negatives sampled from one stored feature
  per training image, bank momentum 0.5) and the MoCo queue (K = 256).

The default run (m 0.99, K 4096, split BN on) is shared by the groups. Every run starts from the same weights
(``--seed``), sees the same batches and stops after ``--steps`` optimizer steps with a cosine lr over them; then
the backbone's features are evaluated as in ``quality.py``: weighted kNN top-1 (k=200, T=0.1, cosine; bank = the
train split, queries = the official 10k test split) and a linear probe on frozen features. Baselines: the
random-init encoder and raw pixels. Output: the table (printed), a CSV (one row per run, written as each run ends;
``--resume`` skips the runs it already holds) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_model_args, describe_model, fashion_mnist, footer, header, moco_kwargs, print_table, quiet, trainer_kwargs,
)
from quality import Evaluator  # noqa: E402

DEFAULT = "default: m 0.99, K 4096, split BN"
# name -> (groups it belongs to, MoCo overrides of the default). The default run is in every group but the last.
RUNS = {
    DEFAULT: (("momentum", "K", "BN"), {}),
    "m 0": (("momentum",), {"momentum": 0.0}),
    "m 0.9": (("momentum",), {"momentum": 0.9}),
    "m 0.999": (("momentum",), {"momentum": 0.999}),
    "K 256": (("K", "mechanism"), {"queue_size": 256}),
    "K 1024": (("K",), {"queue_size": 1024}),
    "K 16384": (("K",), {"queue_size": 16384}),
    "BN off": (("BN",), {"shuffle_bn": "off"}),
    "end-to-end (batch)": (("mechanism",), {"dictionary": "batch", "queue_size": 0}),
    "memory bank": (("mechanism",), {"dictionary": "memory_bank", "queue_size": 256, "memory_bank_size": 60000,
                                     "momentum": 0.5}),
}
# What the paper (ImageNet-1M, ResNet-50, linear top-1 %) and the official CIFAR-10 demo report, for the README.
PAPER = {"m 0": "fails to train", "m 0.9": "55.2", DEFAULT: "57.8 (m 0.99)", "m 0.999": "59.0",
         "K 256": "lower than larger K (Fig. 3)", "K 1024": "lower than larger K (Fig. 3)",
         "K 16384": "higher than K 4096 on ImageNet (Fig. 3); CIFAR demo: saturates at 4096",
         "BN off": "cheats the pretext task, lower accuracy (§3.3, Fig. A.1); CIFAR demo: -4 at 800 ep",
         "end-to-end (batch)": "close to the queue at equal K (Fig. 3), but K limited by the batch",
         "memory bank": "below the queue at every K (Fig. 3)"}
FIELDS = ["run", "groups", "overrides", "steps", "epochs", "train_s", "images_per_s", "final_loss", "knn_top1",
          "probe_top1", "paper"]


def train_one(name: str, overrides: dict, args) -> dict:
    """Pretrain one configuration for ``args.steps`` steps; its trained MoCo module and timings."""
    import lightning.pytorch as pl

    from moco_lightning import MoCo
    from moco_lightning.datamodules import FashionMNISTDataModule

    pl.seed_everything(args.seed, verbose=False)
    model = MoCo(**moco_kwargs(args, **overrides))
    dm = FashionMNISTDataModule(data_dir=args.data_dir, batch_size=args.batch_size, seed=args.seed)
    spe = 60000 // args.batch_size
    trainer = pl.Trainer(**trainer_kwargs(args.steps, "none", "", [], max_epochs=math.ceil(args.steps / spe)))
    t = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    train_s = time.perf_counter() - t
    return {"model": model, "steps": trainer.global_step, "epochs": trainer.global_step / spe, "train_s": train_s,
            "images_per_s": trainer.global_step * args.batch_size / train_s,
            "final_loss": float(trainer.callback_metrics.get("train/loss", float("nan")))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    add_model_args(p, threads=0, threads_help="torch intra-op threads (default 0: one per core)")
    p.add_argument("--data-dir", default=None, help="folder of the Fashion-MNIST IDX files (default: Debian's)")
    p.add_argument("--steps", type=int, default=1400, help="optimizer steps per run (234 steps = 1 epoch at batch 256)")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), metavar="RUN",
                   help="a subset of: " + "; ".join(RUNS) + " (orange in the plot: the default)")
    p.add_argument("--eval-bank", type=int, default=60000, help="train images in the kNN bank / probe training set")
    p.add_argument("--eval-queries", type=int, default=10000, help="test images classified")
    p.add_argument("--eval-subset", type=int, default=None, help="smoke runs: bank N train images, N // 4 test queries")
    p.add_argument("--probe-epochs", type=int, default=10, help="epochs of the linear probe")
    p.add_argument("--resume", action="store_true", help="keep the runs already in the CSV and run only the others")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "ablations.png"),
                   help="the PNG (the CSV goes next to it)")
    args = p.parse_args(argv)
    if args.eval_subset:
        args.eval_bank, args.eval_queries = args.eval_subset, max(100, args.eval_subset // 4)
    args.curve_bank, args.curve_queries = args.eval_bank, args.eval_queries  # Evaluator wants them; unused here
    quiet()
    t0 = time.perf_counter()
    header("The MoCo paper's ablations in miniature (Fashion-MNIST)", args)
    spe = 60000 // args.batch_size
    print(f"model (default run): {describe_model(args)}; SGD lr {args.lr} per 256, wd {args.weight_decay}, cosine lr")
    print(f"budget: {args.steps} steps = {args.steps / spe:.2f} epochs of the 60k train split per run, same seed, same batches")
    print(f"evaluation: kNN k=200 T=0.1 (bank {args.eval_bank} train images, {args.eval_queries} test queries); "
          f"linear probe {args.probe_epochs} epochs on the same frozen train features\n", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    csv_path = out.with_suffix(".csv")
    done = {}
    if args.resume and csv_path.exists():
        with open(csv_path, newline="") as f:
            done = {row["run"]: row for row in csv.DictReader(f)}
        print(f"resuming: {len(done)} rows already in {csv_path}\n")
    ev = Evaluator(args, fashion_mnist("train", args.data_dir), fashion_mnist("test", args.data_dir))

    def write(rows: dict) -> None:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows.values())

    def record(name: str, groups: str, overrides: str, result: dict) -> None:
        done[name] = {"run": name, "groups": groups, "overrides": overrides, "paper": PAPER.get(name, ""),
                      **{k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in result.items() if k in FIELDS}}
        write(done)

    for name, module in (("raw pixels", torch.nn.Flatten()), ("random-init encoder", None)):
        if name in done:
            continue
        if module is None:
            from moco_lightning import MoCo

            torch.manual_seed(args.seed)
            module = MoCo(**moco_kwargs(args))
        r = ev.final(module)
        record(name, "baseline", "", {"knn_top1": r["knn_top1"], "probe_top1": r["probe_top1"]})
        print(f"baseline {name}: kNN {100 * r['knn_top1']:.2f} %, linear probe {100 * r['probe_top1']:.2f} %", flush=True)

    for name in args.runs:
        if name in done:
            continue
        groups, overrides = RUNS[name]
        print(f"-- {name} ({', '.join(f'{k}={v}' for k, v in overrides.items()) or 'the default settings'})", flush=True)
        r = train_one(name, overrides, args)
        e = ev.final(r.pop("model"))
        r.update(knn_top1=e["knn_top1"], probe_top1=e["probe_top1"])
        record(name, " ".join(groups), " ".join(f"{k}={v}" for k, v in overrides.items()), r)
        print(f"   {r['steps']} steps ({r['epochs']:.2f} epochs) in {r['train_s']:.0f} s ({r['images_per_s']:.0f} images/s), "
              f"final loss {r['final_loss']:.3f}: kNN {100 * e['knn_top1']:.2f} %, linear probe {100 * e['probe_top1']:.2f} % "
              f"(evaluation {e['eval_s']:.0f} s)", flush=True)

    rows = [[n, r["groups"], r.get("epochs", "") and f"{float(r['epochs']):.2f}",
             r.get("train_s", "") and f"{float(r['train_s']):.0f}", r.get("final_loss", "") and f"{float(r['final_loss']):.3f}",
             f"{100 * float(r['knn_top1']):.2f}", f"{100 * float(r['probe_top1']):.2f}", r.get("paper", "")]
            for n, r in done.items()]
    print()
    print_table(rows, ["run", "groups", "epochs", "train s", "final loss", "kNN top-1 %", "probe top-1 %",
                       "paper (ImageNet, R50, linear top-1 %)"])
    plot(out, done, args)
    print(f"wrote {out} and {csv_path}")
    footer(t0)


def plot(out: Path, rows: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("momentum", "key-encoder momentum m", ["m 0", "m 0.9", DEFAULT, "m 0.999"], ["0", "0.9", "0.99", "0.999"]),
              ("K", "queue size K", ["K 256", "K 1024", DEFAULT, "K 16384"], ["256", "1024", "4096", "16384"]),
              ("BN", "BatchNorm of the encoders", ["BN off", DEFAULT], ["off", "split BN\n(8 x 32)"]),
              ("mechanism", "dictionary, ~256 negatives", ["end-to-end (batch)", "memory bank", "K 256"],
               ["end-to-end\n(batch)", "memory\nbank", "MoCo queue\n(K 256)"])]
    base = {n: 100 * float(rows[n]["knn_top1"]) for n in ("raw pixels", "random-init encoder") if n in rows}
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.8), dpi=120, sharey=True)
    for ax, (_, title, names, ticks) in zip(axes, panels):
        present = [(t, 100 * float(rows[n]["knn_top1"]), n) for n, t in zip(names, ticks) if n in rows]
        if present:
            bars = ax.bar(range(len(present)), [v for _, v, _ in present], alpha=0.85,
                          color=["tab:orange" if n == DEFAULT else "tab:blue" for _, _, n in present])
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
    fig.text(0.01, 0.005, f"Fashion-MNIST, {args.steps} steps ({args.steps / (60000 // args.batch_size):.1f} epochs) per run; "
             + describe_model(args), fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out)
    plt.close(fig)


if __name__ == "__main__":
    main()
