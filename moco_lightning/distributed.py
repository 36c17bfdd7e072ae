"""Autograd-free collectives that degrade to no-ops on one process (CPU, one GPU, no process group)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@torch.no_grad()
def concat_all_gather(x: Tensor) -> Tensor:
    """Rows of ``x`` from every rank, concatenated in rank order; ranks may hold different row counts."""
    ws = world_size()
    if ws == 1:
        return x
    n = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(ws)]
    dist.all_gather(sizes, n)
    counts = [int(s) for s in sizes]
    padded = x.new_zeros((max(counts), *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in range(ws)]
    dist.all_gather(out, padded.contiguous())
    return torch.cat([o[:c] for o, c in zip(out, counts)])
