"""What every pretraining module of this library shares, so that each method's own file holds only its algorithm.

:class:`Pretraining` owns the backbone (``forward(x)`` returns its features: the evaluation callbacks, linear
evaluation and export need nothing else), the optimizer and the lr schedule (lr given per 256 images), the NaN
guard (decided by all ranks together), and the checkpoint's metadata and compatibility checks. A method subclasses
it, builds its heads in ``__init__``, lists its trained modules in :meth:`trained_modules` and writes its
``training_step``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DistributedSampler

from . import checkpoint as ckpt
from . import optim
from .backbones import build_backbone
from .distributed import world_size
from .errors import ConfigError, check_arguments


class Pretraining(LightningModule):
    """Base of the pretraining modules.

    Args:
        backbone: torchvision model name, ``"timm:<name>"``, or an ``nn.Module`` returning features (N, D).
        cifar_stem: 3x3 stride-1 stem without max-pool for small images (ResNets).
        in_channels: image channels (1 for grayscale).
        image_size: input side, used only to find the feature size of models that need it.
        width: torchvision ResNets only: channel multiplier of every stage (0.5 halves ResNet-18's 64-512 channels).
        channels_last: keep the encoders and their inputs in channels-last memory format (faster convolutions on
            CPUs and tensor cores; measured +50 % for a narrow ResNet-18 on 2 CPU cores).
        lr: learning rate per 256 images; the optimizer uses lr × global batch / 256.
        optimizer: ``"sgd"``, ``"lars"`` (MoCo v3's rule: parameters with ndim <= 1, i.e. norms and biases, get no
            adaptation and no weight decay, whatever ``decay_norm_bias`` says) or ``"adamw"``.
        weight_decay, sgd_momentum: optimizer settings (``sgd_momentum`` for SGD and LARS).
        decay_norm_bias: SGD and AdamW: also decay norm and bias parameters (off here; ``MoCo`` turns it on, as the
            official v1/v2/v3 code decays every parameter).
        lr_schedule: ``"cosine"`` (v2), ``"step"`` (v1: ×0.1 at each of ``lr_milestones`` epochs) or ``"constant"``.
        warmup_epochs: linear warm-up length (may be fractional).
        on_nan: a non-finite loss ``"raise"``s (every rank stops before a checkpoint holds bad weights) or
            ``"skip"``s the batch with a warning (one process only: DDP ranks must step together).
        compile: compile the encoders and heads with ``torch.compile`` at fit start (``nn.Module.compile``: in place,
            the parameters, buffers and state-dict keys stay the module's own, so the momentum update, the queue
            and checkpoints are unchanged). ``compile_backend``: torch.compile's backend (``"inductor"``).
    """

    FORMAT_VERSION = ckpt.FORMAT_VERSION
    #: names of buffers (prefixes) that every rank updates alike: broadcast once at fit start, then kept out of DDP's
    #: per-forward broadcast from rank 0 (32 MiB per step for a queue of 65536 x 128)
    dictionary_buffers: tuple = ()
    #: settings that change the shape of the weights: a checkpoint must agree on them (subclasses add theirs)
    STRUCTURAL: tuple = ("backbone", "cifar_stem", "in_channels", "width")
    #: state-dict prefixes that :meth:`finish_step` changes (momentum copies, dictionaries)
    finished_state: tuple = ()

    def __init__(
        self,
        backbone: Union[str, nn.Module] = "resnet50",
        cifar_stem: bool = False,
        in_channels: int = 3,
        image_size: int = 224,
        width: float = 1.0,
        channels_last: bool = False,
        lr: float = 0.03,
        optimizer: Literal["sgd", "lars", "adamw"] = "sgd",
        weight_decay: float = 1e-4,
        sgd_momentum: float = 0.9,
        decay_norm_bias: bool = False,
        lr_schedule: Literal["cosine", "step", "constant"] = "cosine",
        lr_milestones: Sequence[int] = (120, 160),
        warmup_epochs: float = 0.0,
        on_nan: Literal["raise", "skip"] = "raise",
        compile: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        super().__init__()
        if not isinstance(backbone, (str, nn.Module)):
            raise ConfigError(
                f"{type(self).__name__}: backbone={backbone!r} is not allowed; backbone must be a "
                "torchvision model name, 'timm:<name>' or an nn.Module"
            )
        check_arguments(type(self).__name__, Pretraining.__init__, locals())
        # the hyper-parameters of the whole constructor chain (Lightning collects the subclasses' arguments too)
        self.save_hyperparameters(ignore=["backbone"] if isinstance(backbone, nn.Module) else None)
        self.backbone, self.feature_dim = build_backbone(backbone, cifar_stem, in_channels, image_size, width)
        self._rng_to_restore: Optional[dict] = None
        self._saved_plan: Optional[dict] = None  # the checkpoint's StepPlan, while resuming
        self.step_plan: Optional[optim.StepPlan] = None  # made by configure_optimizers
        self._equal_batches = False  # every rank's batch has the same size: gathers need not exchange sizes first
        self._nan_flag: Optional[tuple] = None  # the last step's "loss not finite" flag, read one step later
        self._stepped = 0  # global_step when optimizer_stepped() last said so

    def record_hyperparameters(self, args: dict) -> None:
        """A subclass's own arguments into ``hparams`` (``locals()`` of its ``__init__``, after ``super().__init__``).

        Lightning's CLI hands the constructor only what the config sets, so the values a subclass fixes for its
        base (``EndToEnd``: no queue) would be missing from ``hparams`` and from the checkpoint without this."""
        self.hparams.update({k: v for k, v in args.items() if k not in ("self", "kwargs", "__class__")})

    # --- features ---------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        """Backbone features: what evaluation and downstream use consume."""
        return self.backbone(self._layout(x))

    def _layout(self, x: Tensor) -> Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.hparams.channels_last and x.ndim == 4 else x

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0] if isinstance(batch, (list, tuple)) else batch)

    def trained_modules(self) -> list[nn.Module]:
        """The modules whose parameters the optimizer trains (a subclass adds its heads)."""
        return [self.backbone]

    def compiled_modules(self) -> list[nn.Module]:
        """What ``compile=True`` compiles: every child module with parameters (encoders, heads, momentum copies)."""
        return [m for m in self.children() if next(m.parameters(), None) is not None]

    # --- fit start / end --------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if stage == "fit" and self.hparams.on_nan == "skip" and self.trainer.world_size > 1:
            raise ConfigError(
                f"{type(self).__name__}: on_nan='skip' cannot be used with {self.trainer.world_size} processes: every "
                "rank must take the same optimizer steps (Lightning does not support skipping a batch under DDP); "
                "use on_nan='raise'"
            )
        if stage == "fit" and str(self.trainer.precision) in ("64-true", "64", "transformer-engine"):
            raise ConfigError(
                f"{type(self).__name__}: trainer.precision={self.trainer.precision!r} is not supported (the "
                "similarities, queue and losses are computed in fp32); use 32-true or bf16-mixed"
            )
        if stage == "fit" and self.hparams.channels_last:
            self.to(memory_format=torch.channels_last)
        if stage == "fit" and self.hparams.compile and not getattr(self, "_compiled", False):
            for module in self.compiled_modules():
                module.compile(backend=self.hparams.compile_backend)
            self._compiled = True

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        # DDP's name for what it must not broadcast from rank 0 on every forward; it has no public equivalent
        return [
            name
            for name, _ in self.named_buffers()
            if self.dictionary_buffers and name.startswith(self.dictionary_buffers)
        ]

    def on_fit_start(self) -> None:
        # The buffers kept out of DDP's per-forward broadcast (a dictionary every rank updates alike) start equal on
        # every rank, even without a common seed: broadcast once from rank 0.
        for name in getattr(self, "_ddp_params_and_buffers_to_ignore", []) if world_size() > 1 else ():
            dist.broadcast(self.get_buffer(name), src=0)

    def on_train_start(self) -> None:
        # Lightning's DistributedSampler gives every rank the same number of samples, so every batch has the same
        # size on every rank; otherwise (a sampler of one's own, uneven shards) the gathers exchange sizes first.
        loader = self.trainer.train_dataloader
        self._equal_batches = getattr(loader, "equal_batches", False) or (  # DALI loaders say so themselves
            isinstance(getattr(loader, "sampler", None), DistributedSampler)
            and getattr(loader, "batch_size", None) is not None
        )
        if self._rng_to_restore is not None:  # resuming: this rank's global RNGs continue where they were saved
            ckpt.set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None
        ckpt.load_pending_loader_states(self.trainer)  # the resumed epoch continues at its next batch
        if self._saved_plan is not None and self.trainer.ckpt_path:
            self._continue_the_plan()
        self._saved_plan = None
        self._stepped = self.global_step

    def optimizer_stepped(self) -> bool:
        """True once after each optimizer step (not after a gradient-accumulation micro-batch): for momentum updates."""
        stepped, self._stepped = self.global_step != self._stepped, self.global_step
        return stepped

    @property
    def _equal_sizes(self) -> bool:
        """Every rank's training batch has the same size (validation loaders may end unevenly: sizes exchanged)."""
        return self._equal_batches and self.training

    def on_train_end(self) -> None:
        self._raise_if_last_loss_was_not_finite()

    # --- after the optimizer step: momentum updates, dictionaries ------------------------------
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.finish_step()

    def finish_step(self) -> None:
        """What follows a training step (a momentum update after a real optimizer step, an enqueue); nothing here."""

    def step_pending(self) -> bool:
        """A training step whose :meth:`finish_step` has not run yet (an optimizer step not yet followed up)."""
        return self._trainer is not None and self.trainer.training and self.global_step != self._stepped

    # --- one step of a method that is its loss (SimCLR, BYOL, SwAV; MoCo writes its own) -------------
    def views_loss(self, views: Sequence[Tensor]) -> dict[str, Tensor]:
        """The method's ``loss`` of one batch of views ``[view_1, view_2, *local_views]`` and the first view's
        backbone ``features`` (for the callbacks)."""
        raise NotImplementedError(f"{type(self).__name__} writes its own training_step")

    def step_scalars(self) -> dict[str, float]:
        """What a step logs beside the loss and the lr (BYOL: its momentum)."""
        return {}

    def two_views(self, views: Sequence[Tensor]) -> Sequence[Tensor]:
        """The two global views, refusing local views that a two-view method would otherwise leave unused."""
        if len(views) > 2:
            raise ConfigError(
                f"{type(self).__name__} uses two views, but the batch has {len(views)}: set the datamodule's "
                "local_views to 0 (multi-crop is for MoCo and SwAV)"
            )
        return views

    def batch_views(self, batch: Any) -> tuple[list[Tensor], Optional[Tensor]]:
        """``(views, index)`` of a training batch ``([view_1, view_2, *local_views], target[, index])``.

        The views may also come stacked, one ``(N, V, C, H, W)`` tensor (``torch.stack([v1, v2])`` per item: a common
        dataset format), taken as V views; anything else is an error saying what a batch must look like (unpacking
        a stacked tensor along the batch dimension would train on garbage without a word)."""
        views = batch[0] if isinstance(batch, (list, tuple)) and batch else None
        if isinstance(views, Tensor) and views.ndim == 5:
            views = list(views.unbind(1))
        if not (isinstance(views, (list, tuple)) and len(views) >= 2 and all(isinstance(v, Tensor) for v in views)):
            raise ConfigError(
                f"{type(self).__name__}: a training batch must be ([view_1, view_2, ...], target[, index]): a list of "
                "two or more (N, C, H, W) view tensors, or one (N, V, C, H, W) tensor of stacked views; got "
                f"{describe_batch(batch)}. Use a two-view transform (lightly's MoCoV2Transform, or a moco_lightning "
                "datamodule)"
            )
        shapes = {tuple(v.shape[:2]) for v in views[:2]}
        if len(shapes) != 1 or views[0].ndim != 4:
            raise ConfigError(
                f"{type(self).__name__}: the two global views must be (N, C, H, W) tensors of the same N and C; got "
                f"{describe_batch(batch)}"
            )
        channels = self.hparams.get("in_channels")
        if isinstance(self.hparams.get("backbone"), str) and channels and views[0].shape[1] != channels:
            raise ConfigError(
                f"{type(self).__name__}: model.in_channels={channels}, but the views have {views[0].shape[1]} "
                f"channel(s) ({describe_batch(batch)}): set model.in_channels {views[0].shape[1]}"
            )
        index = batch[2] if len(batch) > 2 and isinstance(batch[2], Tensor) else None
        return list(views), index

    def training_step(self, batch: Any, batch_idx: int) -> Optional[dict[str, Tensor]]:
        out = self.views_loss(self.batch_views(batch)[0])
        if not self.loss_is_usable(out["loss"], batch_idx):
            return None
        self.log("train/loss", out["loss"], on_step=True, on_epoch=False)
        self.log_lr(**self.step_scalars())
        return out

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if is_views_batch(batch):  # not an evaluation batch (image, target)
            self.log("val/loss", self.views_loss(self.batch_views(batch)[0][:2])["loss"], prog_bar=True, sync_dist=True)

    # --- non-finite losses: decided by all ranks together, read one step late ------------------
    def loss_is_usable(self, loss: Tensor, batch_idx: int) -> bool:
        """False: skip this batch (``on_nan="skip"``, one process). Otherwise the check is collective and deferred:

        a "not finite" flag is all-reduced (max) so that every rank sees a NaN of any rank and all stop at the same
        step (a per-rank check stops one rank, and the others wait in the next collective until a timeout). It is
        copied to the host asynchronously and read at the start of the next step, before a checkpoint is saved,
        or at the end of training: reading it now would stall the GPU once per step."""
        self._raise_if_last_loss_was_not_finite()
        if self.hparams.on_nan == "skip":  # reading the loss synchronises with the device
            if torch.isfinite(loss):
                return True
            warnings.warn(
                f"{type(self).__name__}: loss is {loss.item()} {self._where(batch_idx)}; batch skipped (on_nan='skip')",
                stacklevel=2,
            )
            return False
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
        return True

    def _raise_if_last_loss_was_not_finite(self) -> None:
        if self._nan_flag is None:
            return
        flag, event, loss, where = self._nan_flag
        self._nan_flag = None
        if event is not None:
            event.synchronize()
        if int(flag):
            whose = "loss" if not torch.isfinite(loss) else "this rank's loss"
            raise FloatingPointError(
                f"{type(self).__name__}: {whose} is {loss.item()} {where}"
                + (" (a non-finite loss on another rank)" if torch.isfinite(loss) else "")
                + f". Likely causes: a learning rate too high (lr={self.hparams.lr} per 256 images, now "
                f"{self.trainer.optimizers[0].param_groups[0]['lr']:.4g}), a temperature too low (temperature="
                f"{self.hparams.get('temperature')}), or fp16 overflow (precision={self.trainer.precision!r}: try "
                "bf16-mixed or 32). Every rank stopped; no checkpoint was written with the weights of that step: "
                "resume from the last good checkpoint with a lower lr, or set on_nan='skip' (one process only)."
            )

    def _where(self, batch_idx: int) -> str:
        return f"at global step {self.global_step} (epoch {self.current_epoch}, batch {batch_idx})"

    def refuse_half_precision_weights(self, what: str) -> None:
        """For methods with a momentum (EMA) copy: half-precision weights would stop it from moving."""
        if str(self.trainer.precision) in ("bf16-true", "16-true"):
            raise ConfigError(
                f"{type(self).__name__}: precision={self.trainer.precision!r} stores {what} in half precision, where "
                "the momentum update's step (1 - m) * (θ_q - θ_k), 0.001 of the difference at m = 0.999, is below the "
                "format's resolution and the momentum copy stops moving: use precision='bf16-mixed' (the weights, "
                "the queue and the logits stay fp32)"
            )

    # --- logging ----------------------------------------------------------------------------
    def _scalar(self, value: float) -> Tensor:
        """A Python float for ``self.log``: from pinned memory, asynchronously (a float becomes a blocking copy)."""
        t = torch.tensor(value, dtype=torch.float32, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

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

    def log_lr(self, **extra: float) -> None:
        values = {"lr": self.trainer.optimizers[0].param_groups[0]["lr"], **extra}
        self.log_dict({k: self._scalar(v) for k, v in values.items()}, on_step=True, on_epoch=False)

    # --- optimizer --------------------------------------------------------------------------
    def configure_optimizers(self) -> dict:
        hp = self.hparams
        total = self.trainer.estimated_stepping_batches
        batch = self.global_batch_size()
        optimizer = optim.build_optimizer(
            hp.optimizer,
            self.trained_modules(),
            hp.lr * batch / 256,
            hp.weight_decay,
            hp.sgd_momentum,
            hp.decay_norm_bias,
        )
        spe = self.steps_per_epoch()
        # resuming (not a model loaded with load_from_checkpoint and trained anew): the schedule as the run that
        # wrote the checkpoint planned it
        saved = self._saved_plan if self.trainer.ckpt_path else None
        plan = (
            optim.StepPlan.from_state(saved)
            if saved
            else optim.StepPlan(total, round(hp.warmup_epochs * spe), [m * spe for m in hp.lr_milestones], batch)
        )
        self.step_plan = plan
        factor = optim.lr_factor(hp.lr_schedule, plan.warmup, plan.planned, plan.milestones)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor(plan.position(step)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def planned_step(self, step: int) -> tuple[float, float]:
        """``(position of step on the planned schedule, planned steps)``: what the momentum schedules follow."""
        if self.step_plan is None:  # before configure_optimizers
            return float(step), self.trainer.estimated_stepping_batches
        return self.step_plan.position(step), self.step_plan.planned

    def _continue_the_plan(self) -> None:
        """On resume (``on_train_start``, everything restored): a run given another length stretches the rest of its
        schedules (:class:`~moco_lightning.optim.StepPlan`); another global batch rescales the lr (given per 256
        images). Each with a warning that says what changed."""
        plan, trainer, step = self.step_plan, self.trainer, self.global_step
        total = self._steps_at_end()
        if math.isfinite(plan.planned) and total != plan.total and step < total:
            warnings.warn(
                f"the resumed run ends at step {total}, not {plan.total} as planned: the rest of the lr and momentum "
                f"schedules from step {step} is stretched over the {total - step} steps left (no restart, no jump)",
                stacklevel=2,
            )
            plan.replan(step, total)
        batch = self.global_batch_size()
        if batch != plan.global_batch:
            ratio = batch / plan.global_batch
            for config in trainer.lr_scheduler_configs:
                config.scheduler.base_lrs = [lr * ratio for lr in config.scheduler.base_lrs]
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= ratio
                    if "initial_lr" in group:
                        group["initial_lr"] *= ratio
            warnings.warn(
                f"the global batch is {batch}, the checkpoint's run used {plan.global_batch}: lr (given per 256 "
                f"images) is rescaled by {ratio:g} to {self.hparams.lr * batch / 256:g} at the peak",
                stacklevel=2,
            )
            plan.global_batch = batch

    def _steps_at_end(self) -> float:
        """The global step at which this (resumed) run will stop: max_steps, or the end of max_epochs from the
        position restored in the current epoch, whichever comes first."""
        trainer = self.trainer
        end = math.inf
        if trainer.max_epochs not in (None, -1) and math.isfinite(trainer.num_training_batches):
            batches = trainer.num_training_batches
            epoch, done = trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.ready
            if done >= batches:  # saved at the end of an epoch
                epoch, done = epoch + 1, 0
            end = self.global_step + ((trainer.max_epochs - epoch) * batches - done) // trainer.accumulate_grad_batches
        return min(end, trainer.max_steps) if trainer.max_steps != -1 else end

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (training batches over gradient accumulation), at least 1."""
        return max(1, math.ceil(self.trainer.num_training_batches / self.trainer.accumulate_grad_batches))

    def global_batch_size(self) -> int:
        """Per-device batch × devices × accumulation, from the training loader (loaded here when not yet)."""
        if self.trainer.train_dataloader is None:  # max_steps alone does not load it; the lr scaling needs it
            self.trainer.fit_loop.setup_data()
        loader = self.trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None) or getattr(
            getattr(loader, "batch_sampler", None), "batch_size", None
        )
        if batch_size is None:
            raise ConfigError(
                f"{type(self).__name__} scales lr (given per 256 images) by the global batch size, but the training "
                "dataloader has no batch_size attribute; use a torch DataLoader with batch_size set"
            )
        return batch_size * self.trainer.world_size * self.trainer.accumulate_grad_batches

    # --- checkpoints ------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self._raise_if_last_loss_was_not_finite()
        bad = [name for name, p in self.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise FloatingPointError(
                f"{type(self).__name__}: refusing to write a checkpoint with non-finite weights in {bad[:5]}"
            )
        checkpoint["moco_lightning"] = ckpt.metadata()
        if self.step_plan is not None:
            checkpoint["moco_lightning"]["step_plan"] = self.step_plan.state_dict()
        # Lightning runs the callbacks' on_train_batch_end (ModelCheckpoint's step-based saves) before the module's:
        # finish this step first, so that a checkpoint at step N holds N momentum updates (and N steps' keys).
        if self.finished_state and self.step_pending():
            self.finish_step()
            changed = {k: v for k, v in self.state_dict().items() if k.startswith(self.finished_state)}
            checkpoint["state_dict"].update(changed)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        meta = checkpoint.get("moco_lightning")
        ckpt.check_format(meta, type(self).__name__)
        ckpt.check_structure(checkpoint.get("hyper_parameters", {}), self.hparams, self.STRUCTURAL, type(self).__name__)
        self._rng_to_restore = ckpt.this_ranks_rng_states(meta)
        self._saved_plan = meta.get("step_plan")


def is_views_batch(batch: Any) -> bool:
    """A batch of views (a list of view tensors, or stacked (N, V, C, H, W)) rather than an evaluation batch."""
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else None
    return isinstance(first, (list, tuple)) or (isinstance(first, Tensor) and first.ndim == 5)


def describe_batch(batch: Any) -> str:
    """What a batch is, for error messages: its structure with tensor shapes."""

    def one(x: Any, depth: int = 0) -> str:
        if isinstance(x, Tensor):
            return f"Tensor{tuple(x.shape)}"
        if isinstance(x, dict):
            return "dict with keys " + str(list(x)[:5])
        if isinstance(x, (list, tuple)) and depth < 2:
            inner = ", ".join(one(v, depth + 1) for v in x[:4]) + (", ..." if len(x) > 4 else "")
            return f"{type(x).__name__}[{inner}]"
        return type(x).__name__

    return one(batch)
