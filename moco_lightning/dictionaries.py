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

import warnings
from typing import Any, Literal, Optional

from torch import Tensor, nn

from .contrastive import Contrastive
from .errors import ConfigError, check_arguments
from .heads import projection_head
from .memory_bank import MemoryBank
from .negatives import InBatch, Negatives


class EndToEnd(Contrastive):
    """End-to-end: q and k from the same encoder, gradients through both; negatives = the rest of the global batch.
    Defaults: the MoCo paper's comparison of the three mechanisms (Fig. 3: v1's linear head and T 0.07).

    Args:
        head: ``"linear"`` (v1) or ``"mlp"`` (v2) projection head.
        symmetric: both views serve as query; loss = L(q1, k2) + L(q2, k1).
        temperature: T of the logits (v1: 0.07).
        **kwargs: ``dim``, ``hidden_dim``, ``temperature``, ``decay_norm_bias`` of
            :class:`~moco_lightning.contrastive.Contrastive` and the backbone/optimizer arguments (no queue, no
            momentum, no shuffle BN: the keys come from the query encoder, in the same batch as their negatives).
    """

    STRUCTURAL = Contrastive.STRUCTURAL + ("head",)

    def __init__(
        self,
        head: Literal["linear", "mlp"] = "linear",
        symmetric: bool = False,
        temperature: float = 0.07,
        **kwargs: Any,
    ) -> None:
        check_arguments(type(self).__name__, EndToEnd.__init__, locals())
        super().__init__(temperature=temperature, **kwargs)
        self.symmetric = symmetric
        self.in_batch = InBatch()

    def build_heads(self) -> tuple[nn.Module, Optional[nn.Module]]:
        return projection_head(self.hparams.head, self.feature_dim, self.hparams.hidden_dim, self.hparams.dim), None

    @property
    def dictionary(self) -> Negatives:
        return self.in_batch

    def positive_keys(self, x: Tensor, index: Optional[Tensor]) -> Tensor:
        return self.query(x)[1]

    def global_terms(self, x_q: Tensor, x_k: Tensor, index: Optional[Tensor]) -> tuple[Tensor, list, list, list]:
        h, q = self.query(x_q)
        k = self.query(x_k)[1]  # the second view's query is its key: nothing to recompute for the symmetric loss
        if not self.symmetric:
            return h, [(q, k, None)], [q], [k]
        return h, [(q, k, None), (k, q, None)], [q, k], [q, k]


class MemoryBankMoCo(Contrastive):
    """InstDisc's memory bank as MoCo's dictionary. Defaults: InstDisc's and the MoCo paper's comparison (Fig. 3):
    4096 negatives, bank momentum 0.5, a linear head to 128-d, T 0.07.

    Args:
        memory_bank_size: rows of the bank: the number of training images (checked once at fit start). Batches
            must carry each image's index, ``(views, targets, index)``, as every moco-lightning datamodule gives.
        num_negatives: features sampled from the bank (uniformly, with replacement) as each step's negatives.
        bank_momentum: m of the stored features' update (InstDisc: 0.5). With ``symmetric``, the row moves towards
            the mean of both views' queries (one row per image).
        head: ``"linear"`` (v1) or ``"mlp"`` (v2) projection head.
        symmetric: both views serve as query.
        temperature: T of the logits (InstDisc and v1: 0.07).
        **kwargs: ``dim``, ``hidden_dim``, ``temperature``, ``decay_norm_bias`` of
            :class:`~moco_lightning.contrastive.Contrastive` and the backbone/optimizer arguments (no key encoder).
    """

    STRUCTURAL = Contrastive.STRUCTURAL + ("head", "memory_bank_size")

    def __init__(
        self,
        memory_bank_size: int = 0,
        num_negatives: int = 4096,
        bank_momentum: float = 0.5,
        head: Literal["linear", "mlp"] = "linear",
        symmetric: bool = False,
        temperature: float = 0.07,
        **kwargs: Any,
    ) -> None:
        if memory_bank_size < 1:
            raise ConfigError(
                "MemoryBankMoCo: memory_bank_size must be the number of training images (>= 1); "
                f"got {memory_bank_size}: set memory_bank_size = the number of training images"
            )
        check_arguments("MemoryBankMoCo", MemoryBankMoCo.__init__, locals())
        super().__init__(temperature=temperature, **kwargs)
        self.symmetric = symmetric
        self.memory_bank = MemoryBank(memory_bank_size, self.hparams.dim, num_negatives, bank_momentum)

    def build_heads(self) -> tuple[nn.Module, Optional[nn.Module]]:
        return projection_head(self.hparams.head, self.feature_dim, self.hparams.hidden_dim, self.hparams.dim), None

    @property
    def dictionary(self) -> Negatives:
        return self.memory_bank

    def positive_keys(self, x: Tensor, index: Optional[Tensor]) -> Tensor:
        return self.memory_bank.positives(MemoryBank.require_index(index))

    def configure_optimizers(self) -> dict:
        config = super().configure_optimizers()  # loads the training data
        # checked once, at fit start (before any callback's evaluation): a per-step index check would stall an
        # accelerator. Too few rows would index outside the bank; too many would serve never-updated random rows
        # as negatives.
        try:
            n = len(self.trainer.train_dataloader.dataset)
        except (TypeError, AttributeError):  # an iterable dataset: MemoryBank checks the first batch's indices
            n = 0
        if n and n != self.memory_bank.size:
            raise ConfigError(
                f"MemoryBankMoCo: memory_bank_size={self.memory_bank.size}, but the training set has {n} images"
                + (
                    ": the rows of no image would stay random and serve as negatives"
                    if n < self.memory_bank.size
                    else ""
                )
                + f"; set memory_bank_size to {n} (one bank row per training image)"
            )
        return config

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking:
            warnings.warn(
                "MemoryBankMoCo has no validation loss: validation images have no row in the memory bank (their "
                "positives); validation runs the callbacks only (KNNMonitor, LinearProbe)",
                stacklevel=2,
            )

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Nothing: validation images have no rows in the bank (see :meth:`on_validation_start`)."""
