"""The InfoNCE loss of MoCo (He et al. 2020, Eq. 1; Oord et al. 2018).

    L_q = -log exp(q·k₊/τ) / (exp(q·k₊/τ) + Σ_i exp(q·k_i/τ))

computed as a cross-entropy over the logits ``[q·k₊, q·queue] / τ`` with label 0 (Algorithm 1).
With no queue, the negatives are the other keys of the global batch: the keys of all DDP ranks, the positive of
this rank's i-th query at column ``offset + i`` (MoCo v3, Chen, Xie, He 2021, Algorithm 1, and the paper's
end-to-end mechanism). Also BYOL's normalised MSE (:func:`normalized_mse`) and SimCLR's NT-Xent (:func:`nt_xent`,
equal to lightly's ``NTXentLoss`` without its host syncs); SwAV's swapped prediction is lightly's ``SwaVLoss``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from moco_lightning.modules.distributed import gather_keeping_local_grad, rank, world_size


def gather_keys(k: Tensor, equal_sizes: bool = False) -> Tuple[Tensor, int]:
    """The in-batch dictionary of keys ``k``: ``(the keys of every rank in fp32, offset of this rank's)``. While
    training, gradients flow back to every rank's keys when ``k`` has them (the end-to-end mechanism, SimCLR):
    ``torch.distributed.nn``'s all-gather, equal row counts, as training batches are; without gradients (validation,
    whose last batches may be uneven), :func:`gather_keeping_local_grad`."""
    if world_size() == 1:
        return k.float(), 0
    with torch.autocast(k.device.type, enabled=False):
        k = k.float()
        if torch.is_grad_enabled() and k.requires_grad:
            from torch.distributed.nn.functional import all_gather

            return torch.cat(all_gather(k.contiguous())), rank() * k.shape[0]
        return gather_keeping_local_grad(k, equal_sizes)


def info_nce(
    q: Tensor,
    k: Tensor,
    queue: Optional[Tensor],
    temperature: float,
    scale: float = 1.0,
    equal_sizes: bool = False,
    batch_keys: Optional[Tuple[Tensor, int]] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Returns ``(scale · loss, sims, labels)``: the cosine similarities of the queries to their positive and negative
    keys and the positive's column, and the cross-entropy of ``sims / temperature``.

    ``q``, ``k``: (N, C), L2-normalised, ``k[i]`` the positive of ``q[i]``. ``queue``: (K, C) negatives, or None /
    empty for in-batch negatives. With a queue ``sims`` is (N, 1 + K) with the positive in column 0; without, (N,
    global batch) against the keys of every rank (when ``k`` has gradients, the end-to-end mechanism, they reach every
    rank's keys: see :func:`gather_keys`), the positive at ``offset + i``; ``batch_keys``: that gather of ``k``,
    ``(keys, offset)`` from :func:`gather_keys`, when the caller already has it (multi-crop's terms share each global
    key: one all-gather per key, not per term). MoCo v3 uses ``scale = 2T``, which makes the size of the gradient
    independent of T.

    Always in fp32 with autocast off: under bf16 autocast the products ``q @ queue.T`` would come out in bf16 (8 bits
    of mantissa), every negative logit off by up to ~0.4 % before the division by T, while the positive
    ``(q * k).sum`` stays fp32.
    """
    with torch.autocast(q.device.type, enabled=False):
        q, k = q.float(), k.float()
        if queue is None or queue.shape[0] == 0:
            keys, offset = batch_keys if batch_keys is not None else gather_keys(k, equal_sizes)
            sims, labels = q @ keys.T, torch.arange(offset, offset + q.shape[0], device=q.device)
        else:
            l_pos = (q * k).sum(dim=1, keepdim=True)
            l_neg = q @ queue.float().T
            sims = torch.cat([l_pos, l_neg], dim=1)
            labels = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
        loss = F.cross_entropy(sims / temperature, labels)
    return loss * scale, sims, labels


def normalized_mse(p: Tensor, z: Tensor) -> Tensor:
    """BYOL's loss ‖p/‖p‖ − z/‖z‖‖² = 2 − 2·cos(p, z), averaged over the batch; ``z`` is the (detached) target."""
    return (2 - 2 * F.cosine_similarity(p, z.detach(), dim=1)).mean()


def nt_xent(z0: Tensor, z1: Tensor, temperature: float, equal_sizes: bool = False) -> Tensor:
    """NT-Xent (SimCLR, Chen et al. 2020, eq. 1), in fp32, over the global batch.

    Each of this rank's 2n embeddings (both views) is contrasted with its other view (the positive) and every other
    embedding of every rank (2N − 2 negatives); the embedding itself is masked out with −inf (a ``masked_fill``:
    lightly's ``NTXentLoss`` drops it by boolean indexing, two host syncs a step). The mean over ranks of the per-rank
    losses is the loss of the whole batch on one process, and so are the gradients: while training, the gather is
    autograd's all-gather (its backward sums every rank's gradient for a rank's rows: an embedding is a negative of
    the other ranks' queries too, as SimCLR's cross-replica concatenation and lightly's ``GatherLayer``), so with
    DDP's averaging the weights get the single-process gradient.
    """
    z0, z1 = F.normalize(z0.float(), dim=1), F.normalize(z1.float(), dim=1)
    k0, offset = gather_keys(z0, equal_sizes)
    k1, _ = gather_keys(z1, equal_sizes)
    n, total = z0.shape[0], k0.shape[0]
    logits = torch.cat([z0, z1]) @ torch.cat([k0, k1]).T / temperature  # (2n, 2N): view 0 of all ranks, then view 1
    mine = torch.arange(n, device=z0.device) + offset
    itself = torch.cat([mine, mine + total])
    positive = torch.cat([mine + total, mine])
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, itself[:, None], True)
    return F.cross_entropy(logits.masked_fill(mask, float("-inf")), positive)


def pretext_metrics(sims: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """The pretext task's accuracy (is the positive the top logit, among the top 5) and the mean positive and
    negative cosine, from InfoNCE's similarities ``sims`` (N, 1 + K) and the positives' columns ``labels``."""
    pos = sims.gather(1, labels[:, None])
    top5 = sims.topk(min(5, sims.shape[1]), dim=1).indices
    return {
        "acc1": (top5[:, 0] == labels).float().mean(),
        "acc5": (top5 == labels[:, None]).any(1).float().mean(),
        "logit_pos": pos.mean(),
        "logit_neg": (sims.sum() - pos.sum()) / max(1, sims.numel() - pos.numel()),
    }
