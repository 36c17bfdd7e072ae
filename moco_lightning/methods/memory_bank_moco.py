"""InstDisc's memory bank as MoCo's dictionary (He et al. 2020, §3.2 and Fig. 2b; Wu, Xiong, Yu, Lin, InstDisc,
CVPR 2018, https://arxiv.org/abs/1805.01978): one stored feature per training image; the positive of an image is its
own stored feature, ``num_negatives`` negatives are sampled from the bank, and after the step the image's row moves
towards its query, ``v ← normalise(m·v + (1 − m)·q)`` with ``m = bank_momentum`` (InstDisc: 0.5). No key encoder.

Select it in a config with ``model: {class_path: moco_lightning.MemoryBankMoCo, init_args: {...}}``.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Optional

from torch import Tensor

from moco_lightning.errors import ConfigError, check_arguments
from moco_lightning.methods.contrastive import Contrastive
from moco_lightning.modules.dictionary import MemoryBank, warn_own_keys
from moco_lightning.training.plan import training_images


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
            :class:`~moco_lightning.methods.contrastive.Contrastive` and the backbone/optimizer arguments (no key
            encoder).
    """

    STRUCTURAL = Contrastive.STRUCTURAL + ("head", "memory_bank_size")
    validation_loss = False  # validation images have no row in the bank (their positives)

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
        self.dictionary = MemoryBank(memory_bank_size, self.hparams.dim, num_negatives, bank_momentum)

    def key(self, x: Tensor, index: Optional[Tensor] = None) -> Tensor:
        """k₊: the image's stored feature (its positive), whatever its view; features sampled from the bank are the
        negatives (the dictionary's)."""
        return self.dictionary.positives(MemoryBank.require_index(index))

    def check_fit(self) -> None:
        super().check_fit()  # loads the training data
        # checked once, at fit start (before any callback's evaluation): a per-step index check would stall an
        # accelerator. Too few rows would index outside the bank; too many would serve never-updated random rows
        # as negatives.
        n = training_images(self)  # None for an iterable dataset: MemoryBank checks the first batch's indices
        if n and n != self.dictionary.size:
            raise ConfigError(
                f"MemoryBankMoCo: memory_bank_size={self.dictionary.size}, but the training set has {n} images"
                + (
                    ": the rows of no image would stay random and serve as negatives"
                    if n < self.dictionary.size
                    else ""
                )
                + f"; set memory_bank_size to {n} (one bank row per training image)"
            )
        warn_own_keys("MemoryBankMoCo", "num_negatives", self.dictionary.num_negatives, n, sampled=True)

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking:
            warnings.warn(
                "MemoryBankMoCo has no validation loss: validation images have no row in the memory bank (their "
                "positives); validation runs the callbacks only (KNNMonitor, LinearProbe)",
                stacklevel=2,
            )
