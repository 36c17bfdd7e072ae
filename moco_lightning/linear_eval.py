"""Offline linear evaluation: a linear classifier trained on a frozen, pretrained backbone.

The protocol of MoCo (He et al., CVPR 2020, https://arxiv.org/abs/1911.05722, §4.1 "Linear
Classification Protocol"; MoCo v2, https://arxiv.org/abs/2003.04297): the backbone's weights are
frozen and it stays in eval mode (BatchNorm uses its running statistics), a fully connected layer
is trained with SGD, lr 30, momentum 0.9, weight decay 0, batch 256, for 100 epochs, the learning
rate multiplied by 0.1 at epochs 60 and 80; training images get a random resized crop and a flip,
validation images the evaluation transform (the datamodules' ``pretrain=False`` mode).

    python -m moco_lightning.linear_eval fit --config configs/linear_eval.yaml \\
        --model.ckpt_path runs/quickstart/version_0/checkpoints/last.ckpt
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from .backbones import build_backbone
from .errors import ConfigError, DataNotFoundError

__all__ = ["LinearClassifier", "load_backbone_weights", "main"]


def _read_checkpoint(path: str) -> Any:
    if not os.path.isfile(path):
        raise DataNotFoundError(
            f"checkpoint {path!r} not found: set model.ckpt_path (or model.backbone_state_dict) to a file written "
            "by pretraining, e.g. runs/<name>/version_0/checkpoints/<epoch=...>.ckpt"
        )
    return torch.load(path, map_location="cpu", weights_only=False)


def load_backbone_weights(backbone: nn.Module, path: str) -> None:
    """Loads into ``backbone`` the weights stored at ``path``: a Lightning checkpoint of MoCo (its
    ``backbone.*`` entries), or a plain state dict of the backbone (keys with or without ``backbone.``)."""
    obj = _read_checkpoint(path)
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else obj
    if not isinstance(state, dict):
        raise ConfigError(f"{path}: expected a state dict or a Lightning checkpoint, got {type(state).__name__}")
    prefixed = {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.")}
    backbone.load_state_dict(prefixed if prefixed else state, strict=True)


@contextlib.contextmanager
def _own_hyperparameters() -> Iterator[None]:
    """Lets a LightningModule built inside this one record its own hyper-parameters.

    While LightningCLI instantiates a module it hands that module's arguments to every
    ``save_hyperparameters()`` call through a context variable, so a MoCo rebuilt inside
    ``LinearClassifier.__init__`` would record the classifier's arguments instead of its own (and
    MoCo's checkpoint check then rejects the checkpoint). Cleared here for the nested construction.
    """
    try:
        from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
    except ImportError:  # a Lightning without the mechanism: nothing to clear
        yield
        return
    token = _given_hyperparameters.set(None)
    try:
        yield
    finally:
        _given_hyperparameters.reset(token)


class LinearClassifier(LightningModule):
    """A linear layer on a frozen backbone kept in eval mode, trained by the MoCo linear protocol.

    The backbone comes from one of:

    - ``ckpt_path`` alone: a MoCo checkpoint, via ``MoCo.load_from_checkpoint`` (its ``.backbone``
      and ``.feature_dim``). MoCo pretrained with a named (torchvision) backbone only.
    - ``backbone`` (an ``nn.Module``, or a torchvision / ``timm:`` name built with ``cifar_stem``,
      ``in_channels``, ``image_size`` and ``width`` as in MoCo) with, optionally, its weights from ``ckpt_path``
      (the ``backbone.*`` entries of a MoCo checkpoint: use this for MoCo pretrained with a module
      of your own) or from ``backbone_state_dict`` (a path to a state dict).

    Args:
        feature_dim: the backbone's output size (found by a dummy forward when None).
        num_classes: None: ``trainer.datamodule.num_classes`` (read in ``setup``).
        lr, momentum, weight_decay: SGD (the protocol: 30, 0.9, 0).
        schedule: ``"step"`` (×0.1 at each of ``milestones`` epochs: 60 and 80) or ``"cosine"``
            (to 0 over ``trainer.max_epochs``).

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
    ) -> None:
        super().__init__()
        if schedule not in ("step", "cosine"):
            raise ConfigError(f"schedule={schedule!r}: use 'step' (the paper's) or 'cosine'")
        if lr <= 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ConfigError(
                f"need lr > 0, weight_decay >= 0, 0 <= momentum < 1; got {lr}, {weight_decay}, {momentum}"
            )
        if ckpt_path is not None and backbone_state_dict is not None:
            raise ConfigError("give either ckpt_path or backbone_state_dict, not both")
        self.save_hyperparameters(ignore=["backbone"] if isinstance(backbone, nn.Module) else None)
        if backbone is None:
            if ckpt_path is None:
                raise ConfigError("LinearClassifier needs a backbone: pass ckpt_path (a MoCo checkpoint) or backbone")
            self.backbone, dim = self._from_moco_checkpoint(ckpt_path)
        else:
            if isinstance(backbone, nn.Module) and feature_dim is not None:
                self.backbone, dim = backbone, feature_dim
            else:
                self.backbone, dim = build_backbone(backbone, cifar_stem, in_channels, image_size, width)
            weights = ckpt_path if ckpt_path is not None else backbone_state_dict
            if weights is not None:
                load_backbone_weights(self.backbone, weights)
        self.feature_dim = int(feature_dim if feature_dim is not None else dim)
        self.backbone.requires_grad_(False)
        self.backbone.eval()
        self.head: Optional[nn.Linear] = None
        if num_classes is not None:
            self._build_head(num_classes)

    @staticmethod
    def _from_moco_checkpoint(path: str) -> tuple[nn.Module, int]:
        from .moco import MoCo

        _read_checkpoint(path)  # a clear error when the file is missing
        try:
            with _own_hyperparameters():
                # a checkpoint this library wrote (it holds the RNG states, numpy's included: not weights-only)
                moco = MoCo.load_from_checkpoint(path, map_location="cpu", weights_only=False)
        except (TypeError, RuntimeError) as e:  # MoCo saved with an nn.Module backbone: not in its hyper-parameters
            raise ConfigError(
                f"{path}: could not rebuild MoCo from its checkpoint ({e}). If it was pretrained with a backbone "
                "module of your own, pass that module as `backbone` together with `ckpt_path`"
            ) from e
        return moco.backbone, moco.feature_dim

    def _build_head(self, num_classes: int) -> None:
        self.hparams.num_classes = int(num_classes)  # so a checkpoint of this module rebuilds the head
        self.head = nn.Linear(self.feature_dim, num_classes)
        nn.init.normal_(self.head.weight, std=0.01)  # as MoCo's main_lincls.py
        nn.init.zeros_(self.head.bias)
        top5 = min(5, num_classes)
        self.train_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=top5, average="micro")

    def setup(self, stage: str) -> None:
        if self.head is None:
            n = getattr(getattr(self.trainer, "datamodule", None), "num_classes", None)
            if n is None:
                raise ConfigError("LinearClassifier: pass num_classes or use a datamodule with a num_classes attribute")
            self._build_head(n)

    # --- the frozen backbone stays in eval mode, whatever switches the module to train mode --
    def train(self, mode: bool = True) -> "LinearClassifier":
        super().train(mode)
        backbone = getattr(self, "backbone", None)
        if backbone is not None:
            backbone.eval()
        return self

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Lightning restores the modes it captured after each validation by setting `.training` directly
        # (not through train()); a user hook may call train(): enforce eval mode on every batch.
        self.backbone.eval()

    def forward(self, x: Tensor) -> Tensor:
        """Class logits."""
        with torch.no_grad():
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
        optimizer = torch.optim.SGD(
            self.head.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay
        )
        if hp.schedule == "cosine":
            epochs = self.trainer.max_epochs
            if epochs is None or epochs < 1:
                raise ConfigError("schedule='cosine' needs trainer.max_epochs")
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
        else:
            scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(hp.milestones), gamma=0.1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def main(args: Optional[list[str]] = None) -> None:
    """``python -m moco_lightning.linear_eval fit --config configs/linear_eval.yaml``"""
    from .cli import run_cli  # the library's CLI, which ends fit with the final metrics

    run_cli(LinearClassifier, args)


if __name__ == "__main__":
    main()
