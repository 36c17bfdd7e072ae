"""What the contrastive mechanisms of the MoCo paper share (He et al. 2020, §3.1 and Fig. 2): a query encoder,
positive keys, a dictionary of negatives, and InfoNCE.

    q = f_q(x_q)                                       query: the backbone, its head (and v3's predictor)
    k₊ = the positive key of each image               key(): key encoder or memory bank (loss_terms())
    logits = [q·k₊, q·negatives] / T;  CE(logits, 0)  views_loss() (loss.info_nce); negatives: the dictionary
    after the optimizer step: the dictionary keeps   Pretraining.finish_step: Negatives.store (keys of all ranks)

A method class sets its dictionary of negatives in ``__init__`` (:attr:`Pretraining.dictionary`, a
:class:`~moco_lightning.modules.dictionary.Negatives`) and writes one thing, its loss terms
(:meth:`Contrastive.loss_terms`:
which queries meet which positive keys and negatives): :class:`~moco_lightning.MoCo`,
:class:`~moco_lightning.MoCoV3`, :class:`~moco_lightning.EndToEnd` and :class:`~moco_lightning.MemoryBankMoCo`.
:class:`MomentumContrast` adds the momentum key encoder and shuffle BN of MoCo v1/v2/v3 (§3.2, §3.3).

Multi-crop (Caron et al. 2020, SwAV §3.2): batches ``([x_q, x_k, *local_views], ...)``; the small local views go
through the query encoder only, each contrasted with the keys of its image's global views; only global keys are
stored. The loss is (number of global queries) × the mean of all query terms: without local views, L(q1, k2)
and, when symmetric, + L(q2, k1), as the official code.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn

from moco_lightning.errors import check_arguments
from moco_lightning.methods.base import Pretraining
from moco_lightning.modules.dictionary import Negatives
from moco_lightning.modules.distributed import shuffle_across_ranks, unshuffle_across_ranks
from moco_lightning.modules.heads import projection_head
from moco_lightning.modules.loss import gather_keys, info_nce, pretext_metrics
from moco_lightning.modules.momentum import MomentumCopy
from moco_lightning.modules.split_bn import (
    check_bn_splits,
    check_last_batch,
    convert_split_bn,
    revert_split_bn,
    shuffle_mode,
)
from moco_lightning.training.plan import per_device_batch_size


class Terms(NamedTuple):
    """The loss terms of the two global views, in the order the encoders ran (which decides BatchNorm's running
    statistics)."""

    features: Tensor  # backbone features of the first view (for the callbacks)
    pairs: list  # (q, k₊, negatives): negatives (K, C) from the dictionary, or None: the global batch's other keys
    queries: list  # the global queries, first view's first
    keys: list  # the positive keys by view ([k₁, k₂]): what a queue stores
    scale: float = 1.0  # the loss's factor (v3: 2T)


class Contrastive(Pretraining):
    """Query encoder, positives, a dictionary of negatives and InfoNCE; ``forward(x)`` returns backbone features.

    Args:
        hidden_dim: hidden size of the projection head (and predictor).
        dim: embedding size C of queries and keys.
        temperature: T of the logits.
        decay_norm_bias: weight decay on every parameter, norms and biases included, as the official MoCo code
            (``False``: norms and biases decay-free, as SimCLR/BYOL).
        **kwargs: the backbone, optimizer and schedule of :class:`~moco_lightning.methods.base.Pretraining`.
    """

    STRUCTURAL = Pretraining.STRUCTURAL + ("dim", "hidden_dim")
    dictionary: Negatives  # set by each method in __init__

    def __init__(
        self,
        hidden_dim: int = 2048,
        dim: int = 128,
        temperature: float = 0.2,
        decay_norm_bias: bool = True,
        **kwargs: Any,
    ) -> None:
        check_arguments(type(self).__name__, Contrastive.__init__, locals())
        super().__init__(decay_norm_bias=decay_norm_bias, **kwargs)
        # f_q: the query encoder (self.backbone) and its heads, trained by backprop
        self.projection_head, self.prediction_head = self.build_heads()

    def build_heads(self) -> tuple[nn.Module, Optional[nn.Module]]:
        """(projection head, predictor or None) of the query encoder: v1's linear or v2's MLP head (the method's
        ``head`` argument) and no predictor; MoCo v3 builds its own."""
        return projection_head(self.hparams.head, self.feature_dim, self.hparams.hidden_dim, self.hparams.dim), None

    def key(self, x: Tensor, index: Optional[Tensor] = None) -> Tensor:
        """k₊: the positive keys of the views ``x`` (``index``: the images' dataset indices): what a method with a
        key encoder or a memory bank writes."""
        raise NotImplementedError(f"{type(self).__name__}.key")

    # --- the query encoder and the loss --------------------------------------------------------
    def trained_modules(self) -> list[nn.Module]:
        return [m for m in (self.backbone, self.projection_head, self.prediction_head) if m is not None]

    def query(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(features, q): backbone features and the L2-normalised query embedding (fp32)."""
        h = self.backbone(self.in_layout(x))
        z = self.projection_head(h)
        if self.prediction_head is not None:  # v3: the predictor is on the query side only
            z = self.prediction_head(z)
        return h, nn.functional.normalize(z.float(), dim=1)

    def loss_terms(self, x_q: Tensor, x_k: Tensor, index: Optional[Tensor]) -> Terms:
        """The loss terms of the two global views (``index``: the images' dataset indices): q₁ = f_q(x_q) against
        k₊ = :meth:`key` (x_k) and the dictionary's negatives; with ``symmetric``, q₂ against the key of x_q too (the
        official CIFAR demo's order: q₁, k₂, q₂, k₁; the keys stored as [k₁, k₂]). A method whose terms differ (MoCo
        v3, end-to-end) overrides it."""
        h, q = self.query(x_q)
        k = self.key(x_k, index)
        if not self.hparams.symmetric:
            return Terms(h, [(q, k, self.dictionary.negatives())], [q], [k])
        q2 = self.query(x_k)[1]
        k1 = self.key(x_q, index)
        return Terms(h, [(q, k, self.dictionary.negatives()), (q2, k1, self.dictionary.negatives())], [q, q2], [k1, k])

    def views_loss(self, views: Sequence[Tensor], index: Optional[Tensor] = None) -> dict[str, Any]:
        """The InfoNCE loss of one step, without touching the dictionary or the key encoder's weights."""
        equal = self._equal_sizes
        x_q, x_k = self.in_layout(views[0]), self.in_layout(views[1])  # once per view, not per encoder call
        local_views = views[2:]
        t = self.loss_terms(x_q, x_k, index)
        terms = list(t.pairs)
        if local_views:  # multi-crop: the query encoder alone, every local view against every global key
            local_q = self.query(self.in_layout(torch.cat(list(local_views))))[1].chunk(len(local_views))
            terms += [(lq, gk, neg) for lq in local_q for _, gk, neg in terms[: len(t.queries)]]
        # in-batch negatives: each global key's all-gather once, however many terms contrast with it
        gathered: dict[int, tuple[Tensor, int]] = {}
        for _, b, neg in terms:
            if neg is None and id(b) not in gathered:
                gathered[id(b)] = gather_keys(b, equal)
        T = self.hparams.temperature
        losses = [info_nce(a, b, neg, T, 1.0, equal, gathered.get(id(b))) for a, b, neg in terms]
        loss = len(t.queries) * torch.stack([term[0] for term in losses]).mean() * t.scale
        _, sims, labels = losses[0]
        q, k = terms[0][:2]
        return dict(
            loss=loss,
            features=t.features.detach(),
            q=q.detach(),
            k=k.detach(),
            stored=self.dictionary.to_store(t.queries, t.keys, index),
            sims=sims.detach(),
            labels=labels,
            metrics=pretext_metrics(sims.detach(), labels),
        )

    def nan_hints(self) -> str:
        return f"{super().nan_hints()}, or a temperature too low (temperature={self.hparams.temperature})"


class MomentumContrast(Contrastive):
    """Contrast with a momentum key encoder (MoCo §3.2): f_k is a copy of the query encoder's backbone and
    projection head, moved only by θ_k ← m·θ_k + (1 − m)·θ_q after each optimizer step; its batch is shuffled so
    that BatchNorm cannot leak the positive (§3.3, shuffling BN).

    Args:
        momentum: m, in [0, 1].
        momentum_schedule: ``"constant"``, or ``"cosine"`` from ``momentum`` to 1 over all optimizer steps (v3).
        shuffle_bn: how BatchNorm is kept from leaking the positive: ``"ddp"`` shuffles the key batch across ranks,
            ``"split"`` computes BN statistics over ``bn_splits`` sub-batches on one device (both encoders, as the
            official CIFAR demo) and shuffles the key batch, ``"off"``; ``"auto"``: ``"ddp"`` with several processes,
            ``"split"`` on one, ``"off"`` without BatchNorm.
        bn_splits: sub-batches for ``"split"``; the per-device batch must be a multiple of it.
        **kwargs: :class:`Contrastive`'s and the backbone/optimizer arguments.
    """

    def __init__(
        self,
        momentum: float = 0.999,
        momentum_schedule: Literal["constant", "cosine"] = "constant",
        shuffle_bn: Literal["auto", "ddp", "split", "off"] = "auto",
        bn_splits: int = 8,
        **kwargs: Any,
    ) -> None:
        check_arguments(type(self).__name__, MomentumContrast.__init__, locals())
        super().__init__(**kwargs)
        # f_k: the key encoder, a copy of f_q moved only by the momentum update
        self.momentum_copy = MomentumCopy(
            self, "key_", ("backbone", "projection_head"), momentum, momentum_schedule, "the key encoder"
        )
        self._shuffle = "off"  # resolved from shuffle_bn in setup(), when the world size is known

    @torch.no_grad()
    def key(self, x: Tensor, index: Optional[Tensor] = None) -> Tensor:
        """k = f_k(x): the L2-normalised key embedding (fp32), without gradient; in training the batch is shuffled for
        BatchNorm (across ranks, or within the device's split BN) and unshuffled after."""
        x = self.in_layout(x)
        shuffle = self._shuffle if self.training else "off"
        if shuffle != "off":
            # the same permutation on every rank, and again after a resume: seeded by the step; drawn on the batch's
            # device (a CPU permutation copied to a GPU would synchronise the two)
            g = torch.Generator(device=x.device).manual_seed(1_000_003 * (self.global_step + 1))
            if shuffle == "ddp":
                x, state = shuffle_across_ranks(x, g, self._equal_sizes)
            else:
                perm = torch.randperm(x.shape[0], generator=g, device=x.device)
                x = x[perm]
        k = nn.functional.normalize(self.key_projection_head(self.key_backbone(x)).float(), dim=1)
        if shuffle == "ddp":
            return unshuffle_across_ranks(k, state)
        return k if shuffle == "off" else torch.empty_like(k).index_copy_(0, perm, k)

    # --- training ---------------------------------------------------------------------------
    def prepare_run(self, stage: str) -> None:
        """Shuffle BN for a fit (:class:`~moco_lightning.run.FitSetup`): the mode resolved once the world size is
        known; with ``"split"`` both encoders' BatchNorm layers compute their statistics over ``bn_splits``
        sub-batches."""
        super().prepare_run(stage)
        if stage != "fit":
            return
        self._shuffle = shuffle_mode(self.hparams.shuffle_bn, self.backbone, self.trainer)
        for encoder in (self.backbone, self.key_backbone) if self._shuffle == "split" else ():
            convert_split_bn(encoder, self.hparams.bn_splits)

    def end_run(self, stage: str) -> None:
        super().end_run(stage)
        for encoder in (self.backbone, self.key_backbone) if stage == "fit" and self._shuffle == "split" else ():
            revert_split_bn(encoder)  # split BN only while fitting: the user's BatchNorm2d again
        self._shuffle = "off"

    def check_fit(self) -> None:
        super().check_fit()
        if shuffle_mode(self.hparams.shuffle_bn, self.backbone, self.trainer) == "split":
            per_device = per_device_batch_size(self)
            check_bn_splits(self.hparams.bn_splits, per_device)
            check_last_batch(self.hparams.bn_splits, per_device, self.trainer.train_dataloader)
