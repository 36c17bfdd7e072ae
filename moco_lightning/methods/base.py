"""What every pretraining module of this library shares, so that each method's own file holds only its algorithm.

:class:`Pretraining` owns the backbone (``forward(x)`` returns its features: the evaluation callbacks, linear
evaluation and export need nothing else) and hands the optimizer and the schedules to
:mod:`moco_lightning.training.plan`. The run's machinery (the fit-start set-up, safe checkpoint reads, the NaN stop,
preemption, exact resume, the checkpoint's entry, ``last.ckpt``) are callbacks, :mod:`moco_lightning.run`, which
:meth:`Pretraining.configure_callbacks` brings: a subclass that overrides ``setup``, ``on_train_start``,
``on_save_checkpoint`` or ``on_train_end`` without ``super()`` loses none of it. What a fit's settings must agree on
is checked in one method, :meth:`Pretraining.check_fit`.

One step protocol for every method: :meth:`Pretraining.training_step` splits the batch into views and calls the
method's :meth:`~Pretraining.views_loss`, which returns the loss, the features for the callbacks, what it logs
beside the loss and what its dictionary keeps of the step; after the optimizer step (``on_train_batch_end``) the
optional momentum copy (:attr:`Pretraining.momentum_copy`: MoCo's key encoder, BYOL's target) moves and the optional
dictionary (:attr:`Pretraining.dictionary`: MoCo's queue, a memory bank) stores the keys of every rank (the one
module hook the design keeps; an override without ``super()`` is named at the next step). A method subclasses it,
builds its heads in ``__init__``, lists its trained modules in :meth:`trained_modules` and writes :meth:`views_loss`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from moco_lightning import _lightning, run
from moco_lightning.errors import ConfigError, check_arguments
from moco_lightning.modules.backbones import build_backbone, is_backbone_spec
from moco_lightning.modules.batches import is_views_batch, split_views
from moco_lightning.modules.dictionary import Negatives
from moco_lightning.modules.distributed import concat_all_gather, end_process_group_at_exit, equal_batches, world_size
from moco_lightning.modules.momentum import MomentumCopy
from moco_lightning.training import plan, run_state
from moco_lightning.training.checkpoint import SafeLoading
from moco_lightning.training.compat import warn_cifar_stem
from moco_lightning.training.nan_guard import NanGuard, likely_causes
from moco_lightning.training.preemption import Preemption


class Pretraining(SafeLoading, LightningModule):
    """Base of the pretraining modules.

    Args:
        backbone: torchvision model name, ``"timm:<name>"``, or an ``nn.Module`` returning features (N, D).
        stem: ResNets: ``"imagenet"`` (torchvision's), ``"cifar"`` (3x3 stride 1, no max-pool) or ``"cifar_stride2"``
            (3x3 stride 2, no max-pool: 14x14 maps at 28 px); :data:`moco_lightning.modules.backbones.STEMS`.
            ``cifar_stem``: its older spelling of ``"cifar"``, deprecated (a warning; removed in 0.4).
        in_channels: image channels (1 for grayscale).
        image_size: input side, used only to find the feature size of models that need it.
        width: torchvision ResNets only: channel multiplier of every stage (0.5 halves ResNet-18's 64-512 channels).
        channels_last: keep the encoders and their inputs in channels-last memory format (faster convolutions on
            CPUs and tensor cores: benchmarks/README.md).
        lr: learning rate per 256 images; the optimizer uses lr × global batch / 256.
        optimizer: ``"sgd"``, ``"lars"`` (MoCo v3's rule: parameters with ndim <= 1, i.e. norms and biases, get no
            adaptation and no weight decay, whatever ``decay_norm_bias`` says) or ``"adamw"``.
        weight_decay, sgd_momentum: optimizer settings (``sgd_momentum`` for SGD and LARS).
        decay_norm_bias: SGD and AdamW: also decay norm and bias parameters (off: SimCLR, BYOL, SwAV; the MoCo
            family turns it on, as the official v1/v2/v3 code decays every parameter).
        lr_schedule: ``"cosine"`` (v2), ``"step"`` (v1: ×0.1 at each of ``lr_milestones`` epochs) or ``"constant"``.
        warmup_epochs: linear warm-up length (may be fractional).
        on_nan: a non-finite loss ``"raise"``s (every rank stops before a checkpoint holds bad weights) or
            ``"skip"``s the batch with a warning (one process only: DDP ranks must step together).
        compile: compile the encoders and heads with ``torch.compile`` at fit start (``nn.Module.compile``: in place,
            the parameters, buffers and state-dict keys stay the module's own, so the momentum update, the queue
            and checkpoints are unchanged). ``compile_backend``: torch.compile's backend (``"inductor"``).
        run_callbacks: bring the run's machinery (:mod:`moco_lightning.run`: safe and checked checkpoint reads, the NaN
            stop, preemption, bit-equal resume, the checkpoint's entry, ``last.ckpt`` at the end) through
            ``configure_callbacks``; ``False``: a plain Lightning run (the method's own set-up, ``FitSetup``, stays).
    """

    #: settings that change the shape of the weights: a checkpoint must agree on them (subclasses add theirs)
    STRUCTURAL: tuple = ("backbone", "cifar_stem", "stem", "in_channels", "width")

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
        stem: Optional[Literal["imagenet", "cifar", "cifar_stride2"]] = None,
        run_callbacks: bool = True,
    ) -> None:
        super().__init__()
        check_arguments(type(self).__name__, Pretraining.__init__, locals())
        # the hyper-parameters of the whole constructor chain; a backbone module is recorded when the CLI built it
        # from a class_path (its spec rebuilds it), not when a Python caller passed one
        described = is_backbone_spec(_lightning.given_hyperparameters().get("backbone"))
        self.save_hyperparameters(ignore=["backbone"] if isinstance(backbone, nn.Module) and not described else None)
        warn_cifar_stem(cifar_stem, type(self).__name__)
        self.backbone, self.feature_dim = build_backbone(backbone, cifar_stem, in_channels, image_size, width, stem)
        self.nan_guard = NanGuard(on_nan, type(self).__name__)
        self.preemption = Preemption()  # SIGTERM / SIGINT / SLURM's requeue: a checkpoint at a step boundary
        self.step_plan: Optional[plan.StepPlan] = None  # made by configure_optimizers
        # set by a method that has them: moved / filled after each optimizer step (finish_step)
        self.momentum_copy: Optional[MomentumCopy] = None  # MoCo's key encoder, BYOL's target network
        self.dictionary: Optional[Negatives] = None  # where stored negatives live: MoCo's queue, a memory bank
        self._stored: tuple = ()  # what the dictionary keeps of this step (all ranks' rows), after the optimizer step
        self.resume_state: dict = {}  # what a checkpoint being restored holds for the run: RNG states, step plan
        self._prepared = False  # FitSetup prepared this fit (the first training step checks)
        self._unfinished = False  # a training step ran whose finish_step has not
        self._equal_batches = False  # every rank's batch has the same size: gathers need not exchange sizes first
        self._stepped = 0  # global_step at the last finish_step (another one: an optimizer step was taken)

    # --- features ---------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        """Backbone features: what evaluation and downstream use consume."""
        return self.backbone(self.in_layout(x))

    def in_layout(self, x: Tensor) -> Tensor:
        """``x`` in the encoders' memory format (channels-last with ``channels_last``)."""
        return x.contiguous(memory_format=torch.channels_last) if self.hparams.channels_last and x.ndim == 4 else x

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Backbone features of a batch of images (``images`` or ``(images, ...)``)."""
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        if not torch.is_floating_point(x):
            raise ConfigError(
                f"{type(self).__name__}.predict_step: the images are {x.dtype}, not normalised floats: a "
                "moco-lightning datamodule's training and validation loaders give raw uint8 images that it turns into "
                "views on the device; predict on its evaluation images, trainer.predict(model, datamodule=dm) or "
                "dataloaders=dm.eval_val_dataloader(), or on loaders of normalised float images"
            )
        return self(x)

    def unfreeze(self) -> None:
        """Every trained parameter trainable again; what the method keeps frozen (momentum copies, a frozen patch
        embedding) stays frozen (Lightning's ``unfreeze`` would make it trainable: DDP then stops on parameters
        without gradients, and the optimizer would decay them)."""
        super().unfreeze()
        for module in self.frozen_modules():
            module.requires_grad_(False)

    def frozen_modules(self) -> list[nn.Module]:
        """What is never trained by gradients: the momentum copies (a method adds its own)."""
        return [getattr(self, name) for name in self.momentum_copies().values()]

    def trained_modules(self) -> list[nn.Module]:
        """The modules whose parameters the optimizer trains (a subclass adds its heads)."""
        return [self.backbone]

    def compiled_modules(self) -> list[nn.Module]:
        """What ``compile=True`` compiles: every child module with parameters (encoders, heads, momentum copies)."""
        return [m for m in self.children() if next(m.parameters(), None) is not None]

    def attached_trainer(self) -> Any:
        """The Trainer running this module, or None (``self.trainer`` raises outside a fit)."""
        return _lightning.attached_trainer(self)

    def momentum_copies(self) -> dict[str, str]:
        """``{source child: its momentum copy}`` (MoCo's key encoder, BYOL's target), recorded in checkpoints."""
        return dict(self.momentum_copy.pairs) if self.momentum_copy is not None else {}

    def dictionary_buffers(self) -> list[str]:
        """State-dict names of the buffers every rank updates alike (a queue, a memory bank): kept out of DDP's
        per-forward broadcast from rank 0, broadcast once at fit start."""
        buffers = self.dictionary.named_buffers() if self.dictionary is not None else ()
        return [f"dictionary.{name}" for name, _ in buffers]

    # --- the run around the algorithm -----------------------------------------------------------
    def configure_callbacks(self) -> list:
        """The run's machinery (:mod:`moco_lightning.run`): :class:`~moco_lightning.run.FitSetup` always, the rest
        unless ``run_callbacks=False``; a type the Trainer holds an instance of already (the user's own) is left out.
        A subclass that adds callbacks returns ``[*super().configure_callbacks(), *its_own]``."""
        kinds = (run.FitSetup, *(run.PRETRAINING if self.hparams.get("run_callbacks", True) else ()))
        return run.missing(self.attached_trainer(), kinds)

    def prepare_run(self, stage: str) -> None:
        """:class:`~moco_lightning.run.FitSetup`'s ``setup``: for any stage, the buffers DDP must not re-broadcast and
        the process group's end at exit; for a fit, the fit-start checks (:meth:`check_fit`: before a checkpoint is
        restored, a callback evaluates or a step runs), channels-last and compile. A method adds its own set-up
        (MoCo's shuffle BN) after ``super()``'s."""
        end_process_group_at_exit()
        _lightning.keep_out_of_ddp_broadcast(self, self.dictionary_buffers())
        if stage != "fit":
            return
        self.check_fit()
        plan.redirect_lr_finder(self)
        if self.hparams.channels_last:
            self.to(memory_format=torch.channels_last)
        if self.hparams.compile and not getattr(self, "_compiled", False):
            for module in self.compiled_modules():
                module.compile(backend=self.hparams.compile_backend)
            self._compiled = True
        self._prepared, self._unfinished = True, False

    def end_run(self, stage: str) -> None:
        """:class:`~moco_lightning.run.FitSetup`'s ``teardown``: what :meth:`prepare_run` set up for a fit undone
        where it must be (a method's own)."""
        if stage == "fit":
            self._prepared = False

    def check_fit(self) -> None:
        """The fit-start checks: what the trainer, the data and the settings must agree on. A method adds its own
        after ``super()``'s."""
        self.nan_guard.check_trainer(self.trainer)
        if self.momentum_copy is not None:
            self.momentum_copy.refuse_half_precision(self)
        plan.check_batch_size(self)  # loads the training data
        plan.check_accumulation(self)

    def sync_dictionary(self) -> None:
        """At fit start (:class:`~moco_lightning.run.FitSetup`): the dictionary's buffers equal on every rank, without a
        seed."""
        for name in self.dictionary_buffers() if world_size() > 1 else ():
            dist.broadcast(self.get_buffer(name), src=0)

    def begin_training(self) -> None:
        """At ``on_train_start`` (:class:`~moco_lightning.run.FitSetup`): what the steps need of the loader and the
        restored step."""
        self._equal_batches = equal_batches(self.trainer.train_dataloader)
        self._stepped = self.global_step

    def check_checkpoint(self, checkpoint: dict, resuming: bool = False) -> None:
        """A checkpoint read for this module, before its weights meet it
        (:func:`~moco_lightning.training.run_state.check_checkpoint`)."""
        run_state.check_checkpoint(self, checkpoint, resuming)

    def check_step_finished(self) -> None:
        """The hooks a step relies on ran: :class:`~moco_lightning.run.FitSetup` before the first step, the module's
        ``on_train_batch_end`` after each; else one line naming the hook (at the next step and at the end of
        training: two flags, no read of the device)."""
        if (not self._prepared and self.attached_trainer() is not None) or self._unfinished:
            hook = "on_train_batch_end" if self._prepared else "configure_callbacks"
            raise ConfigError(run.hook_not_run(type(self).__name__, hook))

    @property
    def _equal_sizes(self) -> bool:
        """Every rank's training batch has the same size (validation loaders may end unevenly: sizes exchanged)."""
        return self._equal_batches and self.training

    # --- a step ---------------------------------------------------------------------------------
    #: False: the pretext loss means nothing on held-out images (MemoryBankMoCo: they have no row in the bank);
    #: validation then runs the callbacks only
    validation_loss = True

    def split_batch(self, batch: Any) -> tuple[list[Tensor], Optional[Tensor]]:
        """``(views, index)`` of a training batch (:func:`moco_lightning.modules.batches.split_views`)."""
        named = isinstance(self.hparams.get("backbone"), str)
        return split_views(batch, type(self).__name__, self.hparams.get("in_channels") if named else None)

    def views_loss(self, views: Sequence[Tensor], index: Optional[Tensor] = None) -> dict[str, Any]:
        """The method's step on one batch of views ``[view_1, view_2, *local_views]`` (``index``: the images' dataset
        indices, when the batch has them), without touching the momentum copy or the dictionary:

        - ``loss``; ``features``: the first view's backbone features (for the callbacks);
        - optionally ``metrics``: what it logs beside the loss (``{"acc1": ...}``, logged as ``train/acc1``);
          ``q``, ``k``: the embeddings the diagnostics read; ``stored``: the rows its :attr:`dictionary` keeps of
          the step (gathered from every rank, stored after the optimizer step)."""
        raise NotImplementedError(f"{type(self).__name__}.views_loss")

    def training_step(self, batch: Any, batch_idx: int) -> Optional[dict[str, Tensor]]:
        self.check_step_finished()
        views, index = self.split_batch(batch)
        out = self.views_loss(views, index)
        if self.hparams.on_nan == "skip" and not self.loss_is_usable(out["loss"], batch_idx, views):
            return None  # (on_nan="raise": NanStop records the loss's flag after the step, on the device)
        # What the dictionary keeps is gathered from all ranks here, where every rank runs the same code: the
        # momentum update and the store after the optimizer step are then local, and so is a checkpoint save.
        stored = out.pop("stored", ())
        if self.trainer.world_size > 1:
            stored = tuple(concat_all_gather(rows, self._equal_batches) for rows in stored)
        self._stored = stored
        self._unfinished = self.momentum_copy is not None or bool(self._stored)  # finish_step's work is due
        self.log_step("train", out, on_step=True, on_epoch=False)
        return {key: out[key] for key in ("loss", "features", "q", "k") if key in out}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """The pretext loss on held-out views: never stores keys, never moves a momentum copy."""
        if self.validation_loss and is_views_batch(batch):  # not an evaluation batch (image, target)
            out = self.views_loss(self.split_batch(batch)[0][:2])
            self.log_step("val", out, on_step=False, on_epoch=True, sync_dist=True)

    def log_step(self, stage: str, out: dict, **kwargs: Any) -> None:
        """``<stage>/loss`` and the method's ``metrics``; a training step also the lr and the momentum of the update
        that follows it. In the progress bar for validation only (a training-step tensor there is read on the host
        every step); the training scalars from pinned memory, asynchronously (a Python float given to ``self.log``
        becomes a blocking copy)."""
        self.log(f"{stage}/loss", out["loss"], prog_bar=stage != "train", **kwargs)
        metrics = {f"{stage}/{name}": value for name, value in out.get("metrics", {}).items()}
        if stage == "train":
            scalars = {"lr": self.trainer.optimizers[0].param_groups[0]["lr"]}
            if self.momentum_copy is not None:
                scalars["train/momentum"] = self.momentum_copy.at(self, self.global_step + 1)
            pinned = self.device.type == "cuda"
            for name, value in scalars.items():
                metrics[name] = torch.tensor(value, dtype=torch.float32, pin_memory=pinned).to(
                    self.device, non_blocking=True
                )
        if metrics:
            self.log_dict(metrics, **kwargs)

    def loss_is_usable(self, loss: Tensor, batch_idx: int, views: Sequence[Tensor] = ()) -> bool:
        """``on_nan="skip"``: False skips this batch (the loss read on the host, with a warning)."""
        where = f"at global step {self.global_step} (epoch {self.current_epoch}, batch {batch_idx})"
        return self.nan_guard.usable(loss, where, views)

    def nan_hints(self) -> str:
        """The likely causes of a non-finite loss, named in the guard's error."""
        return likely_causes(self.trainer, self.hparams.lr)

    # --- after the optimizer step: momentum updates, dictionaries ------------------------------
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After the optimizer step: :meth:`finish_step` (the design's one essential module hook; an override without
        ``super()`` is named at the next step)."""
        self.finish_step()

    def finish_step(self) -> None:
        """What follows a training step: the momentum update with m(j) of the j-th optimizer step (only after a real
        optimizer step, not a gradient-accumulation micro-batch), then the dictionary keeps the step's rows of every
        rank. Idempotent."""
        stepped, self._stepped = self.global_step != self._stepped, self.global_step
        if self.momentum_copy is not None and stepped:
            self.momentum_copy.update(self, self.momentum_copy.at(self, self.global_step))
        if self._stored:
            self.dictionary.store(*self._stored, step=self.global_step)
            self._stored = ()
        self._unfinished = False

    # --- optimizer and schedules ----------------------------------------------------------------
    def configure_optimizers(self) -> dict:
        # resuming (not a model loaded with load_from_checkpoint and trained anew): the plan the run was written with
        resuming = self.trainer.ckpt_path and not _lightning.restoring_tuner_checkpoint(self.trainer)
        config, self.step_plan = plan.configure_optimizers(self, self.resume_state.get("plan") if resuming else None)
        return config

    @property
    def optimizer_lr(self) -> float:
        """The optimizer's peak lr, ``lr`` × global batch / 256 (``lr`` is per 256 images); setting it sets ``lr``:
        ``Tuner.lr_find(update_attr=True)`` writes its suggestion here (:func:`~moco_lightning.training.plan.
        redirect_lr_finder`), so the fit trains at the suggested lr."""
        return self.hparams.lr * plan.global_batch_size(self) / 256

    @optimizer_lr.setter
    def optimizer_lr(self, value: float) -> None:
        _lightning.record_hyperparameters(self, lr=float(value) * 256 / plan.global_batch_size(self))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The checkpoint's entry where :class:`~moco_lightning.run.CheckpointEntry` did not write it (a weights-only
        save, which runs no callback's hook; a save outside a fit): a fallback, not needed by a subclass's override."""
        if "moco_lightning" not in checkpoint:
            run_state.save_state(self, checkpoint)
