"""A prepared, self-contained check of moco-lightning on a CUDA machine: a few minutes, no dataset download.

    python -m benchmarks.gpu_check                  # on the GPU(s) of this node, in --minutes (default 6)
    python -m benchmarks.gpu_check --quick          # the figures of the README's GPU table, under 3 minutes
    python -m benchmarks.gpu_check --device cpu --quick   # the same code at toy sizes (run by the tests)

What only a GPU can show, each printed as one line (``check: result``) as it finishes, then one summary table
(figure, value, what it means, pass / fail where there is a threshold) to paste into the README. Each check runs in
a process of its own, killed when its share of ``--minutes`` is spent: a check that hangs or cannot finish prints
why and the others go on. The summary is also written to ``--summary`` (Markdown), rewritten after every check, so
that what ran is kept whatever happens to the rest.

- ``fit``: MoCo + an in-memory datamodule (random uint8 images, views drawn batched on the device) trains a few
  steps in bf16-mixed: the first GPU batch does not crash on tensors left on the CPU; logits and queue stay fp32.
- ``syncs``: host-device synchronisations per training step, counted with ``torch.cuda.set_sync_debug_mode``
  over steps after the warm-up (Lightning's own included).
- ``split_bn``: CUDA kernels launched by one SplitBatchNorm2d forward + backward (8 splits) and by a BatchNorm2d.
- ``bf16_logits``: the largest logit error at K = 65536 under bf16 autocast: ours (fp32 similarities) and a
  bf16 ``q @ queue.T``.
- ``knn_memory``: peak memory of the kNN monitor's evaluation for a bank of N x 2048 features, fp32 and bf16, N as
  large as the check's share affords (up to ImageNet's 1.28 M), from a timed small bank.
- ``checkpoint``: a checkpoint loaded with ``map_location="cuda"`` resumes training (the RNG states were saved as
  CPU tensors and are restored from wherever they were mapped).
- ``throughput``: MoCo v2 (``configs/moco_v2.yaml``: ResNet-50, K 65536) at 224 px in bf16-mixed and channels-last,
  images/s of (a) the bare encoder work on views already on the GPU (plain BN), (b) the full ``fit`` step on those
  views with split BN (8, the one-GPU default) and with plain BN (``shuffle_bn: off``), (c) the data path alone over
  a generated JPEG folder: PIL workers (crops in the workers, colour batched on the GPU) and, where DALI is
  installed, DALI (built on the GPU explicitly, ``device="mixed"``: nvJPEG; the line says where it decoded; a line
  says when it was skipped), (d) ``fit`` with each data path. The folder holds enough JPEGs for the warm-up and the
  timed batches inside one epoch (no epoch boundary, no worker start-up in the timing). Goals: (b) with split BN
  >= 0.9 of (a); (d) >= 0.9 of (a).
- ``compile``: ``fit`` images/s with ``compile: false`` and ``true`` (a ResNet-18), and the recompilations Dynamo
  logged (training, no-grad key encoder, evaluation): none may hit the recompile limit (it falls back to eager).
  Inductor at the full size; ``aot_eager`` at the toy size (the same graphs and guards, without a minute of C++ builds
  on a CPU).
- ``multi_crop``: ``fit`` images/s of MoCo v2 with 2 x 224 px views and with 2 x 224 + 6 x 96 px (SwAV's layout).
- ``ddp``: ``fit`` on every GPU of the node (DDP, NCCL, started with spawn: everything is pickled into the
  processes), images/s per GPU against the same run on one GPU (scaling efficiency); the queue must be identical on
  every rank; the kNN monitor's bank sharded over the ranks, peak memory per rank. On the CPU: 2 gloo processes.

``--minutes`` bounds the whole check: each check's process is killed at its share of the budget, and its timed
loops stop at 60 % of that share (the rest is start-up, compilation and the figures). At toy sizes (the CPU) every
timed loop runs its minimum steps and each check may take up to 3 minutes, whatever ``--minutes`` says; there each
check's process is forked from this one (its imports done once: start-up was most of a toy check's time), while on
a GPU it is a fresh interpreter (no CUDA state inherited).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, List, Tuple

import torch

from benchmarks import gpu_harness
from benchmarks.gpu_checks_data import check_multi_crop, check_throughput
from benchmarks.gpu_checks_scale import check_compile, check_ddp
from benchmarks.gpu_checks_step import (
    check_bf16_logits,
    check_checkpoint,
    check_fit,
    check_knn_memory,
    check_split_bn,
    check_syncs,
)
from benchmarks.gpu_harness import Result, Row

SIZES = {  # toy: seconds on a CPU; full: a GPU's minutes
    "toy": dict(image=16, batch=16, images=128, steps=4, queue=256, width=0.25, bank=4096, bank_dim=64,
                big_image=32, big_batch=8, backbone="resnet18", workers=1, bench_steps=3, warmup=1,
                local_image=16, local_views=2, compile_image=16, compile_batch=8, ddp_image=16, ddp_batch=8,
                compile_backend="aot_eager"),  # Dynamo's graphs and guards without Inductor's minute of C++ builds
    "full": dict(image=64, batch=256, images=8192, steps=30, queue=65536, width=1.0, bank=1_281_167, bank_dim=2048,
                 big_image=224, big_batch=128, backbone="resnet50", workers=12, bench_steps=30, warmup=3,
                 local_image=96, local_views=6, compile_image=112, compile_batch=256, ddp_image=224, ddp_batch=128,
                 compile_backend="inductor"),
}  # fmt: skip

# each check's share of --minutes (its process is killed there; its timed loops stop at LOOPS of it)
SHARES = dict(fit=0.05, syncs=0.05, split_bn=0.03, bf16_logits=0.03, knn_memory=0.07, checkpoint=0.05,
              throughput=0.30, compile=0.14, multi_crop=0.12, ddp=0.16)  # fmt: skip
LOOPS = 0.6
#: the README's GPU table: under 3 minutes on one GPU (``--quick``)
QUICK = ("fit", "syncs", "split_bn", "bf16_logits", "checkpoint", "throughput")
TOY_SECONDS = 180  # a toy check's limit (the CPU: start-up dominates)

CHECKS: dict[str, Callable[[str, dict, float], Result]] = {
    "fit": check_fit,
    "syncs": check_syncs,
    "split_bn": check_split_bn,
    "bf16_logits": check_bf16_logits,
    "knn_memory": check_knn_memory,
    "checkpoint": check_checkpoint,
    "throughput": check_throughput,
    "compile": check_compile,
    "multi_crop": check_multi_crop,
    "ddp": check_ddp,
}


def summary(rows: List[Row]) -> str:
    """The summary as a Markdown table."""
    head = ["figure", "value", "what it means", "pass / fail"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def run_one(args) -> int:
    """A check in this process (``--one``): its line and rows as JSON in ``--result``."""
    gpu_harness.NO_DALI = args.no_dali
    size = SIZES[args.size]
    toy = size is SIZES["toy"]
    deadline = time.time() + (0.0 if toy else args.seconds * LOOPS)
    try:
        line, rows = CHECKS[args.one](args.device, size, deadline)
    except Exception as e:  # report: the runner goes on with the other checks
        line, rows = (
            f"FAILED {type(e).__name__}: {e}",
            [Row(args.one, "FAILED", f"{type(e).__name__}: {str(e)[:120]}", False)],
        )
    with open(args.result, "w") as f:
        json.dump(dict(line=line, rows=[vars(r) for r in rows]), f)
    return 0


def run_in_process(args, check: str, seconds: float) -> Tuple[str, List[Row]]:
    """``check`` in a process of its own, killed after ``seconds``: (its line, its rows)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--one", check, "--device", args.device,
               "--size", args.size, "--seconds", f"{seconds:.1f}", "--result", result]  # fmt: skip
        try:
            if args.size == "toy" and args.device == "cpu" and hasattr(os, "fork"):
                one = argparse.Namespace(**{**vars(args), "one": check, "seconds": seconds, "result": result})
                code = run_forked(one, seconds)
            else:
                code = subprocess.run(cmd + ["--no-dali"] * args.no_dali, timeout=seconds).returncode
        except subprocess.TimeoutExpired:
            why = f"did not finish within its share, {seconds:.0f} s: killed (give it more --minutes or run it alone)"
            return f"FAILED: {why}", [Row(check, "FAILED", why, False)]
        if not os.path.exists(result):
            why = f"its process exited with code {code} without a result"
            return f"FAILED: {why}", [Row(check, "FAILED", why, False)]
        with open(result) as f:
            got = json.load(f)
    return got["line"], [Row(**r) for r in got["rows"]]


def run_forked(one: argparse.Namespace, seconds: float) -> int:
    """:func:`run_one` in a child forked from this process (toy sizes on the CPU), killed after ``seconds``."""
    import multiprocessing

    import moco_lightning  # noqa: F401  (imported once, here, for every check's child)

    child = multiprocessing.get_context("fork").Process(target=lambda: sys.exit(run_one(one)))
    child.start()
    child.join(seconds)
    if child.is_alive():
        child.kill()
        child.join()
        raise subprocess.TimeoutExpired(one.one, seconds)
    return child.exitcode


def main(argv=None) -> int:
    from benchmarks._common import parser

    p = parser(__doc__)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=list(SIZES), default=None, help="default: full on CUDA, toy on the CPU")
    p.add_argument("--checks", nargs="+", choices=list(CHECKS), default=None, help="default: all, or --quick's")
    p.add_argument("--quick", action="store_true", help=f"the README's GPU table only: {', '.join(QUICK)}")
    p.add_argument("--minutes", type=float, default=None, help="time budget of the whole check (6; --quick 2.8)")
    p.add_argument("--no-dali", action="store_true", help="skip DALI's data path even where it is installed")
    p.add_argument("--summary", default="gpu_check_summary.md", help="the summary, rewritten after every check")
    for hidden in ("--one", "--result"):  # a check's own process
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.size = args.size or ("full" if args.device == "cuda" else "toy")
    from benchmarks._common import quiet

    quiet()
    if args.one:
        return run_one(args)
    checks = args.checks or list(QUICK if args.quick else CHECKS)
    minutes = args.minutes or (2.8 if args.quick else 6.0)
    name = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if args.device == "cuda" else "CPU"
    print(f"gpu_check on {name}: torch {torch.__version__}, {minutes:g} minutes, {args.size} sizes "
          f"{SIZES[args.size]}; summary in {args.summary}", flush=True)  # fmt: skip
    failed, rows, t0 = 0, [], time.time()
    budget = minutes * 60 - 10  # the summary
    total_share = sum(SHARES[c] for c in checks)
    for check in checks:
        t = time.perf_counter()
        seconds = budget * SHARES[check] / total_share
        if args.size == "toy":
            seconds = max(seconds, TOY_SECONDS)
        result, check_rows = run_in_process(args, check, seconds)
        rows += check_rows
        failed += result.startswith("FAILED")
        print(f"{check}: {result} [{time.perf_counter() - t:.1f} s]", flush=True)
        with open(args.summary, "w") as f:
            f.write(f"gpu_check on {name} ({time.time() - t0:.0f} s so far; {', '.join(checks)}):\n\n{summary(rows)}\n")
    print(f"\nsummary ({name}, {time.time() - t0:.0f} s):\n\n{summary(rows)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
