"""The MoCo paper's other dictionaries (He et al. 2020, §3.2 and Fig. 2), each a small subclass of :class:`MoCo`
that changes where positives and negatives come from and what is kept after the step.

- :class:`EndToEnd` (Fig. 2a): the keys come from the query encoder itself, with gradients; the negatives are the
  other keys of the global batch, so the dictionary is as large as the batch (SimCLR's design). No key encoder.
- :class:`MemoryBankMoCo` (Fig. 2b; Wu, Xiong, Yu, Lin, InstDisc, CVPR 2018, https://arxiv.org/abs/1805.01978):
  one stored feature per training image; the positive of an image is its own stored feature, ``num_negatives``
  negatives are sampled from the bank, and after the step the image's row moves towards its query,
  ``v ← normalise(m·v + (1 − m)·q)`` with ``m = bank_momentum`` (InstDisc: 0.5). No key encoder.

Select one in a config with ``model: {class_path: moco_lightning.EndToEnd, init_args: {...}}``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .errors import ConfigError, check_arguments
from .memory_bank import MemoryBank
from .moco import MoCo


class EndToEnd(MoCo):
    """End-to-end: q and k from the same encoder, gradients through both; negatives = the rest of the global batch.

    Takes :class:`MoCo`'s arguments except the queue and the momentum (there is neither)."""

    has_key_encoder = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(queue_size=0, momentum=0.0, momentum_schedule="constant", **kwargs)

    def positives_and_negatives(self, x_k: Tensor, index: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        return self.query(x_k)[1], None

    def global_terms(self, x_q: Tensor, x_k: Tensor, index: Optional[Tensor]) -> tuple[Tensor, list, list, list]:
        h, q = self.query(x_q)
        k = self.query(x_k)[1]  # the second view's query is its key: nothing to recompute for the symmetric loss
        if not self.hparams.symmetric:
            return h, [(q, k, None)], [q], [k]
        return h, [(q, k, None), (k, q, None)], [q, k], [q, k]


class MemoryBankMoCo(MoCo):
    """InstDisc's memory bank as MoCo's dictionary.

    Args:
        memory_bank_size: rows of the bank: the number of training images (checked once at fit start). Batches
            must carry each image's index, ``(views, targets, index)``, as every moco-lightning datamodule gives.
        num_negatives: features sampled from the bank (uniformly, with replacement) as each step's negatives.
        bank_momentum: m of the stored features' update (InstDisc: 0.5). With ``symmetric``, the row moves towards
            the mean of both views' queries (one row per image).
        **kwargs: :class:`MoCo`'s arguments except the queue and the encoder momentum (there is no key encoder).
    """

    has_key_encoder = False
    stores_by_index = True
    STRUCTURAL = MoCo.STRUCTURAL + ("memory_bank_size",)

    def __init__(
        self, memory_bank_size: int = 0, num_negatives: int = 4096, bank_momentum: float = 0.5, **kwargs: Any
    ) -> None:
        if memory_bank_size < 1:
            raise ConfigError(
                "MemoryBankMoCo: memory_bank_size must be the number of training images (>= 1); "
                f"got {memory_bank_size}: set memory_bank_size = the number of training images"
            )
        check_arguments("MemoryBankMoCo", MemoryBankMoCo.__init__, locals())
        super().__init__(queue_size=0, momentum=0.0, momentum_schedule="constant", **kwargs)
        self.memory_bank = MemoryBank(memory_bank_size, self.hparams.dim)
        self.record_hyperparameters(locals())

    def positives_and_negatives(self, x_k: Tensor, index: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        if index is None:
            raise ConfigError(
                "MemoryBankMoCo needs each image's index: batches (views, targets, index), as "
                "moco-lightning's datamodules give them"
            )
        return self.memory_bank.positives(index), self.memory_bank.sample(self.hparams.num_negatives)

    def to_store(self, queries: list[Tensor], keys: list[Tensor]) -> Tensor:
        return torch.stack(queries).mean(0).detach()  # one row per image: with both views as queries, their mean

    def store(self, stored: Tensor, index: Optional[Tensor]) -> None:
        self.memory_bank.update(index, stored, self.hparams.bank_momentum)

    def on_train_start(self) -> None:
        super().on_train_start()
        # checked once here: a per-step index check would stall an accelerator
        try:
            n = len(self.trainer.train_dataloader.dataset)
        except (TypeError, AttributeError):  # an iterable dataset: MemoryBank checks the first batch's indices
            n = 0
        if n > self.memory_bank.size:
            raise ConfigError(
                f"MemoryBankMoCo: memory_bank_size={self.memory_bank.size}, but the training set has {n} "
                f"images; set memory_bank_size to {n} (one bank row per training image)"
            )

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Nothing: validation images have no rows in the bank."""
