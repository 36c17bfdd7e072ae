"""MoCo's dictionary: where the negatives of InfoNCE come from, the three mechanisms of the MoCo paper (He et al.
2020, §3.2, Fig. 2), one small class each.

- :class:`InBatch`: end-to-end (Fig. 2a) and MoCo v3: the negatives of a query are the other keys of the global
  batch (gathered across ranks by the loss); the dictionary is as large as the batch and keeps nothing.
- :class:`KeyQueue`: MoCo (§3.1, "Dictionary as a queue"): "the current mini-batch is enqueued to the dictionary,
  and the oldest mini-batch in the queue is removed".
- :class:`MemoryBank`: InstDisc's memory bank (Wu, Xiong, Yu, Lin, CVPR 2018, https://arxiv.org/abs/1805.01978;
  Fig. 2b): one stored feature per training image, "randomly sampled ... with no back-propagation", each row moved
  towards its image's query when the image is seen again, ``v ← normalise(m·v + (1 − m)·q)`` (InstDisc: m = 0.5).
  Lightly's ``MemoryBankModule`` is a FIFO of recent batches, not this, and is not saved in checkpoints.

Each says what it contributes to the logits (:meth:`Negatives.negatives`: a (K, C) tensor of stored keys, or
``None`` for the other keys of the global batch) and what it keeps of a step (:meth:`Negatives.to_store`, gathered
from every rank, then :meth:`Negatives.store` after the optimizer step). Their buffers are persistent (saved in
every checkpoint, moved with the module) and updated alike by every rank, so DDP need not broadcast them; a store is
pure tensor indexing, without a read on the host.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moco_lightning.errors import ConfigError


class Negatives(nn.Module):
    """The dictionary's interface; nothing stored, nothing contributed (see :class:`InBatch`)."""

    def negatives(self) -> Optional[Tensor]:
        """This step's negative keys (K, C), or ``None``: the other keys of the global batch."""
        return None

    def to_store(self, queries: list[Tensor], keys: list[Tensor], index: Optional[Tensor]) -> tuple[Tensor, ...]:
        """What the dictionary keeps of this step (rows gathered from every rank before :meth:`store`)."""
        return ()

    def store(self, *rows: Tensor, step: int) -> None:
        """Keeps the gathered rows (after the optimizer step and the momentum update)."""


class InBatch(Negatives):
    """End-to-end (Fig. 2a) and MoCo v3: the other keys of the global batch; keeps nothing."""


class KeyQueue(Negatives):
    """K L2-normalised keys of size ``dim`` (rows of ``keys``), a write pointer, and each slot's write step.

    The initial keys are random unit vectors drawn from the global RNG, so a given seed gives the same queue (on every
    DDP rank). Enqueuing accepts any batch size, including batches larger than K."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        if size < 1:
            raise ValueError(f"KeyQueue: size={size}; a queue holds at least one key (no queue: InBatch)")
        self.size = size
        self.register_buffer("keys", F.normalize(torch.randn(size, dim), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        # global step at which each slot was last written; -1 for the initial random keys
        self.register_buffer("enqueued_at", torch.full((size,), -1, dtype=torch.long))

    def negatives(self) -> Tensor:
        """The K queued keys (the product uses them as they are before this step's enqueue)."""
        return self.keys

    def to_store(self, queries: list[Tensor], keys: list[Tensor], index: Optional[Tensor]) -> tuple[Tensor, ...]:
        """The step's keys (of every global view), detached."""
        return (torch.cat(keys).detach(),)

    @torch.no_grad()
    def enqueue(self, keys: Tensor, step: int = -1) -> None:
        """Writes ``keys`` (B, dim) after the newest entries, wrapping around; the oldest are overwritten.

        Equivalent to enqueuing the rows one by one: with B > K only the last K rows survive."""
        n = keys.shape[0]
        if n > self.size:
            keys = keys[n - self.size :]
        start = self.ptr + max(n - self.size, 0)
        slots = (start + torch.arange(keys.shape[0], device=keys.device)) % self.size
        # index_copy_ / index_fill_: an indexed assignment of the Python int `step` would copy it to the device
        # from pageable memory, which blocks the host (one sync per step on a GPU)
        self.keys.index_copy_(0, slots, keys.to(self.keys.dtype))
        self.enqueued_at.index_fill_(0, slots, step)
        self.ptr.copy_((self.ptr + n) % self.size)

    store = enqueue  # type: ignore[assignment]  # the dictionary's store is the enqueue

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.keys.shape[1]}"


class MemoryBank(Negatives):
    """``size`` L2-normalised features of size ``dim``, one per training image, indexed by the image's index.

    As a dictionary: the positive of an image is its stored feature (:meth:`positives`), ``num_negatives`` stored
    features drawn at random are the negatives of a step, and after the step each image's row moves towards its
    query with ``momentum`` (the queries of all ranks, by image index)."""

    def __init__(self, size: int, dim: int, num_negatives: int = 4096, momentum: float = 0.5) -> None:
        super().__init__()
        self.size, self.num_negatives, self.momentum = size, num_negatives, momentum
        self.register_buffer("features", F.normalize(torch.randn(size, dim), dim=1))
        self._checked = False

    def negatives(self) -> Tensor:
        return self.sample(self.num_negatives)

    def to_store(self, queries: list[Tensor], keys: list[Tensor], index: Optional[Tensor]) -> tuple[Tensor, ...]:
        """One row per image: its query (with both views as queries, their mean), and the image's index."""
        return torch.stack(queries).mean(0).detach(), self.require_index(index)

    def store(self, queries: Tensor, index: Tensor, step: int) -> None:  # type: ignore[override]
        self.update(index, queries, self.momentum)

    @staticmethod
    def require_index(index: Optional[Tensor]) -> Tensor:
        if index is None:
            raise ConfigError(
                "MemoryBankMoCo needs each image's index: batches (views, targets, index), as moco-lightning's "
                "datamodules give them"
            )
        return index

    def positives(self, index: Tensor) -> Tensor:
        """The stored features of the batch's images (their positive keys), without gradient.

        The index range is checked on the first call (a clear error instead of a device-side assert on a GPU), not
        every step, which would read the index on the host each time; ``MemoryBankMoCo`` also checks
        ``memory_bank_size`` against a sized training set at fit start, and later indexing still fails (torch's own
        index error on a CPU, a device-side assert on a GPU) rather than read a wrong row."""
        self.require_index(index)
        if index.numel() and not self._checked:
            self._checked = True
            low, high = (int(v) for v in torch.aminmax(index))
            bad = high if high >= self.size else low
            if not 0 <= bad < self.size:
                raise IndexError(
                    f"MemoryBank: image index {bad} "
                    f"is outside the bank of {self.size} rows; set memory_bank_size to the number of training images"
                )
        return self.features[index].detach()

    def sample(self, k: int) -> Tensor:
        """``k`` stored features drawn uniformly with replacement (the global RNG): the negatives of one step."""
        return self.features[torch.randint(self.size, (k,), device=self.features.device)].detach()

    @torch.no_grad()
    def update(self, index: Tensor, q: Tensor, momentum: float) -> None:
        """``v_i ← normalise(m·v_i + (1 − m)·q_i)`` for the rows of ``index``; a repeated index keeps its last write.

        Duplicate indices all write the row computed from the index's *last* query, so the result does not depend on
        the order in which a GPU performs the writes (index assignment with duplicates is nondeterministic)."""
        pos = torch.arange(index.shape[0], device=index.device)
        last = torch.where(index[:, None] == index[None, :], pos[None, :], -1).amax(1)  # last occurrence of each index
        mixed = self.features[index].mul(momentum).add_(q[last].to(self.features.dtype), alpha=1.0 - momentum)
        self.features[index] = F.normalize(mixed, dim=1)

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.features.shape[1]}"


def own_key_share(size: int, keys_per_epoch: int) -> float:
    """The share of an image's steps at which a FIFO queue of ``size`` keys still holds the image's key from the
    previous epoch, with epochs of ``keys_per_epoch`` keys in a new random order each: the keys enqueued between the
    two visits are the sum of two uniform positions (a triangular distribution on [0, 2E]), fewer than K with
    probability (K/E)²/2 up to K = E, 1 − (2 − K/E)²/2 up to 2E, and 1 from there."""
    k = size / keys_per_epoch
    return 1.0 if k >= 2 else k * k / 2 if k <= 1 else 1 - (2 - k) ** 2 / 2


def warn_own_keys(
    who: str, field: str, size: int, images: Optional[int], per_image: int = 1, sampled: bool = False
) -> None:
    """One warning when a dictionary of ``size`` (a queue; a memory bank's ``sampled`` negatives) is more than half
    an epoch of keys (``images`` × ``per_image``): an image's own earlier key then sits among its query's
    negatives, and the model is taught to push apart two views of one image. Nothing when ``images`` is unknown."""
    if not images:
        return
    epoch = images * per_image
    if size <= epoch / 2:
        return
    if sampled:  # each of `size` negatives drawn uniformly from the bank's `images` rows, with replacement
        share = 1 - (1 - 1 / images) ** size
        what = f"its own stored feature is among its {size} sampled negatives at {share:.0%} of its steps"
    elif (share := own_key_share(size, epoch)) == 1:
        what = (
            "the queue holds two epochs of keys or more: every image's previous key is always among its own negatives"
        )
    else:
        held = "a whole epoch of keys or more" if size >= epoch else "more than half an epoch of keys"
        what = f"the queue holds {held}: an image's previous key is among its own negatives at {share:.0%} of its steps"
    keys = f" ({per_image} keys per image and epoch)" if per_image > 1 else ""
    warnings.warn(
        f"{who}: {field}={size} against {images} training images{keys}: {what}, which teaches the model to push apart "
        f"two views of the same image; set {field} to at most {epoch // 2} (small-data recipes keep it near a tenth "
        f"of the images: {max(1, images // 10)})",
        stacklevel=3,
    )
