"""A budgeted recipe search on Fashion-MNIST: successive halving, selected on a validation split, never the test split.

    python benchmarks/recipe_search.py --rungs 1.5 5 10 30 --keep 6 2 1 1 --candidates base crop_0.5 ... crop_1.0_width1
        # stage 1 of the README: the first 18 candidates (its rung 2 was cut short after 2 of 6 by a machine restart)
    python benchmarks/recipe_search.py --rungs 5 --keep 1 --candidates crop_1.0_batch128 crop_1.0_K1024 \\
        crop_1.0_batch128_K1024 --out benchmarks/results/recipe_search_stage2.png   # stage 2: the best two combined
    python benchmarks/recipe_search.py --rungs 0.05 0.1 --keep 3 1 --eval-subset 400 --probe-epochs 1 \\
        --candidates base crop_1.0 crop_1.0_sym --out /tmp/rs.png                                  # a smoke run

Every candidate is a set of CLI overrides of ``configs/fashion_mnist_moco_v2.yaml`` (the first quickstart's MoCo v2
recipe). Selection (``quality.py --split val``): pretraining, kNN bank and probe training on the first 50k train
images, queries = the last 10k train images; the official test split is not read at all.

1. timing: every candidate's seconds per step on this machine (3 warm-up + 8 timed steps, the median of
   ``--timing-repeats`` interleaved passes), measured once, first, so that the machine's load during the long runs
   changes their wall time but not the steps they get;
2. rung r: every remaining candidate trains ``rungs[r]`` minutes' worth of steps (the cosine lr spanning them,
   from the same initial weights) and is evaluated; the best ``keep[r]`` by validation kNN top-1 go on;
3. output: a CSV of every run (candidate, rung, steps, epochs, kNN, probe) and a plot of each rung's kNN.

Report the chosen recipes once on the test split with ``quality.py``.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import footer, header, print_table, quiet  # noqa: E402
from quality import Splits, System, add_common_args, run_system  # noqa: E402

BASE = "fashion_mnist_moco_v2"
D = "--data.init_args."
NO_CROP = (f"{D}min_scale=1.0",)
CANDIDATES = {  # name -> overrides of BASE
    "base": (),
    "crop_0.5": (f"{D}min_scale=0.5",),
    "crop_0.9": (f"{D}min_scale=0.9",),
    "crop_1.0": NO_CROP,
    "crop_1.0_sym": (*NO_CROP, "--model.symmetric=true"),
    "crop_1.0_T0.1": (*NO_CROP, "--model.temperature=0.1"),
    "crop_1.0_T0.5": (*NO_CROP, "--model.temperature=0.5"),
    "crop_1.0_jitter0.8": (*NO_CROP, f"{D}jitter_strength=0.8"),
    "crop_1.0_K1024": (*NO_CROP, "--model.queue_size=1024"),
    "crop_1.0_K16384": (*NO_CROP, "--model.queue_size=16384"),
    "crop_1.0_lr0.03": (*NO_CROP, "--model.lr=0.03"),
    "crop_1.0_lr0.12": (*NO_CROP, "--model.lr=0.12"),
    "crop_1.0_batch128": (*NO_CROP, f"{D}batch_size=128", "--model.bn_splits=4"),
    "crop_1.0_cifar_stem_w0.25": (*NO_CROP, "--model.cifar_stem=true", "--model.width=0.25"),
    "crop_1.0_multicrop2x16": (*NO_CROP, f"{D}local_views=2", f"{D}local_size=16", f"{D}local_scale=[0.3,0.7]"),
    "crop_1.0_m_cosine": (*NO_CROP, "--model.momentum_schedule=cosine"),
    "crop_1.0_lars": (*NO_CROP, "--model.optimizer=lars", "--model.lr=0.3", "--model.weight_decay=1e-6"),
    "crop_1.0_width1": (*NO_CROP, "--model.width=1.0"),
    # stage 2 (README): the two best of stage 1 combined, with and without the cosine momentum
    "crop_1.0_batch128_K1024": (*NO_CROP, f"{D}batch_size=128", "--model.bn_splits=4", "--model.queue_size=1024"),
    "crop_1.0_batch128_K1024_m_cosine": (
        *NO_CROP,
        f"{D}batch_size=128",
        "--model.bn_splits=4",
        "--model.queue_size=1024",
        "--model.momentum_schedule=cosine",
    ),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES), metavar="NAME")
    p.add_argument("--rungs", type=float, nargs="+", default=[1.5, 5.0, 10.0], help="minutes of training per rung")
    p.add_argument("--keep", type=int, nargs="+", default=[6, 2, 1], help="how many go on after each rung")
    p.add_argument("--timing-repeats", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "recipe_search.png"))
    add_common_args(p)
    p.set_defaults(split="val", curve_points=1, curve_bank=2000, curve_queries=500)
    args = p.parse_args(argv)
    if args.split != "val":
        p.error("recipes are selected on --split val; report the chosen ones with quality.py --split test")
    quiet()
    t0 = time.perf_counter()
    header("Recipe search: successive halving on the validation split", args)
    splits = Splits("val", args.eval_subset, args.curve_bank, args.curve_queries)
    systems = {n: System(n, args, splits, config=BASE, overrides=CANDIDATES[n]) for n in args.candidates}
    timings = {n: [] for n in systems}
    for r in range(args.timing_repeats):
        for n in systems if r % 2 == 0 else list(systems)[::-1]:
            timings[n].append(systems[n].seconds_per_step())
    sps = {n: statistics.median(v) for n, v in timings.items()}
    print("seconds per step: " + ", ".join(f"{n} {v:.3f}" for n, v in sps.items()) + "\n", flush=True)

    rows, alive = [], list(systems)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r, minutes in enumerate(args.rungs):
        print(f"== rung {r + 1}: {len(alive)} candidates x {minutes:g} min ==", flush=True)
        scores = {}
        for n in alive:
            res = run_system(systems[n], 60 * minutes, args.curve_points, sps=sps[n], stop_at_budget=False)
            scores[n] = res["knn_top1"]
            rows.append(
                {
                    "candidate": n,
                    "rung": r + 1,
                    "minutes": minutes,
                    "steps": res["steps"],
                    "epochs": f"{res['epochs']:.2f}",
                    "seconds_per_step": f"{sps[n]:.4f}",
                    "knn_top1": f"{res['knn_top1']:.4f}",
                    "probe_top1": f"{res.get('probe_top1', float('nan')):.4f}",
                    "overrides": " ".join(CANDIDATES[n]),
                }
            )
            with open(out.with_suffix(".csv"), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        keep = args.keep[r] if r < len(args.keep) else 1
        alive = sorted(alive, key=scores.get, reverse=True)[:keep]
        print(f"   -> kept {alive}\n", flush=True)
    print_table(
        [
            [
                x["candidate"],
                str(x["rung"]),
                x["minutes"],
                x["epochs"],
                f"{100 * float(x['knn_top1']):.2f}",
                f"{100 * float(x['probe_top1']):.2f}",
            ]
            for x in rows
        ],
        ["candidate", "rung", "minutes", "epochs", "val kNN %", "val probe %"],
    )
    plot(out, rows)
    print(f"chosen: {alive[0]} ({' '.join(CANDIDATES[alive[0]]) or 'the base config'})")
    print(f"wrote {out} and {out.with_suffix('.csv')}")
    footer(t0)


def plot(out: Path, rows: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rungs = sorted({x["rung"] for x in rows})
    fig, axes = plt.subplots(1, len(rungs), figsize=(4.5 * len(rungs), 4.5), dpi=120, squeeze=False)
    for ax, r in zip(axes[0], rungs):
        sel = sorted((x for x in rows if x["rung"] == r), key=lambda x: float(x["knn_top1"]))
        ax.barh([x["candidate"] for x in sel], [100 * float(x["knn_top1"]) for x in sel], color="tab:blue", alpha=0.85)
        lo = min(100 * float(x["knn_top1"]) for x in sel)
        ax.set_xlim(lo - 2, None)
        ax.set_title(f"rung {r}: {float(sel[0]['minutes']):g} min each (val kNN top-1 %)", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


if __name__ == "__main__":
    main()
