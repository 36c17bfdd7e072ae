"""An encoder's features over a loader, on one process or many: :func:`embed` (eval mode, no grad, this rank's
shard, L2-normalised, gathered or kept per rank) and the helpers it needs (:func:`eval_mode`, :func:`shard`, the
reductions across ranks).

Everything here works on any ``nn.Module`` whose ``forward(x)`` returns features (N, D) and on any iterable of
``(image, target[, index])`` batches; the collectives are no-ops without a process group. The evaluation callbacks,
``evaluate`` and ``embed`` all use these.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from moco_lightning.datamodules.loading import shut_down_workers
from moco_lightning.modules.distributed import concat_all_gather, rank, world_size


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Puts ``module`` in eval mode and restores every submodule's own ``training`` flag afterwards.

    ``module.train(previous)`` would not do: a module may hold submodules deliberately left in eval
    mode (a frozen backbone, a key encoder), which a blanket ``train()`` would flip.
    """
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes:
            m.training = training


def shard(loader: Iterable, rank_: int, world: int, limit: Optional[int] = None) -> Iterator[Tuple[Tensor, Tensor]]:
    """Yields ``(images, targets)`` of this rank's disjoint share of the first ``limit`` samples.

    A ``DataLoader`` over a map-style dataset is rebuilt (same batch size, collate function and
    workers) on the indices ``range(n)[rank::world]``, so each rank loads only its share. A loader whose
    ``rank_shard`` is ``(rank, world)`` holds that share already and is walked as it is. Any other
    iterable is walked by every rank, which keeps the batches ``i`` with ``i % world == rank``. Shard
    sizes may differ by one sample (or one batch).
    """
    if world > 1 and getattr(loader, "rank_shard", None) == (rank_, world):
        # already this rank's share (DALI's evaluation loaders: each rank decodes only its files); batches carry the
        # global index, so the first ``limit`` samples are the same as when sharding here
        for batch in batches(loader):
            x, y = batch[0], batch[1]
            if limit is not None:
                keep = torch.as_tensor(batch[2]) < limit
                x, y = x[keep.to(x.device)], y[keep.to(y.device)]
            if len(y):
                yield x, y
        return
    if world > 1 or limit is not None:
        rebuilt = _rebuild(loader, rank_, world, limit)
        if rebuilt is not None:
            for batch in batches(rebuilt):
                yield batch[0], batch[1]
            return
    seen = 0
    for i, batch in enumerate(batches(loader)):
        if limit is not None and seen >= limit:
            return
        x, y = batch[0], batch[1]
        if limit is not None and seen + len(y) > limit:
            x, y = x[: limit - seen], y[: limit - seen]
        seen += len(y)
        if i % world == rank_:
            yield x, y


def batches(loader: Iterable) -> Iterator:
    """The batches of ``loader``; a ``DataLoader``'s worker processes are shut down on the way out, at the end, at an
    error (a worker's included) or when the caller stops early (:func:`~moco_lightning.datamodules.loading.
    shut_down_workers`: an error otherwise came 5 s late)."""
    iterator = iter(loader)
    try:
        yield from iterator
    finally:
        shut_down_workers(iterator)


def _rebuild(loader: Iterable, rank_: int, world: int, limit: Optional[int]) -> Optional[DataLoader]:
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
        return None
    try:
        n = len(loader.dataset)
    except TypeError:
        return None
    order = list(range(n if limit is None else min(n, limit)))  # evaluation loaders are in dataset order
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=order[rank_::world],
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
    )


@torch.no_grad()
def embed(
    module: nn.Module,
    loader: Iterable,
    device: torch.device,
    limit: Optional[int] = None,
    gather: bool = True,
    normalize: bool = True,
    forward_context: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
    dtype: torch.dtype = torch.float32,
) -> Tuple[Tensor, Tensor]:
    """Features ``module(x)`` (L2-normalised in float32 if ``normalize``, then kept as ``dtype`` batch by batch:
    a bfloat16 bank never exists in float32, so its peak memory is half the float32 one) and targets of a loader.

    The module runs in eval mode under ``no_grad`` (every submodule's mode restored afterwards),
    batch by batch, keeping features only. Under DDP each rank embeds its own shard and, with
    ``gather``, the result holds every rank's rows (in rank order); without a process group it is
    simply the whole loader (or its first ``limit`` samples).
    """
    r, ws = rank(), world_size()
    feats, targets = [], []
    ctx = forward_context or contextlib.nullcontext
    with eval_mode(module):
        for x, y in shard(loader, r, ws, limit):
            with ctx():
                f = module(x.to(device, non_blocking=True))
            f = f.float().flatten(1)
            feats.append((torch.nn.functional.normalize(f, dim=1) if normalize else f).to(dtype))
            targets.append(torch.as_tensor(y).to(device).long())
    dim = feats[0].shape[1] if feats else 0
    if ws > 1:  # a rank left without samples still needs the feature size for the gather
        d = torch.tensor([dim], device=device)
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        dim = int(d)
    f = torch.cat(feats) if feats else torch.empty(0, dim, device=device, dtype=dtype)
    t = torch.cat(targets) if targets else torch.empty(0, dtype=torch.long, device=device)
    if gather and ws > 1:
        f, t = concat_all_gather(f), concat_all_gather(t)
    return f, t


def sum_across_ranks(x: Tensor) -> Tensor:
    """Element-wise sum of ``x`` over all ranks (a copy); ``x`` itself without a process group."""
    return _all_reduced(x, dist.ReduceOp.SUM)


def max_across_ranks(x: Tensor) -> Tensor:
    """Element-wise maximum of ``x`` over all ranks (a copy); ``x`` itself without a process group."""
    return _all_reduced(x, dist.ReduceOp.MAX)


def _all_reduced(x: Tensor, op: Any) -> Tensor:
    if world_size() == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, op=op)
    return x
