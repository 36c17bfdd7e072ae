"""MoCo: Momentum Contrast for unsupervised visual representation learning.

- v1: He, Fan, Wu, Xie, Girshick, CVPR 2020, https://arxiv.org/abs/1911.05722
- v2: Chen, Fan, Girshick, He, 2020, https://arxiv.org/abs/2003.04297 (MLP head, blur, T 0.2, cosine lr)
- v3: :class:`moco_lightning.v3.MoCoV3`; the paper's other dictionaries: :mod:`moco_lightning.dictionaries`.

Algorithm 1 of the paper, and where each line lives:

    q = f_q(x_q);  k = f_k(x_k).detach()          query, key
    logits = [q·k₊, q·queue] / T;  CE(logits, 0)  contrast (loss.info_nce)
    loss.backward();  SGD update of f_q             Lightning
    θ_k ← m·θ_k + (1 − m)·θ_q                       on_train_batch_end, only after a real optimizer step
    enqueue(k);  dequeue the oldest                 on_train_batch_end (keys of all ranks)

Multi-crop (Caron et al. 2020, SwAV §3.2): batches ``([x_q, x_k, *local_views], ...)``; the small local views go
through the query encoder only, each contrasted with the keys of its image's global views; only global keys are
enqueued. The loss is (number of global queries) × the mean of all query terms: without local views, L(q1, k2)
and, when ``symmetric``, + L(q2, k1), as the official code.
"""

from __future__ import annotations

import copy
from typing import Any, Literal, Optional, Sequence

import torch
from torch import Tensor, nn

from .base import Pretraining, is_views_batch
from .distributed import concat_all_gather, shuffle_across_ranks, unshuffle_across_ranks
from .errors import check_arguments
from .heads import projection_head
from .loss import gather_keys, info_nce
from .optim import momentum_at, momentum_update
from .queue import KeyQueue
from .split_bn import check_bn_splits, convert_split_bn, revert_split_bn, shuffle_mode


class MoCo(Pretraining):
    """MoCo v1/v2 (defaults: v2 on ImageNet). ``forward(x)`` returns backbone features.

    Args:
        head: ``"linear"`` (v1: fc to ``dim``) or ``"mlp"`` (v2: fc-ReLU-fc, hidden ``hidden_dim``).
        dim: embedding size C of q and k.
        queue_size: K, number of negative keys; 0 uses the other keys of the global batch as negatives.
        momentum: m of θ_k ← m·θ_k + (1 − m)·θ_q, in [0, 1].
        momentum_schedule: ``"constant"``, or ``"cosine"`` from ``momentum`` to 1 over all optimizer steps (v3).
        temperature: T of the logits.
        symmetric: both views serve as query; loss = L(q1, k2) + L(q2, k1), both keys enqueued.
        shuffle_bn: how BatchNorm is kept from leaking the positive (§3.3): ``"ddp"`` shuffles the key batch across
            ranks, ``"split"`` computes BN statistics over ``bn_splits`` sub-batches on one device (both encoders,
            as the official CIFAR demo) and shuffles the key batch, ``"off"``; ``"auto"``: ``"ddp"`` with several
            processes, ``"split"`` on one, ``"off"`` without BatchNorm.
        bn_splits: sub-batches for ``"split"``; the per-device batch must be a multiple of it.
        decay_norm_bias: weight decay on every parameter, norms and biases included, as the official v1/v2 code
            (``False``: norms and biases decay-free, as SimCLR/BYOL).
        **kwargs: the backbone, optimizer and schedule of :class:`~moco_lightning.base.Pretraining`.
    """

    STRUCTURAL = Pretraining.STRUCTURAL + ("head", "dim", "hidden_dim", "queue_size")
    has_key_encoder = True  # the paper's other dictionaries have none
    dictionary_buffers = ("queue.", "memory_bank.")  # every rank updates them alike: kept out of DDP's broadcast
    stores_by_index = False  # the memory bank stores one row per image index

    def __init__(
        self,
        head: Literal["linear", "mlp"] = "mlp",
        dim: int = 128,
        hidden_dim: int = 2048,
        queue_size: int = 65536,
        momentum: float = 0.999,
        momentum_schedule: Literal["constant", "cosine"] = "constant",
        temperature: float = 0.2,
        symmetric: bool = False,
        shuffle_bn: Literal["auto", "ddp", "split", "off"] = "auto",
        bn_splits: int = 8,
        decay_norm_bias: bool = True,
        **kwargs: Any,
    ) -> None:
        check_arguments(type(self).__name__, MoCo.__init__, locals())
        super().__init__(decay_norm_bias=decay_norm_bias, **kwargs)
        self.record_hyperparameters(locals())
        # f_q: the query encoder (self.backbone) and its heads, trained by backprop
        self.projection_head, self.prediction_head = self.build_heads()
        # f_k: the key encoder, a copy of f_q moved only by the momentum update
        self.key_backbone, self.key_projection_head = (
            [copy.deepcopy(m).requires_grad_(False) for m in (self.backbone, self.projection_head)]
            if self.has_key_encoder
            else (None, None)
        )
        self.queue = KeyQueue(queue_size, dim)
        self._shuffle = "off"  # resolved from shuffle_bn in setup(), when the world size is known
        self._keys: Optional[Tensor] = None  # this step's keys of all ranks, stored after the optimizer step
        self._index: Optional[Tensor] = None  # this step's image indices of all ranks (memory bank)

    def build_heads(self) -> tuple[nn.Module, Optional[nn.Module]]:
        """(projection head, predictor or None) of the query encoder; the key encoder copies the first."""
        return projection_head(self.hparams.head, self.feature_dim, self.hparams.hidden_dim, self.hparams.dim), None

    def trained_modules(self) -> list[nn.Module]:
        return [m for m in (self.backbone, self.projection_head, self.prediction_head) if m is not None]

    # --- the two encoders -------------------------------------------------------------------
    def query(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(features, q): backbone features and the L2-normalised query embedding (fp32)."""
        h = self.backbone(self._layout(x))
        z = self.projection_head(h)
        if self.prediction_head is not None:  # v3: the predictor is on the query side only
            z = self.prediction_head(z)
        return h, nn.functional.normalize(z.float(), dim=1)

    @torch.no_grad()
    def key(self, x: Tensor) -> Tensor:
        """k: the L2-normalised key embedding (fp32), without gradient; the batch is shuffled for BN in training."""
        x = self._layout(x)
        shuffle = self._shuffle if self.training else "off"
        if shuffle == "off":
            return self._encode_key(x)
        # the same permutation on every rank, and again after a resume: seeded by the step; drawn on the batch's
        # device (a CPU permutation copied to a GPU would synchronise the two)
        g = torch.Generator(device=x.device).manual_seed(1_000_003 * (self.global_step + 1))
        if shuffle == "ddp":
            x, state = shuffle_across_ranks(x, g, self._equal_sizes)
            return unshuffle_across_ranks(self._encode_key(x), state)
        perm = torch.randperm(x.shape[0], generator=g, device=x.device)
        k = self._encode_key(x[perm])
        return torch.empty_like(k).index_copy_(0, perm, k)

    def _encode_key(self, x: Tensor) -> Tensor:
        return nn.functional.normalize(self.key_projection_head(self.key_backbone(x)).float(), dim=1)

    # --- the dictionary: what a subclass changes ----------------------------------------------
    def positives_and_negatives(self, x_k: Tensor, index: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """The positive keys of the batch and the negatives (None: the other keys of the global batch)."""
        return self.key(x_k), (self.queue.keys if self.queue.size > 0 else None)

    def global_terms(self, x_q: Tensor, x_k: Tensor, index: Optional[Tensor]) -> tuple[Tensor, list, list, list]:
        """The loss terms of the two global views, in the official order of encoder calls (which decides the
        BatchNorm running statistics): ``(features of x_q, [(q, k₊, negatives), ...], queries, keys by view)``.

        v1/v2 (the official CIFAR demo's symmetric loss): q₁, k₂, then q₂, k₁; the keys are stored as [k₁, k₂]."""
        h, q = self.query(x_q)
        k, negatives = self.positives_and_negatives(x_k, index)
        if not self.hparams.symmetric:
            return h, [(q, k, negatives)], [q], [k]
        q2 = self.query(x_k)[1]
        k1, negatives1 = self.positives_and_negatives(x_q, index)
        return h, [(q, k, negatives), (q2, k1, negatives1)], [q, q2], [k1, k]

    def to_store(self, queries: list[Tensor], keys: list[Tensor]) -> Optional[Tensor]:
        """What the dictionary keeps of this step (the global keys; None: nothing, with no queue to fill)."""
        return torch.cat(keys).detach() if self.queue.size > 0 else None

    def store(self, stored: Tensor, index: Optional[Tensor]) -> None:
        self.queue.enqueue(stored, step=self.global_step)

    def loss_scale(self) -> float:
        return 1.0

    def contrast(
        self, x_q: Tensor, x_k: Tensor, index: Optional[Tensor] = None, local_views: Sequence[Tensor] = ()
    ) -> dict[str, Tensor]:
        """The InfoNCE loss of one step, without touching the dictionary or the key encoder's weights."""
        hp, equal = self.hparams, self._equal_sizes
        x_q, x_k = self._layout(x_q), self._layout(x_k)  # once per view (a no-op afterwards), not per encoder call
        h, terms, queries, keys = self.global_terms(x_q, x_k, index)
        q, k = terms[0][:2]
        if local_views:  # multi-crop: the query encoder alone, every local view against every global key
            local_q = self.query(self._layout(torch.cat(list(local_views))))[1].chunk(len(local_views))
            terms += [(lq, gk, neg) for lq in local_q for _, gk, neg in terms[: len(queries)]]
        # in-batch negatives (no queue): each global key's all-gather once, however many terms contrast with it
        gathered: dict[int, tuple[Tensor, int]] = {}
        for _, b, neg in terms:
            if neg is None and id(b) not in gathered:
                gathered[id(b)] = gather_keys(b, equal)
        losses = [info_nce(a, b, neg, hp.temperature, 1.0, equal, gathered.get(id(b))) for a, b, neg in terms]
        loss = len(queries) * torch.stack([term[0] for term in losses]).mean() * self.loss_scale()
        _, sims, labels = losses[0]
        stored = self.to_store(queries, keys)
        return dict(
            loss=loss, features=h.detach(), q=q.detach(), k=k.detach(), keys=stored, sims=sims.detach(), labels=labels
        )

    # --- training ---------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        self.refuse_half_precision_weights("the key encoder and the queue")
        self._shuffle = shuffle_mode(self.hparams.shuffle_bn, self.backbone, self.trainer)
        for encoder in (self.backbone, self.key_backbone) if self._shuffle == "split" else ():
            if encoder is not None:
                convert_split_bn(encoder, self.hparams.bn_splits)

    def teardown(self, stage: str) -> None:
        for encoder in (self.backbone, self.key_backbone) if stage == "fit" and self._shuffle == "split" else ():
            if encoder is not None:  # split BN only while fitting: the user's BatchNorm2d again
                revert_split_bn(encoder)
        self._shuffle = "off"

    def configure_optimizers(self) -> dict:
        if self._shuffle == "split":  # at fit start, before any callback's evaluation
            check_bn_splits(
                self.hparams.bn_splits,
                self.global_batch_size() // (self.trainer.world_size * self.trainer.accumulate_grad_batches),
            )
        return super().configure_optimizers()

    def training_step(self, batch: Any, batch_idx: int) -> Optional[dict[str, Tensor]]:
        (x_q, x_k, *local_views), index = self.batch_views(batch)
        out = self.contrast(x_q, x_k, index, local_views)
        if not self.loss_is_usable(out["loss"], batch_idx):
            return None
        # The stored keys (and bank indices) of all ranks are gathered here, where every rank runs the same code:
        # the momentum update and the enqueue after the optimizer step are then local, and so is a checkpoint save.
        stored, equal = out.pop("keys"), self._equal_sizes
        self._keys = concat_all_gather(stored, equal) if stored is not None else None
        self._index = concat_all_gather(index, equal) if stored is not None and self.stores_by_index else None
        self.log_contrastive("train", out["loss"], out["sims"], out["labels"], on_step=True, on_epoch=False)
        self.log_lr(**{"train/momentum": self.momentum_at(self.global_step + 1)})  # m of this step's update
        return {key: out[key] for key in ("loss", "features", "q", "k")}

    @property
    def finished_state(self) -> tuple:
        return ("key_", *self.dictionary_buffers)

    def step_pending(self) -> bool:
        return self._keys is not None or super().step_pending()

    def finish_step(self) -> None:
        """Momentum update (only if an optimizer step happened), then store the step's keys of all ranks."""
        if self.optimizer_stepped() and self.key_backbone is not None:  # not after an accumulation micro-batch
            self.momentum_update(self.momentum_at(self.global_step))  # m(j) after the j-th step (optim.momentum_at)
        if self._keys is not None:
            self.store(self._keys, self._index)
            self._keys = self._index = None

    def momentum_update(self, m: float) -> None:
        """θ_k ← m·θ_k + (1 − m)·θ_q over backbone and head."""
        momentum_update([self.key_backbone, self.key_projection_head], [self.backbone, self.projection_head], m)

    def momentum_at(self, step: int) -> float:
        """m(j) of the update that follows the j-th optimizer step (:func:`moco_lightning.optim.momentum_at`)."""
        hp = self.hparams
        return momentum_at(*self.planned_step(step), hp.momentum, hp.momentum_schedule)

    # --- validation: never stores keys, never moves the key encoder ---------------------------
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if is_views_batch(batch):  # not an evaluation batch (image, target)
            out = self.contrast(*self.batch_views(batch)[0][:2])
            self.log_contrastive(
                "val", out["loss"], out["sims"], out["labels"], on_step=False, on_epoch=True, sync_dist=True
            )
