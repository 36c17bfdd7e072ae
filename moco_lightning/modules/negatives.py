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
