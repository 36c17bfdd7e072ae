"""An online linear probe: a linear classifier trained on detached features during pretraining.

The linear classification protocol (a linear classifier on frozen features) is the standard
measure of a self-supervised representation: Zhang, Isola, Efros, "Colorful Image Colorization",
ECCV 2016, https://arxiv.org/abs/1603.08511, and the MoCo papers (He et al. 2020, §4.1). Training
the classifier *online*, on each pretraining batch's detached features, gives a cheap running
estimate of it; solo-learn and lightly do the same (``OnlineLinearClassifier``).

The probe owns its weights and optimizer (both saved in the callback state, so a resumed run
continues where it stopped). Gradients never reach the backbone (features are detached) and, when
the probe has to run the module itself, it does so in eval mode under ``no_grad``, so neither the
backbone's parameters nor its BatchNorm statistics change.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from moco_lightning.data_contract import Classes
from moco_lightning.downstream.probe import probe_accuracy
from moco_lightning.errors import ConfigError
from moco_lightning.modules.batches import describe_batch

from ._utils import (
    LoaderLike,
    eval_mode,
    first_view,
    forward_context,
    rank,
    resolve_loader,
    resolve_num_classes,
    shard,
    world_size,
)

__all__ = ["LinearProbe", "probe_accuracy"]


class LinearProbe(Callback):
    """Trains ``nn.Linear(D, num_classes)`` on detached features of every training batch.

    Features: ``outputs["features"]`` when ``training_step`` returns a dict holding them (MoCo:
    the backbone features of the first view), else ``pl_module(x)`` run in eval mode under
    ``no_grad`` on the first view ``batch[0][0]`` (or ``batch[0]`` when it is a single tensor).
    Labels: ``batch[1]``.

    Logs ``train/probe_acc1`` and ``train/probe_loss`` every step (subject to the trainer's
    ``log_every_n_steps``) and, at the end of every ``every_n_epochs``-th training epoch,
    ``val/probe_acc1`` (plus ``val/probe_acc5`` when there are more than 5 classes) on
    ``trainer.datamodule.eval_val_dataloader()`` (at train-epoch end rather than validation end, so
    that it runs whether or not the trainer has a validation loop, at the same step as the kNN). Accuracies are
    fractions in [0, 1]. Under DDP
    the probe's gradients are averaged over ranks (all ranks keep the same weights) and the
    validation counts are summed over ranks.

    Args:
        num_classes: None: ``trainer.datamodule.num_classes``.
        lr, momentum, weight_decay: the probe's SGD optimizer.
        every_n_epochs: validation frequency (0: never).
        val_dataloader: a loader (or a callable returning one) instead of ``eval_val_dataloader()``.
        seed: the probe's weights are initialised from this seed (the global RNG is left alone).
    """

    def __init__(
        self,
        num_classes: Optional[int] = None,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        every_n_epochs: int = 1,
        val_dataloader: Optional[LoaderLike] = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0 or every_n_epochs < 0:
            raise ConfigError(
                f"LinearProbe needs lr > 0, 0 <= momentum < 1, weight_decay >= 0, every_n_epochs >= 0; "
                f"got {lr}, {momentum}, {weight_decay}, {every_n_epochs}"
            )
        self.num_classes, self.lr, self.momentum, self.weight_decay = num_classes, lr, momentum, weight_decay
        self.every_n_epochs, self.val_dataloader, self.seed = every_n_epochs, val_dataloader, seed
        self.classifier: Optional[nn.Linear] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None

    # --- the probe itself ---------------------------------------------------------------------
    def _build(self, feature_dim: int, device: torch.device, state: Optional[dict] = None) -> None:
        if self.num_classes is None:
            raise ConfigError("LinearProbe: num_classes is unknown; pass it or use a datamodule with num_classes")
        with torch.random.fork_rng(devices=[]):  # same init on every rank, global RNG untouched
            torch.manual_seed(self.seed)
            self.classifier = nn.Linear(feature_dim, self.num_classes)
        self.classifier.to(device)
        self.optimizer = torch.optim.SGD(
            self.classifier.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        if state is not None:
            self.classifier.load_state_dict(state["classifier"])
            self.optimizer.load_state_dict(state["optimizer"])

    def _ensure(self, feature_dim: int, device: torch.device) -> nn.Linear:
        if self.classifier is None:
            self._build(feature_dim, device)
        elif self.classifier.weight.device != device:
            self.classifier.to(device)
            # move the momentum buffers along
            self.optimizer.load_state_dict(self.optimizer.state_dict())
        return self.classifier

    @property
    def data_contract(self) -> tuple:
        """What it reads of the trainer's datamodule (checked at fit start): the number of classes unless given (its
        held-out loader is asked for at its first evaluation)."""
        return (Classes,) if self.num_classes is None else ()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.num_classes = resolve_num_classes(self.num_classes, trainer)

    # --- training -----------------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        y = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else None
        if not isinstance(y, Tensor) or y.ndim != 1:
            raise ConfigError(
                "LinearProbe trains on the training batches' labels: batches must be ([view_1, view_2], target, ...) "
                f"with target a (N,) tensor of class indices (-1: unlabelled); got {describe_batch(batch)}. Remove "
                "the LinearProbe callback for unlabelled data"
            )
        features = outputs.get("features") if isinstance(outputs, dict) else None
        if features is None or features.shape[0] != y.shape[0]:
            features = self._features(trainer, pl_module, first_view(batch[0]))
        probe = self._ensure(features.shape[1], features.device)
        # Unlabelled images (target -1, e.g. STL-10's unlabelled split) are ignored by the loss and the accuracy:
        # masking them out by indexing would synchronise with the device, a -1 class index would assert on a GPU.
        labelled = y >= 0
        with torch.enable_grad():
            logits = probe(features.detach().float().flatten(1))
            loss = F.cross_entropy(logits, y, ignore_index=-1) if y.numel() else logits.sum() * 0
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if world_size() > 1:  # keep the probes identical on every rank: one all-reduce for all the gradients
                grads = [p.grad for p in probe.parameters()]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                for g, mean in zip(grads, flat.div_(world_size()).split([g.numel() for g in grads])):
                    g.copy_(mean.view_as(g))
            self.optimizer.step()
        correct = ((logits.detach().argmax(1) == y) & labelled).sum()
        acc1 = correct / labelled.sum().clamp_min(1)  # no argument validation: torchmetrics' reads the device's values
        pl_module.log_dict({"train/probe_acc1": acc1, "train/probe_loss": loss.detach()}, on_step=True, on_epoch=False)

    @torch.no_grad()
    def _features(self, trainer: Trainer, pl_module: LightningModule, x: Tensor) -> Tensor:
        ctx = forward_context(trainer)
        with eval_mode(pl_module):  # eval: BatchNorm statistics stay as they are
            if ctx is None:
                return pl_module(x).float()
            with ctx():
                return pl_module(x).float()

    # --- validation ---------------------------------------------------------------------------
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.classifier is None or not self.every_n_epochs or (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        for name, value in self.evaluate(trainer, pl_module).items():
            pl_module.log(name, value, on_step=False, on_epoch=True, sync_dist=True)

    @torch.no_grad()
    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        """Probe accuracy on the evaluation loader (each rank its shard, counts summed over ranks)."""
        loader = resolve_loader(self.val_dataloader, trainer, "eval_val_dataloader")
        device = pl_module.device
        probe = self._ensure(self.classifier.in_features, device)
        kw = dict(average="micro", ignore_index=-1, validate_args=False)
        metrics = {"val/probe_acc1": MulticlassAccuracy(self.num_classes, top_k=1, **kw).to(device)}
        if self.num_classes > 5:
            metrics["val/probe_acc5"] = MulticlassAccuracy(self.num_classes, top_k=5, **kw).to(device)
        for x, y in shard(loader, rank(), world_size()):
            logits = probe(self._features(trainer, pl_module, x.to(device)).flatten(1))
            for m in metrics.values():
                m.update(logits, y.to(device))
        return {name: float(m.compute()) for name, m in metrics.items()}  # compute() sums the states over ranks

    # --- checkpointing (the Bolts probe lost its state on resume) -----------------------------
    def state_dict(self) -> dict:
        if self.classifier is None:
            return {}
        return {
            "feature_dim": self.classifier.in_features,
            "num_classes": self.classifier.out_features,
            "classifier": self.classifier.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        self.num_classes = state_dict["num_classes"]
        device = self.classifier.weight.device if self.classifier is not None else torch.device("cpu")
        # built now (on the CPU until the first batch moves it, optimizer state included)
        self._build(state_dict["feature_dim"], device, state_dict)
