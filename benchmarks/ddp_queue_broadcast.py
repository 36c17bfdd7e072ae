"""What DDP's per-forward buffer broadcast would cost if the MoCo queue were not excluded from it.

DDP re-broadcasts every buffer from rank 0 at each forward by default. MoCo keeps its queue as a
buffer; every rank enqueues the same gathered keys, so that broadcast is pure overhead (and it would hide a
missing gather). MoCo lists the queue in ``_ddp_params_and_buffers_to_ignore``; this script times a DDP
forward+backward of the same module with the queue excluded (ours) and included (the default), 2 processes,
gloo on this CPU, and prints the ratio.

    python -m benchmarks.ddp_queue_broadcast [--queue-size 65536] [--steps 20]
"""

from __future__ import annotations

import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def worker(rank: int, port: int, queue_size: int, steps: int, out: "mp.Queue") -> None:
    from moco_lightning import MoCo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(1, 8, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    x = torch.randn(32, 1, 28, 28)
    results = {}
    for label, ignore in (("queue excluded (moco-lightning)", True), ("queue broadcast (DDP default)", False)):
        cls = MoCo if ignore else type("Broadcast", (MoCo,), {"_ddp_params_and_buffers_to_ignore": []})
        model = cls(
            backbone=backbone,
            in_channels=1,
            image_size=28,
            queue_size=queue_size,
            dim=128,
            hidden_dim=64,
            shuffle_bn="off",
        )
        model.projection_head.requires_grad_(False)  # forward(x) is the backbone: DDP must not wait for head grads
        ddp = DistributedDataParallel(model)
        times = []
        for i in range(steps + 3):
            dist.barrier()
            t = time.perf_counter()
            ddp(x).sum().backward()
            dist.barrier()
            if i >= 3:
                times.append(time.perf_counter() - t)
        results[label] = statistics.median(times)
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main() -> None:
    from benchmarks._common import parser

    p = parser(__doc__)
    p.add_argument("--queue-size", type=int, default=65536)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args.queue_size, args.steps, out)) for r in range(2)]
    for p in procs:
        p.start()
    import queue

    results, deadline = None, time.monotonic() + 900
    while results is None:  # a crashed worker must not hang the script
        try:
            results = out.get(timeout=2)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit("a worker failed (see its traceback above)") from None
    for p in procs:
        p.join()
    mib = args.queue_size * 128 * 4 / 2**20
    print(
        f"DDP, 2 processes, gloo, CPU; queue {args.queue_size} x 128 fp32 = {mib:.0f} MiB; median of {args.steps} steps"
    )
    base = results["queue excluded (moco-lightning)"]
    for label, t in results.items():
        print(f"  {label:34s} {1000 * t:8.2f} ms/step   x{t / base:.2f}")


if __name__ == "__main__":
    main()
