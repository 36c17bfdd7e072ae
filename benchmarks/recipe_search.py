"""A budgeted recipe search on Fashion-MNIST: successive halving, selected on a validation split, never the test split.

    python benchmarks/recipe_search.py --rungs 1 4 16 --keep 6 2 1 --candidates qs qs_translate3 ...  # round 3 (QE)

    python benchmarks/recipe_search.py --unit minutes --rungs 1.5 5 10 30 --keep 6 2 1 1 \\
        --candidates base ... crop_1.0_width1   # round 1, stage 1: the first 18 candidates
    python benchmarks/recipe_search.py --unit minutes --rungs 5 --keep 1 --candidates crop_1.0_batch128 \\
        crop_1.0_K1024 crop_1.0_batch128_K1024 --out benchmarks/results/recipe_search_stage2.png   # stage 2
    python benchmarks/recipe_search.py --rungs 0.01 0.02 --keep 3 1 --eval-subset 400 --probe-epochs 1 \\
        --candidates qs qs_strong qs_strong_sym --out /tmp/rs.png                                   # a smoke run

Every candidate is a config of ``configs/`` and CLI overrides (rounds 1-2: of ``fashion_mnist_moco_v2.yaml``, the first
quickstart's MoCo v2 recipe; round 3: of ``quickstart.yaml``). Budgets are quickstart-epoch equivalents (``--unit qe``,
the default: 1 QE = one epoch of ``configs/quickstart.yaml``, timed with the candidates) or minutes (rounds 1-2).
Selection (``quality.py --split val``): pretraining, kNN bank and probe training on the first 50k train images,
queries = the last 10k train images; the official test split is not read at all.

1. timing: every candidate's seconds per step on this machine (3 warm-up + ``--timing-steps`` timed steps, the
   fastest of ``--timing-repeats`` interleaved passes: on a shared machine other processes only ever add time),
   measured once, first, so that the machine's load during the long runs
   changes their wall time but not the steps they get;
2. rung r: every remaining candidate trains ``rungs[r]`` QE's (or minutes') worth of steps (the cosine lr spanning
   them, from the same initial weights) and is evaluated; the best ``keep[r]`` by ``--select`` go on (default: the
   mean of the validation kNN top-1 and the 1 %-label linear top-1, the metric a user with few labels cares about);
3. output: a CSV of every run (candidate, rung, steps, epochs, kNN, probe, 1 %-label linear, the pretext task's
   final train/acc1: near 1.0 the views no longer teach) and a plot of each rung's kNN.

Report the chosen recipes once on the test split with ``quality.py``.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import footer, header, print_table, quiet  # noqa: E402
from quality import QE_CONFIG, Splits, System, add_common_args, quickstart_epoch_seconds, run_system  # noqa: E402

D = "--data.init_args."
NO_CROP = (f"{D}min_scale=1.0",)
V2 = "fashion_mnist_moco_v2"  # the first quickstart's MoCo v2 recipe: the base of the 2026 rounds 1-2 candidates
QS = "quickstart"  # the recipe those rounds chose (no crop, batch 128, K 1024): the base of round 3
#: round 3 (issue #23): views that keep a small centred image recognisable but make the pretext task hard again
STRONG = (f"{D}translate=3", f"{D}rotation=10", f"{D}erase_prob=0.25", f"{D}jitter_strength=0.6")
CANDIDATES = {  # name -> (config, overrides)
    "base": (V2, ()),
    "crop_0.5": (V2, (f"{D}min_scale=0.5",)),
    "crop_0.9": (V2, (f"{D}min_scale=0.9",)),
    "crop_1.0": (V2, NO_CROP),
    "crop_1.0_sym": (V2, (*NO_CROP, "--model.symmetric=true")),
    "crop_1.0_T0.1": (V2, (*NO_CROP, "--model.temperature=0.1")),
    "crop_1.0_T0.5": (V2, (*NO_CROP, "--model.temperature=0.5")),
    "crop_1.0_jitter0.8": (V2, (*NO_CROP, f"{D}jitter_strength=0.8")),
    "crop_1.0_K1024": (V2, (*NO_CROP, "--model.queue_size=1024")),
    "crop_1.0_K16384": (V2, (*NO_CROP, "--model.queue_size=16384")),
    "crop_1.0_lr0.03": (V2, (*NO_CROP, "--model.lr=0.03")),
    "crop_1.0_lr0.12": (V2, (*NO_CROP, "--model.lr=0.12")),
    "crop_1.0_batch128": (V2, (*NO_CROP, f"{D}batch_size=128", "--model.bn_splits=4")),
    "crop_1.0_cifar_stem_w0.25": (V2, (*NO_CROP, "--model.cifar_stem=true", "--model.width=0.25")),
    "crop_1.0_multicrop2x16": (
        V2,
        (*NO_CROP, f"{D}local_views=2", f"{D}local_size=16", f"{D}local_scale=[0.3,0.7]"),
    ),
    "crop_1.0_m_cosine": (V2, (*NO_CROP, "--model.momentum_schedule=cosine")),
    "crop_1.0_lars": (V2, (*NO_CROP, "--model.optimizer=lars", "--model.lr=0.3", "--model.weight_decay=1e-6")),
    "crop_1.0_width1": (V2, (*NO_CROP, "--model.width=1.0")),
    "crop_1.0_batch128_K1024": (V2, (*NO_CROP, f"{D}batch_size=128", "--model.bn_splits=4", "--model.queue_size=1024")),
    "crop_1.0_batch128_K1024_m_cosine": (
        V2,
        (
            *NO_CROP,
            f"{D}batch_size=128",
            "--model.bn_splits=4",
            "--model.queue_size=1024",
            "--model.momentum_schedule=cosine",
        ),
    ),
    # round 3: one view change at a time on the quickstart, then a combination re-tuned (T, K, lr, schedule)
    "qs": (QS, ()),
    "qs_translate3": (QS, (f"{D}translate=3",)),
    "qs_crop0.5": (QS, (f"{D}min_scale=0.5",)),
    "qs_crop0.3": (QS, (f"{D}min_scale=0.3",)),
    "qs_rotate15": (QS, (f"{D}rotation=15",)),
    "qs_erase0.5": (QS, (f"{D}erase_prob=0.5",)),
    "qs_contrast0.8": (QS, (f"{D}jitter_strength=0.8",)),
    "qs_blur0.5": (QS, (f"{D}blur_prob=0.5",)),
    "qs_strong": (QS, STRONG),
    "qs_strong_crop0.5": (QS, (*STRONG, f"{D}min_scale=0.5")),
    "qs_strong_T0.1": (QS, (*STRONG, "--model.temperature=0.1")),
    "qs_strong_K4096": (QS, (*STRONG, "--model.queue_size=4096")),
    "qs_strong_lr0.12_warmup": (QS, (*STRONG, "--model.lr=0.12", "--model.warmup_epochs=0.5")),
    "qs_strong_sym": (QS, (*STRONG, "--model.symmetric=true")),
}
ROUND_3 = [n for n in CANDIDATES if n.startswith("qs")]
SELECT = {  # what the rungs rank by, on the validation split
    "knn": lambda r: r["knn_top1"],
    "low_label": lambda r: r["low_label_top1"],
    "mean": lambda r: (r["knn_top1"] + r["low_label_top1"]) / 2,
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=ROUND_3, metavar="NAME")
    p.add_argument("--rungs", type=float, nargs="+", default=[1.0, 4.0, 16.0], help="budget of each rung (--unit)")
    p.add_argument("--unit", choices=["qe", "minutes"], default="qe", help="quickstart-epoch equivalents or minutes")
    p.add_argument("--keep", type=int, nargs="+", default=[6, 2, 1], help="how many go on after each rung")
    p.add_argument("--select", choices=list(SELECT), default="mean", help="what each rung ranks by (validation)")
    p.add_argument("--timing-repeats", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "recipe_search.png"))
    add_common_args(p)
    p.set_defaults(split="val", curve_points=1, curve_bank=2000, curve_queries=500)
    args = p.parse_args(argv)
    if args.split != "val":
        p.error("recipes are selected on --split val; report the chosen ones with quality.py --split test")
    if args.select != "knn" and not args.probe_epochs:
        p.error(f"--select {args.select} needs the probes: --probe-epochs > 0")
    quiet()
    t0 = time.perf_counter()
    header("Recipe search: successive halving on the validation split", args)
    splits = Splits("val", args.eval_subset, args.curve_bank, args.curve_queries)
    systems = {n: System(n, args, splits, config=CANDIDATES[n][0], overrides=CANDIDATES[n][1]) for n in args.candidates}
    timed = {**systems, QE_CONFIG: System(QE_CONFIG, args, splits)}  # the QE reference, timed with the candidates
    timings = {n: [] for n in timed}
    for r in range(args.timing_repeats):
        for n in timed if r % 2 == 0 else list(timed)[::-1]:
            timings[n].append(timed[n].seconds_per_step())
    sps = {n: min(v) for n, v in timings.items()}  # the fastest pass: other processes only ever add time
    print("seconds per step: " + ", ".join(f"{n} {v:.3f}" for n, v in sps.items()) + "\n", flush=True)
    unit_s = quickstart_epoch_seconds(args, splits, sps[QE_CONFIG]) if args.unit == "qe" else 60.0

    rows, alive = [], list(systems)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r, budget in enumerate(args.rungs):
        print(f"== rung {r + 1}: {len(alive)} candidates x {budget:g} {args.unit} ==", flush=True)
        scores = {}
        for n in alive:
            res = run_system(systems[n], unit_s * budget, args.curve_points, sps=sps[n], stop_at_budget=False)
            scores[n] = SELECT[args.select](res) if args.probe_epochs else res["knn_top1"]
            rows.append(
                {
                    "candidate": n,
                    "rung": r + 1,
                    "budget": budget,
                    "unit": args.unit,
                    "steps": res["steps"],
                    "epochs": f"{res['epochs']:.2f}",
                    "seconds_per_step": f"{sps[n]:.4f}",
                    "knn_top1": f"{res['knn_top1']:.4f}",
                    "probe_top1": f"{res.get('probe_top1', float('nan')):.4f}",
                    "low_label_top1": f"{res.get('low_label_top1', float('nan')):.4f}",
                    "pretext_acc1": f"{res['pretext_acc1']:.4f}",
                    "score": f"{scores[n]:.4f}",
                    "config": CANDIDATES[n][0],
                    "overrides": " ".join(CANDIDATES[n][1]),
                }
            )
            with open(out.with_suffix(".csv"), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        keep = args.keep[r] if r < len(args.keep) else 1
        ranked = sorted(alive, key=scores.get, reverse=True)
        print(f"   best at this rung: {ranked[0]}; kept {ranked[:keep]}\n", flush=True)
        alive = ranked[:keep]
    print_table(
        [
            [
                x["candidate"],
                str(x["rung"]),
                f"{x['budget']:g}",
                x["epochs"],
                f"{100 * float(x['knn_top1']):.2f}",
                f"{100 * float(x['probe_top1']):.2f}",
                f"{100 * float(x['low_label_top1']):.2f}",
                x["pretext_acc1"],
            ]
            for x in rows
        ],
        ["candidate", "rung", args.unit, "epochs", "val kNN %", "val probe %", "val 1 %-label %", "pretext acc1"],
    )
    plot(out, rows)
    config, overrides = CANDIDATES[alive[0]]
    print(f"chosen: {alive[0]} (configs/{config}.yaml {' '.join(overrides)})")
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
        ax.set_title(f"rung {r}: {float(sel[0]['budget']):g} {sel[0]['unit']} each (val kNN top-1 %)", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


if __name__ == "__main__":
    main()
