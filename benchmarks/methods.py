"""The seeds' comparison measured: MoCo, SimCLR, BYOL and SwAV at equal backbone, data and training wall time, and
MoCo's memory claim (a queued negative costs a 128-float vector, SimCLR's an image's activations).

    python -m benchmarks.methods --minutes 10 --out benchmarks/results/methods.png        # about 55 minutes
    python -m benchmarks.methods --minutes 10 --override=--model.stem=imagenet     # the README's table's stem
    python -m benchmarks.methods --minutes 0.1 --eval-subset 2000 --probe-epochs 2 --negatives 64 128 \\
        --out /tmp/m.png                                                                    # a smoke run

1. **Quality per method**: each method's Fashion-MNIST config (``configs/quickstart.yaml`` for MoCo,
   ``configs/{simclr,byol,swav}_fashion_mnist.yaml``: the same backbone, views, batch, optimizer and schedule; only
   the method's own part differs) trained for ``--minutes`` of wall time with ``quality.py``'s procedure (timed,
   planned, re-planned, evaluations off the clock), then the same kNN and linear probe on the ``--split``
   (default: the official test split). Images/s from the timing, peak memory of a training step from part 2's
   measurement at the config's own batch.
2. **Peak memory of a training step** (forward, loss, backward, optimizer step; twice, the second measured), each in
   a fresh process: on the CPU the rise of the process's peak resident memory (Linux's VmHWM, reset just before
   the step) over its resident memory just before it; on a GPU ``torch.cuda.max_memory_allocated`` over the
   memory allocated before.
   Against the number of negatives: SimCLR's batch of N images has 2N − 2 (N grows), MoCo's K at the fixed batch
   of its config (K grows), up to ``--negatives``' largest; BYOL and SwAV have none (one point each).

The seeds' qualitative table (dictionary, hardware need) is printed next to what was measured, with a verdict.
"""

from __future__ import annotations

import csv
import os
import resource
import time
from pathlib import Path

from benchmarks._common import config_path, footer, from_config, header, parser, print_table, quiet
from benchmarks.quality import Splits, System, add_common_args, baselines, run_system, write_results

#: each method's Fashion-MNIST config
METHODS = {
    "MoCo": "quickstart",
    "SimCLR": "simclr_fashion_mnist",
    "BYOL": "byol_fashion_mnist",
    "SwAV": "swav_fashion_mnist",
}

#: the seeds' table: source of negatives, dictionary size, consistency of the keys, hardware need
SEEDS = {
    "MoCo": ("momentum encoder + queue", "K = 65536, decoupled from the batch", "high (slow key encoder)", "low"),
    "SimCLR": ("the same batch", "2N - 2 (batch-bound)", "high (one encoder)", "high: very large batches"),
    "BYOL": ("none (self-distillation)", "-", "momentum target", "medium"),
    "SwAV": ("none (prototypes, online clustering)", "K prototypes", "-", "medium"),
}


# --- part 2: the peak memory of one training step, in a fresh process ------------------------------------------
def step_memory(config: str, overrides: list[str], batch: int, device: str, threads: int = 1) -> dict:
    """:func:`measure` in a new process (forked from a server process that has imported torch and this library, and
    has run nothing: no state of an earlier measurement, no 10 s of imports per measurement); returns its result."""
    import multiprocessing

    global _SERVER
    if _SERVER is None:
        # a fixed mmap threshold: glibc then returns every large freed block at once, so the resident memory before
        # the measured step is what is alive, not what an earlier step left in the heap (read by glibc when the
        # server starts; its forks inherit it)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
        _SERVER = multiprocessing.get_context("forkserver")
        _SERVER.set_forkserver_preload(["torch", "moco_lightning", "moco_lightning.cli", "_common"])
    with _SERVER.Pool(1) as pool:
        return pool.apply(measure, (config, overrides, batch, device, threads))


_SERVER = None  # the forkserver context of the memory measurements


def vm_hwm_mib() -> float:
    """The process's peak resident memory since the last reset (``/proc/self/status``, VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def measure(config: str, overrides: list[str], batch: int, device: str, threads: int = 1) -> dict:
    """Two training steps of the config's model on random images of its size; the second's peak (MiB)."""
    import torch

    quiet()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, dm = from_config(config_path(config), *overrides)
    if getattr(getattr(dm, "view_settings", None), "local_views", 0):
        raise ValueError(f"{config}: local views are not measured here (two views only)")
    model.to(device).train()
    if model.hparams.channels_last:
        model.to(memory_format=torch.channels_last)
    size, channels = model.hparams.image_size, model.hparams.in_channels
    views = [torch.randn(batch, channels, size, size, device=device) for _ in range(2)]
    opt = torch.optim.SGD([p for m in model.trained_modules() for p in m.parameters()], lr=0.01, momentum=0.9)

    def step() -> None:
        out = model.views_loss(views)
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if out.get("stored"):  # what the dictionary keeps (MoCo's queue)
            model.dictionary.store(*out["stored"], step=0)

    step()  # the optimizer's state exists from here on
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        before = rss_mib()
        with open("/proc/self/clear_refs", "w") as f:  # Linux: the peak resident memory (VmHWM) := the current
            f.write("5")
        step()
        peak = vm_hwm_mib()
    negatives = getattr(getattr(model, "dictionary", None), "size", 0) or 0  # MoCo's KeyQueue holds K
    if type(model).__name__ == "SimCLR":
        negatives = 2 * batch - 2
    return {"before_mib": before, "peak_mib": peak, "step_mib": max(0.0, peak - before), "negatives": negatives}


def memory_sweep(args) -> list[dict]:
    """Peak step memory against the number of negatives: SimCLR's batch grows, MoCo's K grows at its batch."""
    rows = []
    moco_batch = System("quickstart", args, None).batch_size()
    for n in args.negatives:
        simclr_batch = n // 2 + 1  # 2N - 2 >= n
        for method, config, over, batch in (
            ("SimCLR", METHODS["SimCLR"], [], simclr_batch),
            ("MoCo", METHODS["MoCo"], [f"--model.queue_size={n}"], moco_batch),
        ):
            m = step_memory(config, over, batch, args.device, args.threads)
            rows.append(dict(method=method, batch=batch, **m))
            print(
                f"  {method:<6} batch {batch:5d}, {m['negatives']:5d} negatives: step peak {m['step_mib']:7.1f} MiB",
                flush=True,
            )
    return rows


# --- the report ---------------------------------------------------------------------------------------------
def plot_memory(out: Path, rows: list[dict], own: dict, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=120)
    for method, style in (("SimCLR", "o-"), ("MoCo", "s-")):
        pts = [r for r in rows if r["method"] == method]
        ax.plot([r["negatives"] for r in pts], [r["step_mib"] for r in pts], style, label=f"{method}", ms=4)
    for method in ("BYOL", "SwAV"):
        if method in own:
            ax.axhline(own[method]["step_mib"], ls=":", lw=1, color="gray")
            ax.text(ax.get_xlim()[0], own[method]["step_mib"], f" {method} (no negatives)", fontsize=7, va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("negatives per query (SimCLR: 2N - 2 of a batch of N; MoCo: K at a fixed batch)")
    ax.set_ylabel("peak memory of a training step (MiB)")
    ax.set_title(f"Peak memory of a training step against negatives ({device})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def verdicts(results: dict, own: dict, sweep: list[dict]) -> list[list[str]]:
    """The seeds' claims against the measurements: agrees or not, and why."""
    knn = {m: 100 * results[m]["knn_top1"] for m in METHODS if m in results}
    spread = max(knn.values()) - min(knn.values()) if knn else None
    rows = []

    def growth(method: str) -> float:
        pts = sorted((r for r in sweep if r["method"] == method), key=lambda r: r["negatives"])
        return pts[-1]["step_mib"] / max(1e-9, pts[0]["step_mib"]) if len(pts) > 1 else float("nan")

    sim, moco = growth("SimCLR"), growth("MoCo")
    lo, hi = (min(r["negatives"] for r in sweep), max(r["negatives"] for r in sweep)) if sweep else (0, 0)
    rows.append(
        [
            "SimCLR's negatives cost memory per image, MoCo's queue does not",
            f"{lo} -> {hi} negatives: SimCLR step memory x{sim:.1f}, MoCo x{moco:.2f}",
            "agrees" if sim > 2 * moco else "does not agree",
        ]
    )
    for method, claim in (("BYOL", "medium"), ("SwAV", "medium")):
        if method in own and "MoCo" in own:
            ratio = own[method]["step_mib"] / max(1e-9, own["MoCo"]["step_mib"])
            rows.append(
                [
                    f"{method}'s hardware need is {claim} (vs MoCo low)",
                    f"step memory at batch 128: {ratio:.2f}x MoCo's",
                    "agrees" if ratio >= 1.0 else "does not agree (not above MoCo's)",
                ]
            )
    if spread is not None:
        rows.append(
            [
                "with the v2 tricks shared, accuracy is roughly the same",
                f"kNN at equal wall time: {', '.join(f'{m} {v:.2f}' for m, v in knn.items())} (spread {spread:.1f})",
                "agrees" if spread <= 2.0 else "does not agree at this budget (one seed; a spread over 2 points)",
            ]
        )
    return rows


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=10.0, help="training wall-clock budget per method")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--negatives", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the memory is measured")
    p.add_argument("--skip-quality", action="store_true", help="the memory measurements only")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "methods.png"))
    add_common_args(p)
    args = p.parse_args(argv)
    quiet()
    t0 = time.perf_counter()
    header("The seeds' comparison: MoCo, SimCLR, BYOL, SwAV", args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    print("-- peak memory of a training step, each method at its config's batch --", flush=True)
    own = {}
    for method in args.methods:
        batch = System(METHODS[method], args, None).batch_size()
        own[method] = step_memory(METHODS[method], [], batch, args.device, args.threads)
        print(f"  {method:<6} batch {batch}: step peak {own[method]['step_mib']:.1f} MiB", flush=True)
    print("-- against the number of negatives --", flush=True)
    sweep = memory_sweep(args)
    with open(out.with_name(out.stem + "_memory.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, ["method", "batch", "negatives", "before_mib", "peak_mib", "step_mib"])
        w.writeheader()
        w.writerows(sweep)
    label = "CPU: resident memory" if args.device == "cpu" else "GPU: allocated memory"
    plot_memory(out.with_name(out.stem + "_memory.png"), sweep, own, f"Fashion-MNIST, ResNet-18 x0.5; {label}")

    results = {}
    if not args.skip_quality:
        splits = Splits(args.split, args.eval_subset, args.curve_bank, args.curve_queries)
        print(f"\n-- quality at {args.minutes:g} min each, split {args.split} --", flush=True)
        results = baselines(splits, METHODS[args.methods[0]], args)
        for method in args.methods:
            results[method] = run_system(System(METHODS[method], args, splits), 60 * args.minutes, args.curve_points)
        write_results(out, results, args, f"Fashion-MNIST, {args.minutes:g} min per method, split {args.split}")
        print()
        rows = [
            [
                m,
                *SEEDS[m][:2],
                SEEDS[m][3],
                f"{results[m]['images_per_s']:.0f}",
                f"{own[m]['step_mib']:.0f}",
                f"{100 * results[m]['knn_top1']:.2f}",
                f"{100 * results[m]['probe_top1']:.2f}",
            ]
            for m in args.methods
        ]
        head = ["method", "negatives", "dictionary", "seeds: hardware", "images/s", "step MiB", "kNN %", "probe %"]
        print_table(rows, head)
    print()
    print_table(verdicts(results, own, sweep), ["the seeds say", "measured", "verdict"])
    footer(t0)


if __name__ == "__main__":
    main()
