"""Offline linear evaluation: a linear classifier trained on a frozen, pretrained backbone.

The protocol of MoCo (He et al., CVPR 2020, https://arxiv.org/abs/1911.05722, §4.1 "Linear
Classification Protocol"; MoCo v2, https://arxiv.org/abs/2003.04297): the backbone's weights are
frozen and it stays in eval mode (BatchNorm uses its running statistics), a fully connected layer
is trained with SGD, lr 30, momentum 0.9, weight decay 0, batch 256, for 100 epochs, the learning
rate multiplied by 0.1 at epochs 60 and 80; training images get a random resized crop and a flip,
validation images the evaluation transform (the datamodules' ``pretrain=False`` mode).

    python -m moco_lightning.linear_eval fit --config configs/linear_eval.yaml \\
        --model.ckpt_path runs/quickstart/version_0/checkpoints/last.ckpt

Low-label evaluation (SimCLR, Chen et al. 2020, §B.5 and Table 7: 1 % and 10 % of the labels): ``label_fraction``
(of each class) or ``labels_per_class`` restricts the training split to a seeded, class-stratified subset (its
indices are written to ``labelled_indices.txt`` in the run's folder and into every checkpoint); ``finetune: true``
trains the backbone too (its own ``backbone_lr``, BatchNorm in train mode, the datamodule's supervised views);
``from_scratch: true`` trains the same architecture from a random initialisation with the same recipe, the baseline a
pretrained encoder has to beat (``configs/low_label.yaml`` has the three side by side).
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from . import _lightning
from .backbones import build_backbone, warn_cifar_stem
from .checkpoint import SafeLoading
from .checkpoint_io import load_checkpoints_safely, read_checkpoint
from .errors import ConfigError
from .log_history import keep_history, read_csv_history

__all__ = ["LinearClassifier", "balanced_subset", "load_backbone_weights", "pretrained_backbone"]


def check_label_subset(fraction: Optional[float], per_class: Optional[int]) -> None:
    if (fraction is None) == (per_class is None):
        raise ConfigError("give exactly one of label_fraction (in (0, 1]) and labels_per_class (>= 1)")
    if fraction is not None and not 0 < fraction <= 1:
        raise ConfigError(f"label_fraction={fraction} is not allowed; label_fraction must be in (0, 1]")
    if per_class is not None and per_class < 1:
        raise ConfigError(f"labels_per_class={per_class} is not allowed; labels_per_class must be >= 1")


def balanced_subset(
    targets: Tensor, fraction: Optional[float] = None, per_class: Optional[int] = None, seed: int = 0
) -> Tensor:
    """Sorted indices of a seeded, class-stratified subset of ``targets`` (the semi-supervised protocol of SimCLR,
    Chen et al. 2020, §B.5: 1 % or 10 % of the labels, drawn per class): ``per_class`` images of every class, or
    ``fraction`` of each class (at least one). Targets < 0 (unlabelled) are never drawn."""
    check_label_subset(fraction, per_class)
    targets = torch.as_tensor(targets).long()
    g = torch.Generator().manual_seed(seed)
    chosen = []
    for c in torch.unique(targets[targets >= 0]).tolist():
        idx = (targets == c).nonzero().flatten()
        n = per_class if per_class is not None else max(1, round(fraction * len(idx)))
        if n > len(idx):
            raise ConfigError(f"labels_per_class={per_class}, but class {c} has only {len(idx)} training images")
        chosen.append(idx[torch.randperm(len(idx), generator=g)[:n]])
    return torch.cat(chosen).sort().values if chosen else torch.zeros(0, dtype=torch.long)


def _read_checkpoint(path: str) -> Any:
    """A checkpoint of pretraining or an export (weights only: :func:`moco_lightning.checkpoint_io.read_checkpoint`)."""
    return read_checkpoint(path, expect="either", arg="model.ckpt_path")


def load_backbone_weights(backbone: nn.Module, path: str) -> None:
    """Loads into ``backbone`` the weights stored at ``path``: a Lightning checkpoint of MoCo (its
    ``backbone.*`` entries), or a plain state dict of the backbone (keys with or without ``backbone.``)."""
    obj = _read_checkpoint(path)
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else obj
    if not isinstance(state, dict):
        raise ConfigError(f"{path}: expected a state dict or a Lightning checkpoint, got {type(state).__name__}")
    prefixed = {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.")}
    backbone.load_state_dict(prefixed if prefixed else state, strict=True)


def pretrained_backbone(path: str) -> tuple[nn.Module, int]:
    """``(backbone, feature_dim)`` of a checkpoint of any pretraining method (a named backbone) or of an export."""
    return LinearClassifier._from_checkpoint(path)


class LinearClassifier(SafeLoading, LightningModule):
    """A linear layer on a frozen backbone kept in eval mode, trained by the MoCo linear protocol.

    The backbone comes from one of:

    - ``ckpt_path`` alone: a checkpoint of any pretraining method here (MoCo, MoCo v3, SimCLR, BYOL, SwAV...) with
      a named backbone: the architecture from its hyper-parameters, the weights from its ``backbone.*``; or a file
      ``moco-lightning export`` wrote (it describes its architecture). ``backbone_state_dict`` alone: the same for
      an exported file.
    - ``backbone`` (an ``nn.Module``, or a torchvision / ``timm:`` name built with ``cifar_stem``,
      ``in_channels``, ``image_size`` and ``width`` as in MoCo) with, optionally, its weights from ``ckpt_path``
      (the ``backbone.*`` entries of a MoCo checkpoint: use this for MoCo pretrained with a module
      of your own) or from ``backbone_state_dict`` (a path to a state dict).

    Args:
        feature_dim: the backbone's output size (found by a dummy forward when None).
        num_classes: None: ``trainer.datamodule.num_classes`` (read in ``setup``).
        lr, momentum, weight_decay: SGD (the protocol: 30, 0.9, 0).
        schedule: ``"step"`` (×0.1 at each of ``milestones`` epochs: 60 and 80) or ``"cosine"``
            (to 0 over the run's optimizer steps, ``max_epochs`` or ``max_steps``; updated every step).

    Low labels and fine-tuning:

        label_fraction / labels_per_class: train on this fraction of each class / this many images per class of the
            datamodule's training split (seeded by ``label_seed``; the datamodule must offer ``train_targets()`` and
            ``select_train(indices)``, as every in-memory datamodule of this library does).
        finetune: train the backbone too, BatchNorm in train mode, at ``backbone_lr`` (None: ``lr``); the head at
            ``lr``; SGD with ``momentum`` and ``weight_decay`` for both. None: what ``from_scratch`` says.
        from_scratch: the same architecture (from the checkpoint's hyper-parameters, or ``backbone``), randomly
            initialised, the whole network trained at ``lr`` (implies ``finetune``; ``backbone_lr`` is for a
            pretrained backbone): the supervised baseline.

    Batches are ``(image, target[, index])``. Logs ``train/loss``, ``train/acc1``, ``val/loss``,
    ``val/acc1``, ``val/acc5`` (fractions in [0, 1]). Lightning's "Found N module(s) in eval mode at
    the start of training" warning is expected: those are the frozen backbone's modules.

    Reloading a checkpoint of this module with ``load_from_checkpoint`` rebuilds the backbone the same
    way (so ``ckpt_path``, if used, must still exist), then restores every weight from the checkpoint.
    """

    def __init__(
        self,
        ckpt_path: Optional[str] = None,
        backbone: Optional[Union[str, nn.Module]] = None,
        feature_dim: Optional[int] = None,
        backbone_state_dict: Optional[str] = None,
        num_classes: Optional[int] = None,
        lr: float = 30.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        schedule: Literal["step", "cosine"] = "step",
        milestones: Sequence[int] = (60, 80),
        cifar_stem: bool = False,
        in_channels: int = 3,
        image_size: int = 224,
        width: float = 1.0,
        label_fraction: Optional[float] = None,
        labels_per_class: Optional[int] = None,
        label_seed: int = 0,
        finetune: Optional[bool] = None,
        backbone_lr: Optional[float] = None,
        from_scratch: bool = False,
        stem: Optional[Literal["imagenet", "cifar", "cifar_stride2"]] = None,
    ) -> None:
        super().__init__()
        if from_scratch and finetune is False:
            raise ConfigError(
                "from_scratch=True trains the whole network from a random initialisation, finetune=False freezes the "
                "backbone: set finetune true (or leave it unset), or drop from_scratch"
            )
        if label_fraction is not None or labels_per_class is not None:
            check_label_subset(label_fraction, labels_per_class)
        if backbone_lr is not None and backbone_lr <= 0:
            raise ConfigError(f"backbone_lr={backbone_lr} is not allowed; backbone_lr must be > 0 (or None: lr)")
        if schedule not in ("step", "cosine"):
            raise ConfigError(f"schedule={schedule!r}: use 'step' (the paper's) or 'cosine'")
        if lr <= 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ConfigError(
                f"need lr > 0, weight_decay >= 0, 0 <= momentum < 1; got {lr}, {weight_decay}, {momentum}"
            )
        if ckpt_path is not None and backbone_state_dict is not None:
            raise ConfigError("give either ckpt_path or backbone_state_dict, not both")
        self.save_hyperparameters(ignore=["backbone"] if isinstance(backbone, nn.Module) else None)
        self.finetune = bool(finetune or from_scratch)
        self.hparams.finetune = self.finetune  # what this run does, in hparams.yaml and checkpoints
        if backbone_lr is not None and (from_scratch or not self.finetune):
            warnings.warn(
                f"backbone_lr={backbone_lr} is not used: "
                + (
                    f"from scratch the whole network trains at lr={lr} (backbone_lr is for a pretrained backbone)"
                    if from_scratch
                    else "finetune is false (the backbone is frozen)"
                ),
                stacklevel=2,
            )
        if backbone is None:
            source = ckpt_path if ckpt_path is not None else backbone_state_dict
            if source is None:
                raise ConfigError(
                    "LinearClassifier needs a backbone: set model.ckpt_path (a checkpoint of pretraining) or "
                    "model.backbone_state_dict (a file `moco-lightning export` wrote), or model.backbone"
                )
            build = self._architecture_of_checkpoint if from_scratch else self._from_checkpoint
            self.backbone, dim = build(source)
        else:
            if isinstance(backbone, nn.Module) and feature_dim is not None:
                self.backbone, dim = backbone, feature_dim
            else:
                warn_cifar_stem(cifar_stem, "LinearClassifier")
                self.backbone, dim = build_backbone(backbone, cifar_stem, in_channels, image_size, width, stem)
            weights = ckpt_path if ckpt_path is not None else backbone_state_dict
            if weights is not None and not from_scratch:
                load_backbone_weights(self.backbone, weights)
        self.feature_dim = int(feature_dim if feature_dim is not None else dim)
        self.backbone.requires_grad_(self.finetune)
        self.backbone.train(self.finetune)
        self.labelled_indices: Optional[Tensor] = None
        self._csv_history: list = []  # CSV loggers' rows of the run a checkpoint continues (prepare_data)
        self.head: Optional[nn.Linear] = None
        if num_classes is not None:
            self._build_head(num_classes)

    @staticmethod
    def _from_checkpoint(path: str) -> tuple[nn.Module, int]:
        """The pretrained backbone of a checkpoint of any pretraining method of this library (its architecture from the
        hyper-parameters, its weights from ``backbone.*``), or of a file ``moco-lightning export`` wrote."""
        from .export import checkpoint_backbone, describe, description, rebuild_export

        obj = _read_checkpoint(path)  # a clear error when the file is missing; read once
        if description(obj) is not None:
            return rebuild_export(obj, path)
        architecture = describe(obj.get("hyper_parameters") or {}) if isinstance(obj, dict) else None
        if architecture is None:
            raise ConfigError(
                f"{path}: the checkpoint does not name its backbone (pretrained with a backbone module of your own, or "
                "not a checkpoint of this library): pass that module as `backbone` together with `ckpt_path`"
            )
        backbone, dim = build_backbone(**architecture)
        backbone.load_state_dict(checkpoint_backbone(obj, path), strict=True)
        return backbone, dim

    @staticmethod
    def _architecture_of_checkpoint(path: str) -> tuple[nn.Module, int]:
        """The backbone a checkpoint (or an export) was pretrained with, rebuilt from its description, random
        weights."""
        from .export import describe, description

        obj = _read_checkpoint(path) if path else {}
        architecture = description(obj) or describe(obj.get("hyper_parameters") or {} if isinstance(obj, dict) else {})
        if architecture is None:
            raise ConfigError(
                f"{path}: from_scratch rebuilds the backbone from the checkpoint's hyper-parameters, but it names "
                "none (a backbone module of your own): pass that module as `backbone` instead"
            )
        return build_backbone(**architecture)

    def _build_head(self, num_classes: int) -> None:
        self.hparams.num_classes = int(num_classes)  # so a checkpoint of this module rebuilds the head
        self.head = nn.Linear(self.feature_dim, num_classes)
        nn.init.normal_(self.head.weight, std=0.01)  # as MoCo's main_lincls.py
        nn.init.zeros_(self.head.bias)
        top5 = min(5, num_classes)
        self.train_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=top5, average="micro")

    def prepare_data(self) -> None:
        self._csv_history = read_csv_history(self.trainer)  # a resumed run keeps them (on_load_checkpoint)

    def setup(self, stage: str) -> None:
        hp, dm = self.hparams, getattr(self.trainer, "datamodule", None)
        load_checkpoints_safely(self.trainer)
        self._check_data(dm)
        targets = self._check_classes(dm) if stage == "fit" else None
        if stage == "fit" and (hp.label_fraction is not None or hp.labels_per_class is not None):
            self._select_labels(targets)
        if self.head is None:
            n = getattr(dm, "num_classes", None)
            if n is None:
                raise ConfigError("LinearClassifier: pass num_classes or use a datamodule with a num_classes attribute")
            self._build_head(n)

    def _check_data(self, dm: Any) -> None:
        """The datamodule gives what a classifier of this backbone can learn: labelled single images of the
        backbone's channels, at least two classes, as many as the head has."""
        if dm is None:
            return
        if getattr(dm, "pretrain", False):
            raise ConfigError(
                "LinearClassifier trains on (image, target) batches, but the datamodule gives pretraining views "
                "(pretrain true): set data.init_args.pretrain false"
            )
        n = getattr(dm, "num_classes", None)
        if n is not None and n < 2:
            raise ConfigError(
                f"LinearClassifier: the datamodule has {n} class(es): a classifier needs at least 2 labelled classes "
                "(for an image folder: one subfolder of train/ and val/ per class)"
            )
        if n is not None and self.head is not None and self.head.out_features != n:
            raise ConfigError(
                f"LinearClassifier: model.num_classes={self.head.out_features}, but the datamodule has {n} classes: "
                f"set model.num_classes {n} (or leave it unset: read from the datamodule)"
            )
        first = next((m for m in self.backbone.modules() if isinstance(m, nn.Conv2d)), None)
        channels = getattr(dm, "in_channels", None)
        if first is not None and channels is not None and first.in_channels != channels:
            raise ConfigError(
                f"LinearClassifier: the backbone takes {first.in_channels}-channel images, the datamodule gives "
                f"{channels}-channel ones: set the datamodule's in_channels {first.in_channels} (grayscale: 1), or "
                "evaluate a backbone pretrained on such images"
            )

    def _check_classes(self, dm: Any) -> Optional[Tensor]:
        """Every class has training images (with or without a label subset): a classifier could never predict a
        class it never saw. Checked where the datamodule can say: returns its ``train_targets()``, or None."""
        if not hasattr(dm, "train_targets"):
            return None
        targets = torch.as_tensor(dm.train_targets()).long()
        classes = getattr(dm, "num_classes", None) or (self.head.out_features if self.head is not None else None)
        present = set(torch.unique(targets[targets >= 0]).tolist())
        missing = sorted(set(range(classes)) - present) if classes else []
        if missing:
            raise ConfigError(
                f"LinearClassifier: the training split holds {len(present)} of the {classes} classes (none of "
                f"{missing[:10]}{', ...' if len(missing) > 10 else ''}): the classifier could never predict those; "
                "train on a split with every class (a larger data.train_subset, or none)"
            )
        return targets

    def _select_labels(self, targets: Optional[Tensor]) -> None:
        """Restricts the datamodule's training split to the seeded, class-stratified label subset of ``targets`` (its
        ``train_targets()``; once per fit)."""
        hp, dm = self.hparams, getattr(self.trainer, "datamodule", None)
        if targets is None or not hasattr(dm, "select_train"):
            raise ConfigError(
                f"LinearClassifier: label_fraction/labels_per_class need a datamodule with train_targets() and "
                f"select_train(indices) (every in-memory datamodule of moco_lightning); {type(dm).__name__} has not"
            )
        self.labelled_indices = balanced_subset(targets, hp.label_fraction, hp.labels_per_class, hp.label_seed)
        dm.select_train(self.labelled_indices)
        log_dir = self.trainer.log_dir if self.trainer.logger is not None else None  # no logger: checkpoints only
        if log_dir and self.trainer.is_global_zero:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, "labelled_indices.txt"), "w") as f:
                f.write("\n".join(str(i) for i in self.labelled_indices.tolist()) + "\n")

    def on_train_start(self) -> None:
        _lightning.load_pending_loader_states(self.trainer)  # a resumed epoch continues at its next batch

    def on_train_end(self) -> None:
        _lightning.save_last_now(self.trainer)  # the run's last step in last.ckpt, whatever the saving interval

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.labelled_indices is not None:
            checkpoint["labelled_indices"] = self.labelled_indices.clone()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        _lightning.reopen_cut_epoch(checkpoint)  # a run stopped by max_steps mid-epoch continues that epoch
        if _lightning.attached_trainer(self) is not None:
            keep_history(self.trainer, self._csv_history, checkpoint.get("global_step", 0))
        self._csv_history = []

    # --- the frozen backbone stays in eval mode, whatever switches the module to train mode --
    def train(self, mode: bool = True) -> "LinearClassifier":
        super().train(mode)
        backbone = getattr(self, "backbone", None)
        if backbone is not None and not getattr(self, "finetune", False):
            backbone.eval()
        return self

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Lightning restores the modes it captured after each validation by setting `.training` directly
        # (not through train()); a user hook may call train(): enforce eval mode on every batch.
        if not self.finetune:
            self.backbone.eval()

    def forward(self, x: Tensor) -> Tensor:
        """Class logits."""
        with torch.set_grad_enabled(self.finetune and torch.is_grad_enabled()):
            features = self.backbone(x)
        return self.head(features.flatten(1).float())

    # --- steps --------------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch[0], batch[1]
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc1(logits, y)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        self.log("train/acc1", self.train_acc1, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch[0], batch[1]
        logits = self(x)
        self.val_acc1(logits, y)
        self.val_acc5(logits, y)
        self.log("val/loss", F.cross_entropy(logits, y), on_epoch=True, sync_dist=True)
        self.log("val/acc1", self.val_acc1, on_epoch=True, prog_bar=True)
        self.log("val/acc5", self.val_acc5, on_epoch=True)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0] if isinstance(batch, (list, tuple)) else batch)

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        groups = [{"params": list(self.head.parameters()), "lr": hp.lr}]
        if self.finetune:
            backbone_lr = hp.lr if hp.from_scratch else hp.backbone_lr or hp.lr
            groups.append({"params": list(self.backbone.parameters()), "lr": backbone_lr})
        optimizer = torch.optim.SGD(groups, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        if hp.schedule == "cosine":
            total = self.trainer.estimated_stepping_batches
            if not math.isfinite(total) or total < 1:
                raise ConfigError("schedule='cosine' needs a finite run: set trainer.max_epochs or trainer.max_steps")
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=int(total))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        else:
            scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(hp.milestones), gamma=0.1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


if __name__ == "__main__":  # python -m moco_lightning.linear_eval fit ...: the library's CLI over LinearClassifier
    from moco_lightning.cli.linear import main

    main()
