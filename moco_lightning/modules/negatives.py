"""Where the negatives of InfoNCE come from: the three mechanisms of the MoCo paper (He et al. 2020, §3.2, Fig. 2).

One small object per mechanism, chosen by each method class; it says

- what it contributes to the logits (:meth:`Negatives.negatives`: a (K, C) tensor of stored keys, or ``None`` for
  the other keys of the global batch),
- what it keeps of a step (:meth:`Negatives.to_store`, gathered from every rank, then :meth:`Negatives.store` after
  the optimizer step),
- its buffers: persistent (saved in every checkpoint) and updated alike by every rank, so DDP need not broadcast
  them.

The mechanisms: :class:`InBatch` (end-to-end, Fig. 2a, and MoCo v3), :class:`moco_lightning.modules.queue.KeyQueue`
(MoCo's queue) and :class:`moco_lightning.modules.memory_bank.MemoryBank` (InstDisc's memory bank, Fig. 2b).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn


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
    """End-to-end (Fig. 2a) and MoCo v3: the negatives of a query are the other keys of the global batch (gathered
    across ranks by the loss); the dictionary is as large as the batch and keeps nothing."""


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
    import warnings

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
