"""MoCo: Momentum Contrast for unsupervised visual representation learning.

- v1: He, Fan, Wu, Xie, Girshick, CVPR 2020, https://arxiv.org/abs/1911.05722
- v2: Chen, Fan, Girshick, He, 2020, https://arxiv.org/abs/2003.04297
- v3: Chen, Xie, He, ICCV 2021, https://arxiv.org/abs/2104.02057 (no queue: the keys of the global batch,
  symmetric loss × 2T, BN-MLP projector and a predictor on the query side, momentum on a cosine to 1, LARS/AdamW)

Algorithm 1 of the paper, and where each line lives:

    q = f_q(x_q);  k = f_k(x_k).detach()          training_step (query, key)
    logits = [q·k₊, q·queue] / T;  CE(logits, 0)  training_step (loss.info_nce)
    loss.backward();  SGD update of f_q             Lightning
    θ_k ← m·θ_k + (1 − m)·θ_q                       on_train_batch_end, only after a real optimizer step
    enqueue(k);  dequeue the oldest                 on_train_batch_end (keys of all ranks)

The paper's other dictionaries (§3.2, Fig. 2) are ``dictionary="batch"`` (end-to-end: keys from the query encoder
itself, with gradients; negatives = the rest of the batch) and ``dictionary="memory_bank"`` (InstDisc: one stored
feature per image, negatives sampled from it, updated with momentum by index).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightly.models.modules.heads import BYOLPredictionHead, MoCoProjectionHead, ProjectionHead
from lightly.models.utils import get_weight_decay_parameters
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DistributedSampler

from . import checkpoint as ckpt
from .backbones import build_backbone
from .distributed import concat_all_gather, shuffle_across_ranks, unshuffle_across_ranks, world_size
from .loss import info_nce
from .memory_bank import MemoryBank
from .optim import LARS
from .queue import KeyQueue
from .split_bn import convert_split_bn, revert_split_bn
from .errors import ConfigError


class MoCo(LightningModule):
    """MoCo v1/v2/v3 (defaults: v2 on ImageNet; ``configs/moco_v3.yaml`` for v3). ``forward(x)`` returns backbone features.

    Args:
        backbone: torchvision model name or an ``nn.Module`` returning features (N, D).
        cifar_stem: 3x3 stride-1 stem without max-pool for small images (ResNets).
        in_channels: image channels (1 for grayscale).
        image_size: input side, used only to find the feature size of models that need it.
        width: ResNets only: channel multiplier of every stage (0.5 halves ResNet-18's 64-512 channels).
        head: ``"linear"`` (v1: fc to ``dim``), ``"mlp"`` (v2: fc-ReLU-fc, hidden ``hidden_dim``) or ``"bn_mlp"``
            (v3: three fc layers, each followed by BN, the last BN without affine parameters).
        dim: embedding size C of q and k.
        predictor_hidden_dim: > 0 adds v3's predictor (fc-BN-ReLU-fc, ``dim`` → ``dim``) on the query side only.
        dictionary: where the keys come from: ``"queue"`` (MoCo: momentum key encoder + FIFO queue),
            ``"batch"`` (end-to-end: the query encoder, with gradients, no key encoder; negatives = the other keys
            of the global batch) or ``"memory_bank"`` (InstDisc: positive = the image's stored feature,
            ``queue_size`` negatives sampled from the bank, the image's row then moved towards its query — the mean
            of both views' queries when ``symmetric``; needs batches ``(views, targets, index)``).
        queue_size: K, number of negative keys; 0 uses the other keys of the global batch as negatives (v3).
        memory_bank_size: rows of the memory bank: the number of training images (``dictionary="memory_bank"``).
        momentum: m of θ_k ← m·θ_k + (1 − m)·θ_q, in [0, 1]; with ``"memory_bank"``, the m of the stored
            features' update ``v ← normalise(m·v + (1 − m)·q)`` (InstDisc: 0.5).
        momentum_schedule: ``"constant"``, or ``"cosine"`` from ``momentum`` to 1 over all optimizer steps.
        temperature: T of the logits.
        symmetric: both views serve as query; loss = L(q1, k2) + L(q2, k1), both keys enqueued.
        scale_loss: multiply the loss by 2T (v3: the gradient's size then does not depend on T).
        lr: learning rate per 256 images; the optimizer uses lr × global batch / 256.
        optimizer: ``"sgd"``, ``"lars"`` (v3 ResNets; lightly's LARS, no adaptation or decay of norms and
            biases) or ``"adamw"`` (v3 ViTs).
        weight_decay, sgd_momentum: optimizer settings (``sgd_momentum`` for SGD and LARS).
        decay_norm_bias: also decay norm and bias parameters (the official code does; default off).
        lr_schedule: ``"cosine"`` (v2), ``"step"`` (v1: ×0.1 at each of ``lr_milestones`` epochs) or ``"constant"``.
        warmup_epochs: linear warm-up length (may be fractional).
        shuffle_bn: how BatchNorm is kept from leaking the positive (§3.3): ``"ddp"`` shuffles the key
            batch across ranks, ``"split"`` computes BN statistics over ``bn_splits`` sub-batches on one
            device (both encoders, as the official CIFAR demo) and shuffles the key batch, ``"off"``;
            ``"auto"``: ``"ddp"`` with several processes, ``"split"`` on one, ``"off"`` without BatchNorm.
        bn_splits: sub-batches for ``"split"``; the per-device batch must be a multiple of it.
        channels_last: keep the encoders and their inputs in channels-last memory format (faster
            convolutions on CPUs and tensor cores; measured +50 % for a narrow ResNet-18 on 2 CPU cores).
        freeze_patch_embed: v3's "random patch projection" (§5): keep a ViT's patch embedding (``conv_proj``) fixed.
        on_nan: a non-finite loss ``"raise"``s (stops training before a checkpoint holds bad weights) or
            ``"skip"``s the batch with a warning (single process only: DDP ranks must step together).
    """

    FORMAT_VERSION = ckpt.FORMAT_VERSION
    #: settings that change the shape of the weights or of the dictionary: a checkpoint must agree on them
    STRUCTURAL = ("backbone", "cifar_stem", "in_channels", "width", "head", "dim", "hidden_dim", "queue_size",
                  "predictor_hidden_dim", "dictionary", "memory_bank_size")

    def __init__(
        self,
        backbone: Union[str, nn.Module] = "resnet50",
        cifar_stem: bool = False,
        in_channels: int = 3,
        image_size: int = 224,
        width: float = 1.0,
        head: Literal["linear", "mlp", "bn_mlp"] = "mlp",
        dim: int = 128,
        hidden_dim: int = 2048,
        predictor_hidden_dim: int = 0,
        dictionary: Literal["queue", "batch", "memory_bank"] = "queue",
        queue_size: int = 65536,
        memory_bank_size: int = 0,
        momentum: float = 0.999,
        momentum_schedule: Literal["constant", "cosine"] = "constant",
        temperature: float = 0.2,
        symmetric: bool = False,
        scale_loss: bool = False,
        lr: float = 0.03,
        optimizer: Literal["sgd", "lars", "adamw"] = "sgd",
        weight_decay: float = 1e-4,
        sgd_momentum: float = 0.9,
        decay_norm_bias: bool = False,
        lr_schedule: Literal["cosine", "step", "constant"] = "cosine",
        lr_milestones: Sequence[int] = (120, 160),
        warmup_epochs: float = 0.0,
        shuffle_bn: Literal["auto", "ddp", "split", "off"] = "auto",
        bn_splits: int = 8,
        channels_last: bool = False,
        freeze_patch_embed: bool = False,
        on_nan: Literal["raise", "skip"] = "raise",
    ) -> None:
        super().__init__()
        _check_arguments(locals())
        self.save_hyperparameters(ignore=["backbone"] if isinstance(backbone, nn.Module) else None)
        # f_q: the query encoder, trained by backprop
        self.backbone, self.feature_dim = build_backbone(backbone, cifar_stem, in_channels, image_size, width)
        if freeze_patch_embed:
            _freeze_patch_embedding(self.backbone)
        self.projection_head = _projection_head(head, self.feature_dim, hidden_dim, dim)
        self.prediction_head = BYOLPredictionHead(dim, predictor_hidden_dim, dim) if predictor_hidden_dim else None
        # f_k: the key encoder, a copy of f_q moved only by the momentum update (the other dictionaries have none)
        has_key_encoder = dictionary == "queue"
        self.key_backbone = copy.deepcopy(self.backbone).requires_grad_(False) if has_key_encoder else None
        self.key_projection_head = copy.deepcopy(self.projection_head).requires_grad_(False) if has_key_encoder else None
        self.queue = KeyQueue(queue_size if dictionary == "queue" else 0, dim)
        self.memory_bank = MemoryBank(memory_bank_size, dim) if dictionary == "memory_bank" else None
        # Every rank writes the same gathered keys, so DDP need not broadcast the queue (or bank) on every forward
        # (32 MiB per step at K=65536); it is broadcast once at fit start instead.
        self._ddp_params_and_buffers_to_ignore = [
            f"{owner}.{name}" for owner in ("queue", "memory_bank") if getattr(self, owner) is not None
            for name, _ in getattr(self, owner).named_buffers()
        ]
        self._shuffle = "off"  # resolved from shuffle_bn in setup(), when the world size is known
        self._rng_to_restore: Optional[dict] = None
        self._keys: Optional[Tensor] = None  # this step's keys of all ranks, enqueued after the optimizer step
        self._index: Optional[Tensor] = None  # this step's image indices of all ranks (memory bank)
        self._stepped = 0  # global_step at the last momentum update
        self._equal_batches = False  # every rank's batch has the same size: gathers need not exchange sizes first
        self._nan_flag: Optional[tuple] = None  # the last step's "loss not finite" flag, read one step later

    # --- the two encoders -------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        """Backbone features of the query encoder: what evaluation and downstream use consume."""
        return self.backbone(self._layout(x))

    def query(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(features, q): backbone features and the L2-normalised query embedding (fp32)."""
        h = self.backbone(self._layout(x))
        z = self.projection_head(h)
        if self.prediction_head is not None:  # v3: the predictor is on the query side only
            z = self.prediction_head(z)
        return h, F.normalize(z.float(), dim=1)

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

    @property
    def _equal_sizes(self) -> bool:
        """Every rank's training batch has the same size (validation loaders may end unevenly: sizes exchanged)."""
        return self._equal_batches and self.training

    def _encode_key(self, x: Tensor) -> Tensor:
        return F.normalize(self.key_projection_head(self.key_backbone(x)).float(), dim=1)

    def _layout(self, x: Tensor) -> Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.hparams.channels_last and x.ndim == 4 else x

    def positives_and_negatives(self, x_k: Tensor, index: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """The positive keys of the batch and the negatives (None: the other keys of the global batch)."""
        if self.hparams.dictionary == "batch":  # end-to-end: the query encoder itself, with gradients
            return self.query(x_k)[1], None
        if self.hparams.dictionary == "memory_bank":  # InstDisc: the image's stored feature; negatives sampled
            if index is None:
                raise ConfigError("MoCo: dictionary='memory_bank' needs each image's index: batches (views, targets, index), "
                                 "as moco-lightning's datamodules give them")
            return self.memory_bank.positives(index), self.memory_bank.sample(self.hparams.queue_size)
        return self.key(x_k), (self.queue.keys if self.queue.size > 0 else None)

    def contrast(self, x_q: Tensor, x_k: Tensor, index: Optional[Tensor] = None) -> dict[str, Tensor]:
        """The InfoNCE loss of one step, without touching the dictionary or the key encoder's weights."""
        hp = self.hparams
        scale = 2 * hp.temperature if hp.scale_loss else 1.0
        x_q, x_k = self._layout(x_q), self._layout(x_k)  # once per view (a no-op afterwards), not per encoder call
        h, q = self.query(x_q)
        k, negatives = self.positives_and_negatives(x_k, index)
        loss, sims, labels = info_nce(q, k, negatives, hp.temperature, scale, self._equal_sizes)
        keys = k.detach()  # what the queue stores; the memory bank stores the image's query instead
        if hp.symmetric:
            if hp.dictionary == "batch":  # the second view's query is its key: nothing to recompute
                q2, k2 = k, q
            else:
                q2, (k2, negatives) = self.query(x_k)[1], self.positives_and_negatives(x_q, index)
            loss = loss + info_nce(q2, k2, negatives, hp.temperature, scale, self._equal_sizes)[0]
            keys = torch.cat([keys, k2.detach()])
        if hp.dictionary == "memory_bank":  # one row per image: with both views as queries, their mean
            keys = ((q + q2) / 2 if hp.symmetric else q).detach()
        return {"loss": loss, "features": h.detach(), "q": q.detach(), "k": k.detach(), "keys": keys,
                "sims": sims.detach(), "labels": labels}

    # --- training ---------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if stage != "fit":
            return
        if self.hparams.on_nan == "skip" and self.trainer.world_size > 1:
            raise ConfigError(
                f"MoCo: on_nan='skip' cannot be used with {self.trainer.world_size} processes: every rank must take "
                "the same optimizer steps (Lightning does not support skipping a batch under DDP); use on_nan='raise'"
            )
        if str(self.trainer.precision) in ("bf16-true", "16-true"):
            raise ConfigError(
                f"MoCo: precision={self.trainer.precision!r} stores the key encoder and the queue in half precision, "
                "where the momentum update's step (1 - m) * (θ_q - θ_k), 0.001 of the difference at m = 0.999, is "
                "below the format's resolution and the key encoder stops moving: use precision='bf16-mixed' (the "
                "weights, the queue and the logits stay fp32)"
            )
        mode, has_bn = self.hparams.shuffle_bn, any(isinstance(m, nn.BatchNorm2d) for m in self.backbone.modules())
        if mode == "auto":
            mode = "off" if not has_bn else "ddp" if self.trainer.world_size > 1 else "split"
        if mode == "ddp" and self.trainer.world_size == 1:
            raise ConfigError("MoCo: shuffle_bn='ddp' needs a distributed run (world size > 1); use 'split' or 'auto' on one device")
        if mode == "split":
            convert_split_bn(self.backbone, self.hparams.bn_splits)
            if self.key_backbone is not None:
                convert_split_bn(self.key_backbone, self.hparams.bn_splits)
        if mode != "off" and getattr(self.trainer.strategy, "_layer_sync", None) is not None:
            warnings.warn("MoCo: sync_batchnorm=True computes BN statistics over the global batch, which defeats "
                          f"shuffle_bn={mode!r} for MoCo v1/v2; turn one of them off", stacklevel=2)
        self._shuffle = mode
        if self.hparams.channels_last:
            self.to(memory_format=torch.channels_last)

    def teardown(self, stage: str) -> None:
        if stage == "fit" and self._shuffle == "split":  # split BN only while fitting: the user's BatchNorm2d again
            for encoder in (self.backbone, self.key_backbone):
                if encoder is not None:
                    revert_split_bn(encoder)
        self._shuffle = "off"

    def on_fit_start(self) -> None:
        if world_size() > 1:  # identical initial queue on every rank, even without a common seed
            for name in self._ddp_params_and_buffers_to_ignore:  # the dictionary's buffers, kept out of DDP's sync
                torch.distributed.broadcast(self.get_buffer(name), src=0)

    def training_step(self, batch: Any, batch_idx: int) -> Optional[dict[str, Tensor]]:
        self._raise_if_last_loss_was_not_finite()
        x_q, x_k = batch[0]
        index = batch[2] if len(batch) > 2 else None
        out = self.contrast(x_q, x_k, index)
        if self.hparams.on_nan == "skip":  # one process only; reading the loss synchronises with the device
            if not torch.isfinite(out["loss"]):
                warnings.warn(f"MoCo: loss is {out['loss'].item()} {self._where(batch_idx)}; batch skipped "
                              "(on_nan='skip')", stacklevel=2)
                return None
        else:
            self._flag_non_finite(out["loss"], batch_idx)
        # The keys (and bank indices) of all ranks are gathered here, where every rank runs the same code: the
        # momentum update and the enqueue after the optimizer step are then local, and so is a checkpoint save.
        gather = self.memory_bank is not None or self.queue.size > 0  # no queue (v3, end-to-end): nothing to store
        self._keys = concat_all_gather(out.pop("keys"), self._equal_sizes) if gather else None
        self._index = concat_all_gather(index, self._equal_sizes) if self.memory_bank is not None else None
        self._log_step("train", out, on_step=True, on_epoch=False)
        # Python floats would become a blocking host-to-device copy each step: logged from pinned memory instead
        self.log_dict({"train/momentum": self._scalar(self.momentum_at(self.global_step)),
                       "lr": self._scalar(self.trainer.optimizers[0].param_groups[0]["lr"])}, on_step=True, on_epoch=False)
        return {key: out[key] for key in ("loss", "features", "q", "k")}

    def _scalar(self, value: float) -> Tensor:
        t = torch.tensor(value, dtype=torch.float32, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    # --- non-finite losses: decided by all ranks together, read one step late ------------------
    def _flag_non_finite(self, loss: Tensor, batch_idx: int) -> None:
        """Records whether the loss of any rank is non-finite, without waiting for the device.

        The flag is all-reduced (max) so that every rank sees a NaN of any rank and all stop at the same step
        (a per-rank check stops one rank, and the others wait in the next collective until a timeout). It is
        copied to the host asynchronously and read at the start of the next step, when a checkpoint is about to
        be saved, or at the end of training: reading it now would stall the GPU once per step."""
        flag = (~torch.isfinite(loss.detach())).to(torch.int32).reshape(1)
        if world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        event = None
        if flag.is_cuda:
            host = torch.empty_like(flag, device="cpu").pin_memory()
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flag = host
        self._nan_flag = (flag, event, loss.detach(), self._where(batch_idx))

    def _raise_if_last_loss_was_not_finite(self) -> None:
        if self._nan_flag is None:
            return
        flag, event, loss, where = self._nan_flag
        self._nan_flag = None
        if event is not None:
            event.synchronize()
        if int(flag):
            local = f"this rank's loss is {loss.item()}" if torch.isfinite(loss) else f"loss is {loss.item()}"
            raise FloatingPointError(
                f"MoCo: {local} {where}" + (" (a non-finite loss on another rank)" if torch.isfinite(loss) else "")
                + f". Likely causes: a learning rate too high (lr={self.hparams.lr} per 256 images, now "
                f"{self.trainer.optimizers[0].param_groups[0]['lr']:.4g}), a temperature too low "
                f"(temperature={self.hparams.temperature}), or fp16 overflow (precision={self.trainer.precision!r}: try "
                "bf16-mixed or 32). Every rank stopped; no checkpoint was written with the weights of that step: "
                "resume from the last good checkpoint with a lower lr, or set on_nan='skip' (one process only)."
            )

    def _where(self, batch_idx: int) -> str:
        return f"at global step {self.global_step} (epoch {self.current_epoch}, batch {batch_idx})"

    def on_train_end(self) -> None:
        self._raise_if_last_loss_was_not_finite()

    def on_train_start(self) -> None:
        self._stepped = self.global_step
        # Lightning's DistributedSampler gives every rank the same number of samples, so every batch has the same
        # size on every rank; otherwise (a sampler of one's own, uneven shards) the gathers exchange sizes first.
        loader = self.trainer.train_dataloader
        self._equal_batches = isinstance(getattr(loader, "sampler", None), DistributedSampler) and (
            getattr(loader, "batch_size", None) is not None)
        if self.memory_bank is not None:  # checked once here: a per-step index check would stall an accelerator
            dataset = getattr(getattr(self.trainer, "train_dataloader", None), "dataset", None)
            try:
                n = len(dataset)
            except TypeError:  # no dataloader.dataset, or an iterable dataset: MemoryBank checks indices on the CPU
                n = 0
            if n > self.memory_bank.size:
                raise ConfigError(f"MoCo: memory_bank_size={self.memory_bank.size}, but the training set has {n} images; "
                                 f"set memory_bank_size to {n} (one bank row per training image)")
        if self._rng_to_restore is not None:  # resuming: this rank's global RNGs continue where they were saved
            ckpt.set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._finish_step()

    def _finish_step(self) -> None:
        """Momentum update (only if an optimizer step happened), then enqueue the step's keys of all ranks."""
        if self.global_step != self._stepped:  # an optimizer step happened (not an accumulation micro-batch)
            self._stepped = self.global_step
            if self.key_backbone is not None:
                self.momentum_update(self.momentum_at(self.global_step - 1))
        if self._keys is not None:  # the keys of all ranks (gathered in training_step)
            if self.memory_bank is not None:
                self.memory_bank.update(self._index, self._keys, self.hparams.momentum)
            else:
                self.queue.enqueue(self._keys, step=self.global_step)
            self._keys = self._index = None

    @torch.no_grad()
    def momentum_update(self, m: float) -> None:
        """θ_k ← m·θ_k + (1 − m)·θ_q over backbone and head, with foreach kernels."""
        theta_q = [*self.backbone.parameters(), *self.projection_head.parameters()]
        theta_k = [*self.key_backbone.parameters(), *self.key_projection_head.parameters()]
        torch._foreach_lerp_(theta_k, theta_q, 1.0 - m)  # θ_k + (1 − m)(θ_q − θ_k)

    def momentum_at(self, step: int) -> float:
        """m for the optimizer step with 0-based index ``step`` (MoCo v3: m = 1 − (1 − m₀)(1 + cos(π·step/total))/2)."""
        m0 = self.hparams.momentum
        if self.hparams.momentum_schedule == "constant":
            return m0
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ConfigError("momentum_schedule='cosine' needs a finite run: set trainer.max_epochs or trainer.max_steps")
        return _cosine(step, total, m0, 1.0)

    # --- checkpoints ------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Lightning runs the callbacks' on_train_batch_end (ModelCheckpoint's step-based saves) before the module's:
        # finish this step first, so that a checkpoint at step N holds N momentum updates and N steps' keys.
        # This step's update and keys are local by now (gathered in training_step): no collective here.
        self._raise_if_last_loss_was_not_finite()
        if self._keys is not None or (self._trainer is not None and self.trainer.training and self.global_step != self._stepped):
            self._finish_step()
            checkpoint["state_dict"].update({k: v for k, v in self.state_dict().items()
                                             if k.startswith(("key_", "queue.", "memory_bank."))})
        bad = [name for name, p in self.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise FloatingPointError(f"MoCo: refusing to write a checkpoint with non-finite weights in {bad[:5]}")
        checkpoint["moco_lightning"] = ckpt.metadata()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        meta = checkpoint.get("moco_lightning")
        ckpt.check_format(meta, "MoCo")
        ckpt.check_structure(checkpoint.get("hyper_parameters", {}), self.hparams, self.STRUCTURAL, "MoCo")
        self._rng_to_restore = ckpt.this_ranks_rng_states(meta)

    # --- validation / prediction: never enqueue, never move the key encoder -----------------
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not isinstance(batch[0], (list, tuple)) or self.hparams.dictionary == "memory_bank":
            return  # an evaluation batch (image, target), or no bank rows for validation images: nothing to do
        out = self.contrast(*batch[0])
        self._log_step("val", out, on_step=False, on_epoch=True, sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0] if isinstance(batch, (list, tuple)) else batch)

    def _log_step(self, stage: str, out: dict[str, Tensor], **kwargs: Any) -> None:
        sims, labels = out["sims"], out["labels"]
        pos = sims.gather(1, labels[:, None])
        top5 = sims.topk(min(5, sims.shape[1]), dim=1).indices
        # in the progress bar for validation only: a training-step tensor there is read on the host every step
        self.log(f"{stage}/loss", out["loss"], prog_bar=stage != "train", **kwargs)
        self.log_dict({
            f"{stage}/acc1": (top5[:, 0] == labels).float().mean(),
            f"{stage}/acc5": (top5 == labels[:, None]).any(1).float().mean(),
            f"{stage}/logit_pos": pos.mean(),
            f"{stage}/logit_neg": (sims.sum() - pos.sum()) / max(1, sims.numel() - pos.numel()),
        }, **kwargs)

    # --- optimizer --------------------------------------------------------------------------
    def configure_optimizers(self) -> dict:
        hp = self.hparams
        trained = [m for m in (self.backbone, self.projection_head, self.prediction_head) if m is not None]
        decay, no_decay = get_weight_decay_parameters(trained, decay_norm=hp.decay_norm_bias, decay_bias=hp.decay_norm_bias)
        total = self.trainer.estimated_stepping_batches
        if self.trainer.train_dataloader is None:  # max_steps alone does not load it; the lr scaling needs it
            self.trainer.fit_loop.setup_data()
        lr = hp.lr * self._global_batch_size() / 256
        per_device = self._global_batch_size() // (self.trainer.world_size * self.trainer.accumulate_grad_batches)
        if self._shuffle == "split" and per_device % hp.bn_splits:  # here, before any callback runs an evaluation
            raise ConfigError(
                f"MoCo: bn_splits={hp.bn_splits} does not divide the per-device batch of {per_device} images (the "
                f"training loader's batch_size, data.batch_size): split BatchNorm needs equal sub-batches; set "
                f"model.bn_splits to a divisor of {per_device}, or data.batch_size to a multiple of {hp.bn_splits}"
            )
        groups = [{"params": [p for p in decay if p.requires_grad], "weight_decay": hp.weight_decay},
                  {"params": [p for p in no_decay if p.requires_grad], "weight_decay": 0.0}]
        if hp.optimizer == "lars":  # lightly's update, host-sync free: no adaptation for the decay-free group, as v3
            optimizer = LARS(groups, lr=lr, momentum=hp.sgd_momentum)
        elif hp.optimizer == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=lr)
        else:
            optimizer = torch.optim.SGD(groups, lr=lr, momentum=hp.sgd_momentum)
        steps_per_epoch = max(1, math.ceil(self.trainer.num_training_batches / self.trainer.accumulate_grad_batches))
        warmup = round(hp.warmup_epochs * steps_per_epoch)
        milestones = [m * steps_per_epoch for m in hp.lr_milestones]
        if hp.lr_schedule == "cosine" and not math.isfinite(total):
            raise ConfigError("lr_schedule='cosine' needs a finite run: set trainer.max_epochs or trainer.max_steps")

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if hp.lr_schedule == "cosine":
                return _cosine(step - warmup, total - warmup, 1.0, 0.0)
            if hp.lr_schedule == "step":
                return 0.1 ** sum(step >= m for m in milestones)
            return 1.0

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _global_batch_size(self) -> int:
        loader = self.trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        if batch_size is None:
            raise ConfigError(
                "MoCo scales lr (given per 256 images) by the global batch size, but the training dataloader has no "
                "batch_size attribute; use a torch DataLoader with batch_size set"
            )
        return batch_size * self.trainer.world_size * self.trainer.accumulate_grad_batches


def _projection_head(head: str, feature_dim: int, hidden_dim: int, dim: int) -> nn.Module:
    if head == "linear":  # v1
        return ProjectionHead([(feature_dim, dim, None, None)])
    if head == "mlp":  # v2
        return MoCoProjectionHead(feature_dim, hidden_dim, dim)
    projector = MoCoProjectionHead(feature_dim, hidden_dim, dim, num_layers=3, batch_norm=True)  # v3
    projector.layers[-1] = nn.BatchNorm1d(dim, affine=False)  # as the official v3 code: the last BN has no affine
    return projector


def _freeze_patch_embedding(backbone: nn.Module) -> None:
    proj = getattr(backbone, "conv_proj", None)
    if not isinstance(proj, nn.Conv2d):
        raise ConfigError("MoCo: freeze_patch_embed=True needs a ViT backbone with a patch embedding 'conv_proj' "
                         "(torchvision's vit_* or moco_lightning.backbones.ViT)")
    proj.requires_grad_(False)


def _cosine(step: float, total: float, start: float, end: float) -> float:
    """Half a cosine from ``start`` (step 0) towards ``end`` (step ``total``)."""
    return end - (end - start) * (1 + math.cos(math.pi * min(step, total) / max(total, 1))) / 2


def _check_arguments(args: dict) -> None:
    """One clear error per bad argument, naming it and the allowed values."""
    rules = [
        ("queue_size", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (0: in-batch negatives)"),
        ("momentum", lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
        ("temperature", lambda v: v > 0, "a number > 0"),
        ("dim", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
        ("hidden_dim", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
        ("in_channels", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
        ("image_size", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
        ("width", lambda v: v > 0, "a number > 0"),
        ("head", lambda v: v in ("linear", "mlp", "bn_mlp"), "'linear' (v1), 'mlp' (v2) or 'bn_mlp' (v3)"),
        ("predictor_hidden_dim", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (0: no predictor)"),
        ("dictionary", lambda v: v in ("queue", "batch", "memory_bank"), "'queue', 'batch' or 'memory_bank'"),
        ("memory_bank_size", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
        ("optimizer", lambda v: v in ("sgd", "lars", "adamw"), "'sgd', 'lars' or 'adamw'"),
        ("momentum_schedule", lambda v: v in ("constant", "cosine"), "'constant' or 'cosine'"),
        ("lr_schedule", lambda v: v in ("cosine", "step", "constant"), "'cosine', 'step' or 'constant'"),
        ("lr", lambda v: v > 0, "a number > 0"),
        ("weight_decay", lambda v: v >= 0, "a number >= 0"),
        ("sgd_momentum", lambda v: 0 <= v < 1, "a number in [0, 1)"),
        ("warmup_epochs", lambda v: v >= 0, "a number >= 0"),
        ("lr_milestones", lambda v: all(isinstance(m, int) and m >= 0 for m in v), "a list of epoch numbers >= 0"),
        ("on_nan", lambda v: v in ("raise", "skip"), "'raise' or 'skip'"),
        ("shuffle_bn", lambda v: v in ("auto", "ddp", "split", "off"), "'auto', 'ddp', 'split' or 'off'"),
        ("bn_splits", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
        ("backbone", lambda v: isinstance(v, (str, nn.Module)), "a torchvision model name or an nn.Module"),
    ]
    for name, ok, allowed in rules:
        value = args[name]
        try:
            valid = ok(value)
        except TypeError:
            valid = False
        if not valid:
            raise ConfigError(f"MoCo: {name}={value!r} is not allowed; {name} must be {allowed}")
    if args["dictionary"] == "memory_bank" and (args["memory_bank_size"] < 1 or args["queue_size"] < 1):
        raise ConfigError("MoCo: dictionary='memory_bank' needs memory_bank_size = the number of training images and "
                         "queue_size >= 1 negatives sampled from the bank per step")
