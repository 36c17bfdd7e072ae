"""The memory bank of Instance Discrimination (Wu, Xiong, Yu, Lin, CVPR 2018, https://arxiv.org/abs/1805.01978).

One stored, L2-normalised feature per training image. The MoCo paper compares its queue with this mechanism
(He et al. 2020, §3.2 and Fig. 2c): "a memory bank ... stores the representations of all samples in the
dataset. The dictionary for each mini-batch is randomly sampled from the memory bank with no back-propagation";
the stored feature of an image is updated when the image is seen again, with a momentum ("proximal") update,
``v_i ← normalise(m·v_i + (1 − m)·q_i)`` (InstDisc: m = 0.5). Lightly's ``MemoryBankModule`` is a FIFO of recent
batches, not this; and it is not saved in checkpoints. This bank is a persistent buffer.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moco_lightning.errors import ConfigError
from moco_lightning.modules.negatives import Negatives


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

        The index range is checked on the first call (a clear error instead of a device-side assert on a
        GPU), not every step, which would read the index on the host each time; ``MemoryBankMoCo`` also checks
        ``memory_bank_size`` against a sized training set at fit start, and later indexing still fails (torch's
        own index error on a CPU, a device-side assert on a GPU) rather than read a wrong row."""
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

        Duplicate indices all write the row computed from the index's *last* query, so the result does not depend
        on the order in which a GPU performs the writes (index assignment with duplicates is nondeterministic)."""
        pos = torch.arange(index.shape[0], device=index.device)
        last = torch.where(index[:, None] == index[None, :], pos[None, :], -1).amax(1)  # last occurrence of each index
        mixed = self.features[index].mul(momentum).add_(q[last].to(self.features.dtype), alpha=1.0 - momentum)
        self.features[index] = F.normalize(mixed, dim=1)

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.features.shape[1]}"
