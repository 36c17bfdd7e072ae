"""Offline linear evaluation: a linear classifier trained on a frozen, pretrained backbone.

The protocol of MoCo (He et al., CVPR 2020, https://arxiv.org/abs/1911.05722, §4.1 "Linear
Classification Protocol"; MoCo v2, https://arxiv.org/abs/2003.04297): the backbone's weights are
frozen and it stays in eval mode (BatchNorm uses its running statistics), a fully connected layer
is trained with SGD, lr 30, momentum 0.9, weight decay 0, batch 256, for 100 epochs, the learning
rate multiplied by 0.1 at epochs 60 and 80; training images get a random resized crop and a flip,
validation images the evaluation transform (the datamodules' ``pretrain=False`` mode).

    moco-lightning linear fit --config configs/linear_eval.yaml \\
        --model.ckpt_path runs/quickstart/version_0/checkpoints/last.ckpt

Low-label evaluation (SimCLR, Chen et al. 2020, §B.5 and Table 7: 1 % and 10 % of the labels): ``label_fraction``
(of each class) or ``labels_per_class`` restricts the training split to a seeded, class-stratified subset (its
indices are written to ``labelled_indices.txt`` in the run's folder and into every checkpoint); ``finetune: true``
trains the backbone too (its own ``backbone_lr``, BatchNorm in train mode, the datamodule's supervised views);
``from_scratch: true`` trains the same architecture from a random initialisation with the same recipe, the baseline a
pretrained encoder has to beat (``configs/low_label.yaml`` has the three side by side).
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from moco_lightning import _lightning, run
from moco_lightning.datamodules.selection import (
    check_classification_data,
    check_label_subset,
    select_labels,
    training_targets,
)
from moco_lightning.downstream.encoder import ENCODER_KEY, Encoder, given_encoder
from moco_lightning.downstream.encoder_choice import choose_encoder, contradictions
from moco_lightning.errors import RANGES, ConfigError, check_arguments
from moco_lightning.modules.distributed import end_process_group_at_exit
from moco_lightning.training.checkpoint import SafeLoading

__all__ = ["LinearClassifier"]

#: the ranges of the classifier's arguments (``momentum`` is SGD's here, not a momentum copy's)
CLASSIFIER_RANGES = {
    **RANGES, "momentum": "[0, 1)", "label_fraction": "(0, 1]", "labels_per_class": "int >= 1", "backbone_lr": "> 0",
}  # fmt: skip


def check_combinations(args: dict) -> None:
    """The settings of :class:`LinearClassifier` that cannot go together (one line each), or go unused (a warning)."""
    if args["from_scratch"] and args["finetune"] is False:
        raise ConfigError(
            "from_scratch=True trains the whole network from a random initialisation, finetune=False freezes the "
            "backbone: set finetune true (or leave it unset), or drop from_scratch"
        )
    if args["label_fraction"] is not None or args["labels_per_class"] is not None:
        check_label_subset(args["label_fraction"], args["labels_per_class"])
    if args["ckpt_path"] is not None and args["backbone_state_dict"] is not None:
        raise ConfigError("give either ckpt_path or backbone_state_dict, not both")
    lr, backbone_lr = args["lr"], args["backbone_lr"]
    if backbone_lr is not None and (args["from_scratch"] or not args["finetune"]):
        why = (
            f"from scratch the whole network trains at lr={lr} (backbone_lr is for a pretrained backbone)"
            if args["from_scratch"]
            else "finetune is false (the backbone is frozen)"
        )
        warnings.warn(f"backbone_lr={backbone_lr} is not used: {why}", stacklevel=4)


class LinearClassifier(SafeLoading, LightningModule):
    """A linear layer on a frozen backbone kept in eval mode, trained by the MoCo linear protocol (module docstring).

    Args:
        ckpt_path / backbone_state_dict: the encoder of a checkpoint of any method or of an export
            (:func:`moco_lightning.downstream.encoder.load_encoder`); with ``backbone`` (a module, or a torchvision /
            ``timm:`` name built with ``stem``, ``in_channels``, ``image_size``, ``width``), that backbone's weights.
        feature_dim: the backbone's output size (None: found by a dummy forward). num_classes: None: the datamodule's.
        lr, momentum, weight_decay: SGD (30, 0.9, 0). schedule: ``"step"`` (×0.1 at ``milestones``) or ``"cosine"``.
        label_fraction / labels_per_class, label_seed: a low-label subset (:mod:`moco_lightning.datamodules.selection`).
        finetune: train the backbone too (BatchNorm in train mode) at ``backbone_lr`` (None: ``lr``).
        from_scratch: the same architecture randomly initialised, all of it at ``lr``: the supervised baseline.
        run_callbacks: bring the run's machinery (:data:`moco_lightning.run.CLASSIFIER`: safe checkpoint reads,
            preemption, exact resume, ``last.ckpt`` at the end) through ``configure_callbacks``; ``False``: a plain
            Lightning run.

    Logs ``train/loss``, ``train/acc1``, ``val/loss``, ``val/acc1``, ``val/acc5``. ``load_from_checkpoint`` rebuilds
    the backbone the same way (a ``ckpt_path`` must still exist), then restores the weights.
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
        run_callbacks: bool = True,
    ) -> None:
        super().__init__()
        check_arguments("LinearClassifier", LinearClassifier.__init__, locals(), CLASSIFIER_RANGES)
        check_combinations(locals())
        self.save_hyperparameters(ignore=["backbone"] if isinstance(backbone, nn.Module) else None)
        self.finetune = bool(finetune or from_scratch)
        _lightning.record_hyperparameters(self, finetune=self.finetune)  # what this run does
        source = ckpt_path if ckpt_path is not None else backbone_state_dict
        arg = "model.ckpt_path" if ckpt_path is not None else "model.backbone_state_dict"
        architecture = dict(cifar_stem=cifar_stem, in_channels=in_channels, image_size=image_size, width=width)
        self.backbone, dim, self.encoder_record = choose_encoder(
            backbone, source, arg, not from_scratch, feature_dim, stem=stem, **architecture
        )
        built = self.encoder_record["architecture"]
        if backbone is None:  # the file's encoder: a setting that says otherwise is refused, what was built recorded
            wrong = contradictions({**architecture, "stem": stem}, LINEAR_DEFAULTS, built)
            if wrong:
                raise ConfigError(
                    f"LinearClassifier: {', '.join(f'model.{w}' for w in wrong)}: {arg} builds its encoder as it was "
                    "pretrained; drop these settings (to train another architecture, set model.backbone too)"
                )
            _lightning.record_hyperparameters(self, **{k: v for k, v in built.items() if k in LINEAR_DEFAULTS})
        self.feature_dim = int(feature_dim if feature_dim is not None else dim)
        self.backbone.requires_grad_(self.finetune)
        self.backbone.train(self.finetune)
        self.labelled_indices: Optional[Tensor] = None
        self.head: Optional[nn.Linear] = None
        if num_classes is not None:
            self._build_head(num_classes)

    @classmethod
    def on_encoder(cls, encoder: Encoder, **settings: Any) -> "LinearClassifier":
        """A classifier on ``encoder``, read already (``ckpt_path`` records its file): ``evaluate`` reads the file
        once for every label budget, fine-tuned and from scratch."""
        with given_encoder(encoder):
            return cls(ckpt_path=encoder.source, **settings)

    def _build_head(self, num_classes: int) -> None:
        self.hparams.num_classes = int(num_classes)  # so a checkpoint of this module rebuilds the head
        self.head = nn.Linear(self.feature_dim, num_classes)
        nn.init.normal_(self.head.weight, std=0.01)  # as MoCo's main_lincls.py
        nn.init.zeros_(self.head.bias)
        self.train_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")

    def setup(self, stage: str) -> None:
        hp, dm = self.hparams, getattr(self.trainer, "datamodule", None)
        end_process_group_at_exit()
        classes = self.head.out_features if self.head is not None else None
        check_classification_data(dm, self.backbone, classes)
        trained, given = self.encoder_record["architecture"].get("image_size"), getattr(dm, "image_size", None)
        if trained and given and trained != given:
            warnings.warn(
                f"LinearClassifier: the encoder was pretrained on {trained} px images and the datamodule gives {given} "
                f"px: its features at another size are not the pretrained ones; set data.image_size to {trained} "
                "unless that is what you mean",
                stacklevel=2,
            )
        if stage == "fit":
            targets = training_targets(dm, classes)
            if hp.label_fraction is not None or hp.labels_per_class is not None:
                subset = (hp.label_fraction, hp.labels_per_class, hp.label_seed)
                self.labelled_indices = select_labels(dm, targets, *subset, self.trainer)
        if self.head is None:
            n = getattr(dm, "num_classes", None)
            if n is None:
                raise ConfigError("LinearClassifier: pass num_classes or use a datamodule with a num_classes attribute")
            self._build_head(n)

    def configure_callbacks(self) -> list:
        """The run's machinery (:data:`moco_lightning.run.CLASSIFIER`) unless ``run_callbacks=False``; a type the
        Trainer holds an instance of already (the user's own) is left out."""
        return run.missing(
            _lightning.attached_trainer(self), run.CLASSIFIER if self.hparams.get("run_callbacks", True) else ()
        )

    def unfreeze(self) -> None:
        """Lightning's ``unfreeze``, the frozen backbone of a linear evaluation kept frozen (``finetune=False``)."""
        super().unfreeze()
        self.backbone.requires_grad_(self.finetune)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.labelled_indices is not None:
            checkpoint["labelled_indices"] = self.labelled_indices.clone()
        if self.encoder_record["architecture"]:  # export / evaluate / embed then read its backbone
            checkpoint[ENCODER_KEY] = self.encoder_record

    # --- the frozen backbone stays in eval mode, whatever switches the module to train mode --
    def train(self, mode: bool = True) -> "LinearClassifier":
        super().train(mode)
        backbone = getattr(self, "backbone", None)
        if backbone is not None and not getattr(self, "finetune", False):
            backbone.eval()
        return self

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Lightning restores the modes it captured after validation by setting `.training` directly (not train())
        if not self.finetune:
            self.backbone.eval()

    def forward(self, x: Tensor) -> Tensor:
        """Class logits."""
        with torch.set_grad_enabled(self.finetune and torch.is_grad_enabled()):
            features = self.backbone(x)
        return self.head(features.flatten(1).float())

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        logits, y = self(batch[0]), batch[1]
        loss = F.cross_entropy(logits, y)
        self.train_acc1(logits, y)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        self.log("train/acc1", self.train_acc1, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        logits, y = self(batch[0]), batch[1]
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
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(hp.milestones), gamma=0.1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


#: the architecture settings' defaults: a value that differs was set by the user
LINEAR_DEFAULTS = {
    k: v.default
    for k, v in inspect.signature(LinearClassifier.__init__).parameters.items()
    if k in ("cifar_stem", "stem", "in_channels", "image_size", "width")
}
