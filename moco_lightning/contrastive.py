"""What the contrastive mechanisms of the MoCo paper share (He et al. 2020, §3.1 and Fig. 2): a query encoder,
positive keys, a dictionary of negatives, and InfoNCE.

    q = f_q(x_q)                                       query: the backbone, its head (and v3's predictor)
    k₊ = the positive key of each image               positive_keys(): key encoder, query encoder or memory bank
    logits = [q·k₊, q·negatives] / T;  CE(logits, 0)  contrast() (loss.info_nce); negatives: the dictionary
    after the optimizer step: the dictionary keeps   finish_step(): Negatives.store (keys of all ranks)

A method class says where its positives come from (:meth:`Contrastive.positive_keys`), which dictionary holds its
negatives (:attr:`Contrastive.dictionary`, a :class:`~moco_lightning.negatives.Negatives`), and builds its heads
(:meth:`Contrastive.build_heads`): :class:`~moco_lightning.MoCo`, :class:`~moco_lightning.MoCoV3`,
:class:`~moco_lightning.EndToEnd` and :class:`~moco_lightning.MemoryBankMoCo`. :class:`MomentumContrast` adds the
momentum key encoder and shuffle BN of MoCo v1/v2/v3 (§3.2, §3.3).

Multi-crop (Caron et al. 2020, SwAV §3.2): batches ``([x_q, x_k, *local_views], ...)``; the small local views go
through the query encoder only, each contrasted with the keys of its image's global views; only global keys are
stored. The loss is (number of global queries) × the mean of all query terms: without local views, L(q1, k2)
and, when symmetric, + L(q2, k1), as the official code.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

import torch
from torch import Tensor, nn

from .base import Pretraining
from .batches import is_views_batch
from .distributed import concat_all_gather, shuffle_across_ranks, unshuffle_across_ranks
from .errors import check_arguments
from .loss import gather_keys, info_nce
from .momentum import MomentumCopy
from .negatives import Negatives
from .plan import global_batch_size
from .split_bn import check_bn_splits, convert_split_bn, revert_split_bn, shuffle_mode


class Contrastive(Pretraining):
    """Query encoder, positives, a dictionary of negatives and InfoNCE; ``forward(x)`` returns backbone features.

    Args:
        hidden_dim: hidden size of the projection head (and predictor).
        dim: embedding size C of queries and keys.
        temperature: T of the logits.
        decay_norm_bias: weight decay on every parameter, norms and biases included, as the official MoCo code
            (``False``: norms and biases decay-free, as SimCLR/BYOL).
        **kwargs: the backbone, optimizer and schedule of :class:`~moco_lightning.base.Pretraining`.
    """

    STRUCTURAL = Pretraining.STRUCTURAL + ("dim", "hidden_dim")
    symmetric = False  # both global views serve as queries (a subclass's setting or property)

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
        self._stored: tuple = ()  # what the dictionary keeps of this step (all ranks' rows), after the optimizer step

    # --- what a method says ------------------------------------------------------------------
    def build_heads(self) -> tuple[nn.Module, Optional[nn.Module]]:
        """(projection head, predictor or None) of the query encoder."""
        raise NotImplementedError

    @property
    def dictionary(self) -> Negatives:
        """Where the negatives come from (a queue, the batch, a memory bank)."""
        raise NotImplementedError

    def positive_keys(self, x: Tensor, index: Optional[Tensor]) -> Tensor:
        """k₊: the L2-normalised positive keys (fp32) of the images of ``x`` (``index``: their dataset indices)."""
        raise NotImplementedError

    def loss_scale(self) -> float:
        return 1.0

    # --- the query encoder and the loss --------------------------------------------------------
    def trained_modules(self) -> list[nn.Module]:
        return [m for m in (self.backbone, self.projection_head, self.prediction_head) if m is not None]

    def query(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(features, q): backbone features and the L2-normalised query embedding (fp32)."""
        h = self.backbone(self._layout(x))
        z = self.projection_head(h)
        if self.prediction_head is not None:  # v3: the predictor is on the query side only
            z = self.prediction_head(z)
        return h, nn.functional.normalize(z.float(), dim=1)

    def global_terms(self, x_q: Tensor, x_k: Tensor, index: Optional[Tensor]) -> tuple[Tensor, list, list, list]:
        """The loss terms of the two global views, in the official order of encoder calls (which decides the
        BatchNorm running statistics): ``(features of x_q, [(q, k₊, negatives), ...], queries, keys by view)``.

        v1/v2 (the official CIFAR demo's symmetric loss): q₁, k₂, then q₂, k₁; the keys are stored as [k₁, k₂]."""
        h, q = self.query(x_q)
        k = self.positive_keys(x_k, index)
        if not self.symmetric:
            return h, [(q, k, self.dictionary.negatives())], [q], [k]
        q2 = self.query(x_k)[1]
        k1 = self.positive_keys(x_q, index)
        return h, [(q, k, self.dictionary.negatives()), (q2, k1, self.dictionary.negatives())], [q, q2], [k1, k]

    def contrast(
        self, x_q: Tensor, x_k: Tensor, index: Optional[Tensor] = None, local_views: Sequence[Tensor] = ()
    ) -> dict[str, Tensor]:
        """The InfoNCE loss of one step, without touching the dictionary or the key encoder's weights."""
        equal = self._equal_sizes
        x_q, x_k = self._layout(x_q), self._layout(x_k)  # once per view (a no-op afterwards), not per encoder call
        h, terms, queries, keys = self.global_terms(x_q, x_k, index)
        q, k = terms[0][:2]
        if local_views:  # multi-crop: the query encoder alone, every local view against every global key
            local_q = self.query(self._layout(torch.cat(list(local_views))))[1].chunk(len(local_views))
            terms += [(lq, gk, neg) for lq in local_q for _, gk, neg in terms[: len(queries)]]
        # in-batch negatives: each global key's all-gather once, however many terms contrast with it
        gathered: dict[int, tuple[Tensor, int]] = {}
        for _, b, neg in terms:
            if neg is None and id(b) not in gathered:
                gathered[id(b)] = gather_keys(b, equal)
        T = self.hparams.temperature
        losses = [info_nce(a, b, neg, T, 1.0, equal, gathered.get(id(b))) for a, b, neg in terms]
        loss = len(queries) * torch.stack([term[0] for term in losses]).mean() * self.loss_scale()
        _, sims, labels = losses[0]
        stored = self.dictionary.to_store(queries, keys, index)
        return dict(
            loss=loss, features=h.detach(), q=q.detach(), k=k.detach(), stored=stored, sims=sims.detach(), labels=labels
        )

    # --- training ---------------------------------------------------------------------------
    def dictionary_buffers(self) -> list[str]:
        ours = {id(b) for b in self.dictionary.buffers()}
        return [name for name, b in self.named_buffers() if id(b) in ours]

    def training_step(self, batch: Any, batch_idx: int) -> Optional[dict[str, Tensor]]:
        (x_q, x_k, *local_views), index = self.batch_views(batch)
        out = self.contrast(x_q, x_k, index, local_views)
        if not self.loss_is_usable(out["loss"], batch_idx, (x_q, x_k, *local_views)):
            return None
        # What the dictionary keeps is gathered from all ranks here, where every rank runs the same code: the
        # momentum update and the store after the optimizer step are then local, and so is a checkpoint save.
        self._stored = tuple(concat_all_gather(rows, self._equal_sizes) for rows in out.pop("stored"))
        self.log_contrastive("train", out["loss"], out["sims"], out["labels"], on_step=True, on_epoch=False)
        self.log_lr(**self.step_scalars())
        return {key: out[key] for key in ("loss", "features", "q", "k")}

    def finish_step(self) -> None:
        """The dictionary keeps this step's rows of all ranks (after the optimizer step)."""
        if self._stored:
            self.dictionary.store(*self._stored, step=self.global_step)
            self._stored = ()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """The pretext task on held-out views: never stores keys, never moves the key encoder."""
        if is_views_batch(batch):  # not an evaluation batch (image, target)
            out = self.contrast(*self.batch_views(batch)[0][:2])
            self.log_contrastive(
                "val", out["loss"], out["sims"], out["labels"], on_step=False, on_epoch=True, sync_dist=True
            )

    def nan_hints(self) -> str:
        return f"{super().nan_hints()}, or a temperature too low (temperature={self.hparams.temperature})"

    def log_contrastive(self, stage: str, loss: Tensor, sims: Tensor, labels: Tensor, **kwargs: Any) -> None:
        """The loss and the pretext task's accuracy (is the positive the top logit), mean positive/negative cosine."""
        pos = sims.gather(1, labels[:, None])
        top5 = sims.topk(min(5, sims.shape[1]), dim=1).indices
        # in the progress bar for validation only: a training-step tensor there is read on the host every step
        self.log(f"{stage}/loss", loss, prog_bar=stage != "train", **kwargs)
        self.log_dict(
            {
                f"{stage}/acc1": (top5[:, 0] == labels).float().mean(),
                f"{stage}/acc5": (top5 == labels[:, None]).any(1).float().mean(),
                f"{stage}/logit_pos": pos.mean(),
                f"{stage}/logit_neg": (sims.sum() - pos.sum()) / max(1, sims.numel() - pos.numel()),
            },
            **kwargs,
        )


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
        self.key_encoder = MomentumCopy(self, "key_", ("backbone", "projection_head"), momentum, momentum_schedule)
        self._shuffle = "off"  # resolved from shuffle_bn in setup(), when the world size is known

    def momentum_copies(self) -> dict[str, str]:
        return dict(self.key_encoder.pairs)

    def positive_keys(self, x: Tensor, index: Optional[Tensor]) -> Tensor:
        return self.key(x)

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

    # --- training ---------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        self.key_encoder.refuse_half_precision(self, "the key encoder and the queue")
        self._shuffle = shuffle_mode(self.hparams.shuffle_bn, self.backbone, self.trainer)
        for encoder in (self.backbone, self.key_backbone) if self._shuffle == "split" else ():
            convert_split_bn(encoder, self.hparams.bn_splits)

    def teardown(self, stage: str) -> None:
        for encoder in (self.backbone, self.key_backbone) if stage == "fit" and self._shuffle == "split" else ():
            revert_split_bn(encoder)  # split BN only while fitting: the user's BatchNorm2d again
        self._shuffle = "off"

    def configure_optimizers(self) -> dict:
        config = super().configure_optimizers()  # at fit start, before any callback's evaluation
        if self._shuffle == "split":
            per_device = global_batch_size(self) // (self.trainer.world_size * self.trainer.accumulate_grad_batches)
            check_bn_splits(self.hparams.bn_splits, per_device)
        return config

    def step_scalars(self) -> dict[str, float]:
        return self.key_encoder.scalars(self)

    def finish_step(self) -> None:
        """Momentum update (only if an optimizer step happened), then the dictionary keeps the step's keys."""
        self.key_encoder.after_step(self)
        super().finish_step()

    def momentum_at(self, step: int) -> float:
        """m(j) of the update that follows the j-th optimizer step (:func:`moco_lightning.optim.momentum_at`)."""
        return self.key_encoder.at(self, step)

    def momentum_update(self, m: float) -> None:
        """θ_k ← m·θ_k + (1 − m)·θ_q over backbone and head."""
        self.key_encoder.update(self, m)
