"""Weighted kNN classification of features (Wu et al. 2018, "Unsupervised Feature Learning via Non-Parametric
Instance Discrimination", §3.4; the official MoCo CIFAR-10 demo's monitor): each query's k most similar bank rows
vote for their class with weight exp(similarity / T), the class with the largest summed weight wins.
:func:`knn_counts` counts correct predictions (a bank split over DDP ranks is never gathered), :func:`knn_accuracy`
embeds a bank and a query loader with a module and returns top-1 / top-5.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from moco_lightning.downstream.features import embed, max_across_ranks, sum_across_ranks
from moco_lightning.errors import ConfigError
from moco_lightning.modules.distributed import concat_all_gather, world_size


def knn_scores(
    features: Tensor, bank: Tensor, bank_targets: Tensor, num_classes: int, k: int, temperature: float
) -> Tensor:
    """Class scores (N, C) of the weighted kNN vote: ``sum over the k most similar bank rows of exp(sim / T)``.

    ``features`` (N, D) and ``bank`` (M, D) L2-normalised, so ``sim`` is the cosine similarity;
    ``bank_targets`` (M,) int64 in ``[0, num_classes)``; ``k <= M``.
    """
    sim, idx = (features @ bank.t()).topk(k, dim=1)
    return _vote(sim, bank_targets[idx], num_classes, temperature)


def _vote(sim: Tensor, labels: Tensor, num_classes: int, temperature: float) -> Tensor:
    scores = torch.zeros(sim.shape[0], num_classes, device=sim.device, dtype=torch.float32)
    return scores.scatter_add_(1, labels, (sim.float() / temperature).exp())


def _correct(scores: Tensor, y: Tensor, num_classes: int, topk: Sequence[int]) -> Tensor:
    return torch.stack([(scores.topk(min(j, num_classes), dim=1).indices == y[:, None]).any(1).sum() for j in topk])


@torch.no_grad()
def knn_counts(
    features: Tensor,
    targets: Tensor,
    bank: Tensor,
    bank_targets: Tensor,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    chunk_size: int = 256,
    topk: Sequence[int] = (1, 5),
    sharded: bool = False,
) -> Tensor:
    """Counts of correct weighted-kNN predictions: ``[correct@k for k in topk] + [total]``.

    ``features`` (N, D) and ``bank`` (M, D) must be L2-normalised (similarity = dot product). ``k`` is clipped to
    the bank size and each ``topk`` to ``num_classes``. Queries are classified ``chunk_size`` at a time, so memory
    is O(chunk_size * (M + num_classes)).

    ``sharded`` (a collective under DDP): the bank is split over the ranks, each holding its own share (never
    gathered: an ImageNet bank of 1.28M x 2048 fp32 features is 10.5 GB, and a gather would put all of it on every
    device) and its own queries. The queries of all ranks are gathered (small next to the bank); for each chunk
    every rank finds the ``k`` most similar rows of its shard, the ranks exchange these (chunk x k similarities and
    labels), and the merged top ``k`` over all shards is exactly the single-process neighbourhood. The counts are
    over all queries, the same on every rank.
    """
    if sharded:
        features, targets = concat_all_gather(features), concat_all_gather(targets.to(features.device).long())
    size = torch.tensor([bank.shape[0]], device=bank.device)
    n_bank = int(sum_across_ranks(size)) if sharded else bank.shape[0]
    if n_bank == 0:
        raise ConfigError("the kNN feature bank is empty: the bank loader gave no samples")
    k = min(k, n_bank)
    local_k = min(k, bank.shape[0])
    bank_targets = bank_targets.to(bank.device).long()
    correct = torch.zeros(len(topk), dtype=torch.long, device=bank.device)
    for start in range(0, features.shape[0], chunk_size):
        f = features[start : start + chunk_size].to(bank.device, bank.dtype)
        y = targets[start : start + chunk_size].to(bank.device).long()
        sim = torch.full((f.shape[0], k), float("-inf"), device=f.device)
        labels = torch.zeros((f.shape[0], k), dtype=torch.long, device=f.device)
        if local_k:
            s, idx = (f @ bank.t()).topk(local_k, dim=1)
            sim[:, :local_k], labels[:, :local_k] = s.float(), bank_targets[idx]
        if sharded and world_size() > 1:  # (world x chunk, k) -> (chunk, world * k): every shard's candidates
            sim, labels = _all_candidates(sim), _all_candidates(labels)
            sim, best = sim.topk(k, dim=1)
            labels = labels.gather(1, best)
        correct += _correct(_vote(sim, labels, num_classes, temperature), y, num_classes, topk)
    total = torch.tensor([features.shape[0]], dtype=torch.long, device=bank.device)
    return torch.cat([correct, total])


def sharded_knn_counts(*args: Any, **kwargs: Any) -> Tensor:
    """:func:`knn_counts` with the bank split over the ranks (``sharded=True``)."""
    return knn_counts(*args, sharded=True, **kwargs)


def _all_candidates(x: Tensor) -> Tensor:
    n = x.shape[0]
    gathered = concat_all_gather(x, equal_sizes=True)  # every rank classifies the same chunk of the same queries
    return gathered.view(world_size(), n, -1).permute(1, 0, 2).reshape(n, -1)


def knn_accuracy(
    module: nn.Module,
    bank_loader,
    val_loader,
    num_classes: Optional[int] = None,
    k: int = 200,
    temperature: float = 0.1,
    max_bank_size: Optional[int] = None,
    chunk_size: int = 256,
    device: Optional[torch.device] = None,
    forward_ctx: Optional[Callable] = None,
    bank_dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Weighted-kNN top-1 / top-5 accuracy (in [0, 1]) of ``module``'s features, on one or many processes.

    Each rank embeds its shard of ``bank_loader`` (the first ``max_bank_size`` samples when set) and keeps it
    (:func:`sharded_knn_counts`: the bank is never gathered), and its shard of ``val_loader``. ``bank_dtype``
    ``torch.bfloat16`` halves the bank's memory (the vote weights stay fp32). ``num_classes`` None: 1 + the
    largest bank label. Returns ``{"acc1", "acc5", "total"}`` (the same on every rank).
    """
    if device is None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
    bank, bank_targets = embed(
        module, bank_loader, device, limit=max_bank_size, gather=False, forward_context=forward_ctx, dtype=bank_dtype
    )
    top = bank_targets.max().reshape(1) if bank_targets.numel() else torch.full((1,), -1, device=bank_targets.device)
    top = int(max_across_ranks(top))
    if num_classes is None:
        num_classes = top + 1 if top >= 0 else 1
    elif top >= num_classes:
        raise ConfigError(f"the bank holds label {top} but num_classes is {num_classes}")
    feats, targets = embed(module, val_loader, device, gather=False, forward_context=forward_ctx)
    counts = sharded_knn_counts(feats, targets, bank, bank_targets, num_classes, k, temperature, chunk_size).tolist()
    total = max(counts[2], 1)
    return {"acc1": counts[0] / total, "acc5": counts[1] / total, "total": counts[2]}
