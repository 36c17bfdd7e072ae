"""Autograd-free collectives that degrade to no-ops on one process (CPU, one GPU, no process group).

Gathering rows from ranks that may hold different row counts needs those counts first: one extra all_gather,
and reading its result is a host-device synchronisation. ``equal_sizes=True`` skips it when every rank is known
to hold the same number of rows (a training loader with Lightning's ``DistributedSampler``: it gives every rank
the same number of samples, so every batch has the same size on every rank).
"""

from __future__ import annotations

import atexit
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor


def equal_batches(loader: Any) -> bool:
    """Every rank's batch from ``loader`` has the same size, so gathers need not exchange sizes first: Lightning's
    DistributedSampler gives every rank the same number of samples (DALI loaders say so themselves); a sampler of
    one's own may shard unevenly."""
    from torch.utils.data import DistributedSampler

    return getattr(loader, "equal_batches", False) or (
        isinstance(getattr(loader, "sampler", None), DistributedSampler)
        and getattr(loader, "batch_size", None) is not None
    )


def end_process_group() -> None:
    """Destroys the default process group, if any, before the interpreter shuts down: a gloo group left to the
    interpreter's finalisation sometimes aborts a finished run at exit ("terminate called without an active
    exception", SIGABRT: its worker threads are destroyed while still joinable, pytorch/pytorch#190489). Lightning's
    own atexit handler destroys only NCCL groups."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def end_process_group_at_exit() -> None:
    """Registers :func:`end_process_group` to run at exit, once per process (the modules call this in ``setup``: a
    process that DDP's spawn or subprocess launcher started ends without the CLI's ``finally``)."""
    atexit.unregister(end_process_group)
    atexit.register(end_process_group)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@torch.no_grad()
def concat_all_gather(x: Tensor, equal_sizes: bool = False) -> Tensor:
    """Rows of ``x`` from every rank, concatenated in rank order; ranks may hold different row counts unless
    ``equal_sizes``."""
    if world_size() == 1:
        return x
    return _gather_rows(x, _counts(x.shape[0], equal_sizes))


@torch.no_grad()
def _gather_rows(x: Tensor, counts: list[int]) -> Tensor:
    ws = len(counts)
    if all(c == x.shape[0] for c in counts):  # no padding needed
        out = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(out, x.contiguous())
        return torch.cat(out)
    padded = x.new_zeros((max(counts), *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in range(ws)]
    dist.all_gather(out, padded.contiguous())
    return torch.cat([o[:c] for o, c in zip(out, counts)])


def gather_keeping_local_grad(x: Tensor, equal_sizes: bool = False) -> tuple[Tensor, int]:
    """``(rows of every rank in rank order, offset of this rank's rows)``; this rank's rows are ``x`` itself, so
    gradients flow to them (MoCo v3 and the end-to-end mechanism: the labels are ``arange(N) + offset``)."""
    if world_size() == 1:
        return x, 0
    counts = _counts(x.shape[0], equal_sizes)
    offset = sum(counts[: rank()])
    everything = _gather_rows(x.detach(), counts)
    return torch.cat([everything[:offset], x, everything[offset + x.shape[0] :]]), offset


@torch.no_grad()
def shuffle_across_ranks(
    x: Tensor, generator: torch.Generator, equal_sizes: bool = False
) -> tuple[Tensor, tuple[Tensor, list[int]]]:
    """Shuffle BN (He et al. 2020, §3.3): this rank's share of the global batch in a random order.

    The permutation of the global batch is drawn from ``generator`` (on ``x``'s device, seeded alike on every
    rank, so no broadcast is needed). Ranks may hold different row counts unless ``equal_sizes``; each gets back
    as many rows as it gave. Returns the rows to encode and the state :func:`unshuffle_across_ranks` needs.
    """
    counts = _counts(x.shape[0], equal_sizes)
    x_all = _gather_rows(x, counts) if len(counts) > 1 else x
    perm = torch.randperm(x_all.shape[0], generator=generator, device=x.device)
    offset = sum(counts[: rank()])
    mine = perm[offset : offset + x.shape[0]]
    return x_all[mine], (perm, counts)


@torch.no_grad()
def unshuffle_across_ranks(y: Tensor, state: tuple[Tensor, list[int]]) -> Tensor:
    """Inverse of :func:`shuffle_across_ranks`: the encoded rows back on the rank and in the order they came from."""
    perm, counts = state
    y_all = _gather_rows(y, counts) if len(counts) > 1 else y  # row i of y_all encodes global input row perm[i]
    restored = torch.empty_like(y_all)
    restored[perm] = y_all
    offset = sum(counts[: rank()])
    return restored[offset : offset + y.shape[0]]


def gather_objects(obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` (picklable objects); ``[obj]`` without a process group."""
    if world_size() == 1:
        return [obj]
    out: list[Optional[Any]] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def _counts(n: int, equal_sizes: bool = False) -> list[int]:
    if world_size() == 1 or equal_sizes:
        return [n] * world_size()
    t = torch.tensor([n], device=_device())
    out = [torch.zeros_like(t) for _ in range(world_size())]
    dist.all_gather(out, t)
    return [int(c) for c in out]


def _device() -> torch.device:
    backend = dist.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
