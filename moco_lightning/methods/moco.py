"""MoCo: Momentum Contrast for unsupervised visual representation learning.

- v1: He, Fan, Wu, Xie, Girshick, CVPR 2020, https://arxiv.org/abs/1911.05722
- v2: Chen, Fan, Girshick, He, 2020, https://arxiv.org/abs/2003.04297 (MLP head, blur, T 0.2, cosine lr)
- v3: :class:`moco_lightning.methods.v3.MoCoV3`; the paper's other dictionaries:
:mod:`moco_lightning.methods.end_to_end`,
  :mod:`moco_lightning.methods.memory_bank_moco`.

Algorithm 1 of the paper, and where each line lives:

    q = f_q(x_q);  k = f_k(x_k).detach()          Contrastive.query, MomentumContrast.key (Contrastive.loss_terms)
    logits = [q·k₊, q·queue] / T;  CE(logits, 0)  Contrastive.views_loss (loss.info_nce)
    loss.backward();  SGD update of f_q             Lightning
    θ_k ← m·θ_k + (1 − m)·θ_q                       on_train_batch_end, only after a real optimizer step
    enqueue(k);  dequeue the oldest                 on_train_batch_end (keys of all ranks): KeyQueue
"""

from __future__ import annotations

from typing import Any, Literal

from moco_lightning.errors import check_arguments
from moco_lightning.methods.contrastive import MomentumContrast
from moco_lightning.modules.dictionary import InBatch, KeyQueue, warn_own_keys
from moco_lightning.training.plan import training_images


class MoCo(MomentumContrast):
    """MoCo v1/v2 (defaults: v2 on ImageNet). ``forward(x)`` returns backbone features.

    Args:
        head: ``"linear"`` (v1: fc to ``dim``) or ``"mlp"`` (v2: fc-ReLU-fc, hidden ``hidden_dim``).
        queue_size: K, number of negative keys; 0 uses the other keys of the global batch as negatives.
        symmetric: both views serve as query; loss = L(q1, k2) + L(q2, k1), both keys enqueued.
        **kwargs: the key encoder (``momentum``, ``momentum_schedule``, ``shuffle_bn``, ``bn_splits``) of
            :class:`~moco_lightning.methods.contrastive.MomentumContrast`, ``dim``, ``hidden_dim``, ``temperature``,
            ``decay_norm_bias`` of :class:`~moco_lightning.methods.contrastive.Contrastive`, and the backbone,
            optimizer and schedule of :class:`~moco_lightning.methods.base.Pretraining`.
    """

    STRUCTURAL = MomentumContrast.STRUCTURAL + ("head", "queue_size")

    def __init__(
        self,
        head: Literal["linear", "mlp"] = "mlp",
        queue_size: int = 65536,
        symmetric: bool = False,
        **kwargs: Any,
    ) -> None:
        check_arguments(type(self).__name__, MoCo.__init__, locals())
        super().__init__(**kwargs)
        self.dictionary = KeyQueue(queue_size, self.hparams.dim) if queue_size > 0 else InBatch()

    def check_fit(self) -> None:
        """A queue more than half an epoch of keys long holds an image's earlier key among its own negatives: warned."""
        super().check_fit()
        if self.hparams.queue_size > 0:
            keys = 2 if self.hparams.symmetric else 1  # both views' keys are enqueued
            warn_own_keys("MoCo", "queue_size", self.hparams.queue_size, training_images(self), keys)
