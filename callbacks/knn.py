"""Weighted k-nearest-neighbour accuracy of the backbone's features, monitored during pretraining.

The classifier of Wu et al., "Unsupervised Feature Learning via Non-Parametric Instance
Discrimination" (InstDisc), CVPR 2018, https://arxiv.org/abs/1805.01978, §3.4: the k training
features most cosine-similar to a query vote for their class with weight ``exp(sim / T)``, and the
class with the largest summed weight wins. The official MoCo CIFAR-10 demo
(facebookresearch/moco, ``colab/moco_cifar10_demo.ipynb``) monitors pretraining with it, k = 200,
T = 0.1; so does lightly (``lightly.utils.benchmarking.knn_predict``, which :func:`knn_scores`
reproduces with a ``scatter_add`` instead of a (N, k, C) one-hot, and without importing lightly's
benchmarking package, which pulls in the separate ``pytorch_lightning`` package).

What this monitor does that the peers got wrong (see the repository's notes on MoCo pitfalls):
the bank comes from the *train split with the evaluation transform* (not augmented views), holds
features only, is built in eval mode under ``no_grad`` and gathered across DDP ranks; accuracy is
the sum of correct predictions over the sum of samples across ranks; the class count comes from
the datamodule, never from the validation labels. It only ever calls ``pl_module(x)``: no queue,
no key encoder, no state of the module is touched.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from moco_lightning.data_contract import Classes, EvaluationLoaders
from moco_lightning.downstream.knn import knn_accuracy, knn_counts, knn_scores, sharded_knn_counts
from moco_lightning.errors import ConfigError

from ._utils import LoaderLike, forward_context, log_now, resolve_loader, resolve_num_classes

__all__ = ["KNNMonitor", "knn_accuracy", "knn_counts", "knn_scores", "sharded_knn_counts"]


class KNNMonitor(Callback):
    """Logs the weighted-kNN accuracy of the features: ``<log_prefix>/knn_acc1`` and ``.../knn_acc5``.

    Accuracies are fractions in [0, 1], like MoCo's own; top-5 means top-min(5, num_classes).
    Runs once when training starts from step 0 (the random-initialisation baseline, written to the
    loggers at step 0) and at the end of every ``every_n_epochs``-th training epoch (through
    ``pl_module.log``, which Lightning writes at the index of the epoch's last optimizer step, i.e.
    ``global_step - 1``; ``history`` records ``global_step``). The bank is the train split with the
    evaluation transform, ``trainer.datamodule.eval_train_dataloader()``; the queries are
    ``trainer.datamodule.eval_val_dataloader()``. Batches are ``(image, target[, index])``.
    The metrics are in ``trainer.callback_metrics`` for ``ModelCheckpoint`` / ``EarlyStopping``.

    Works with any LightningModule whose ``forward(x)`` returns features (N, D).

    Args:
        every_n_epochs: evaluate after every n-th training epoch (0: only the baseline).
        k: neighbours that vote (InstDisc / MoCo demo: 200); clipped to the bank size.
        temperature: T of the vote weights ``exp(sim / T)`` (0.1).
        max_bank_size: use only the first N train samples as the bank (None: all of them).
            The bank holds N x D features, split over the devices (each keeps its own share, never gathered).
        bank_dtype: ``"float32"`` or ``"bfloat16"`` (half the bank's memory; the vote weights stay fp32).
        chunk_size: queries classified at a time (bounds the N x bank similarity matrix).
        log_prefix: metric names are ``f"{log_prefix}/knn_acc1"`` and ``.../knn_acc5``.
        num_classes: overrides ``trainer.datamodule.num_classes``.
        bank_dataloader, val_dataloader: loaders, or callables returning one, used instead of the
            datamodule's evaluation loaders.
        run_at_start: evaluate the baseline in ``on_train_start`` (skipped when resuming mid-run).
        pixel_baseline: also log ``<log_prefix>/knn_acc1_pixels`` (and ``_acc5_pixels``) once at the start: the same
            kNN, bank and queries on the raw normalised pixels (flattened) instead of features, the baseline an
            encoder has to beat (for images small enough to flatten: 28 px is 784 values); and the step-0 encoder's
            numbers once more as ``<log_prefix>/knn_acc1_init``, so that the final metrics show the trained encoder,
            the random-init encoder and the raw pixels side by side.

    Attributes:
        history: ``[(global_step, acc1), ...]`` of every evaluation, kept in checkpoints.
        measured_at: ``{metric name: global_step}`` of the latest evaluation of each metric (the CLI's final table
            says when a number was measured: with ``every_n_epochs`` 2 and one epoch, ``val/knn_acc1`` is step 0's).
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        k: int = 200,
        temperature: float = 0.1,
        max_bank_size: Optional[int] = None,
        chunk_size: int = 256,
        log_prefix: str = "val",
        num_classes: Optional[int] = None,
        bank_dataloader: Optional[LoaderLike] = None,
        val_dataloader: Optional[LoaderLike] = None,
        run_at_start: bool = True,
        bank_dtype: Literal["float32", "bfloat16"] = "float32",
        pixel_baseline: bool = False,
    ) -> None:
        super().__init__()
        if bank_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"bank_dtype must be 'float32' or 'bfloat16', got {bank_dtype!r}")
        if every_n_epochs < 0:
            raise ConfigError(f"every_n_epochs must be >= 0 (0: only the baseline), got {every_n_epochs}")
        if k < 1 or temperature <= 0 or chunk_size < 1:
            raise ConfigError(f"need k >= 1, temperature > 0, chunk_size >= 1; got {k}, {temperature}, {chunk_size}")
        if max_bank_size is not None and max_bank_size < 1:
            raise ConfigError(f"max_bank_size must be None or >= 1, got {max_bank_size}")
        self.every_n_epochs, self.k, self.temperature = every_n_epochs, k, temperature
        self.max_bank_size, self.chunk_size, self.log_prefix = max_bank_size, chunk_size, log_prefix
        self.num_classes, self.run_at_start, self.bank_dtype = num_classes, run_at_start, getattr(torch, bank_dtype)
        self.bank_dataloader, self.val_dataloader = bank_dataloader, val_dataloader
        self.pixel_baseline = pixel_baseline
        self.history: list[tuple[int, float]] = []
        self.measured_at: dict[str, int] = {}  # metric name -> global_step of its latest evaluation

    @property
    def data_contract(self) -> tuple:
        """What it reads of the trainer's datamodule (checked at fit start): the evaluation loaders unless it has its
        own, the number of classes unless given."""
        loaders = () if self.bank_dataloader is not None or self.val_dataloader is not None else (EvaluationLoaders,)
        return loaders + ((Classes,) if self.num_classes is None else ())

    def evaluate(self, trainer: Trainer, pl_module: LightningModule, pixels: bool = False) -> dict[str, float]:
        """Runs the kNN evaluation now; returns ``{name: accuracy in [0, 1]}`` and records it in ``history``
        (``pixels``: of the flattened images instead, named ``..._pixels`` and not recorded)."""
        result = knn_accuracy(
            nn.Flatten() if pixels else pl_module,
            resolve_loader(self.bank_dataloader, trainer, "eval_train_dataloader"),
            resolve_loader(self.val_dataloader, trainer, "eval_val_dataloader"),
            num_classes=resolve_num_classes(self.num_classes, trainer),
            k=self.k,
            temperature=self.temperature,
            max_bank_size=self.max_bank_size,
            chunk_size=self.chunk_size,
            device=pl_module.device,
            forward_ctx=forward_context(trainer),
            bank_dtype=self.bank_dtype,
        )
        suffix = "_pixels" if pixels else ""
        metrics = {
            f"{self.log_prefix}/knn_acc1{suffix}": result["acc1"],
            f"{self.log_prefix}/knn_acc5{suffix}": result["acc5"],
        }
        if not pixels:
            self.history.append((trainer.global_step, metrics[f"{self.log_prefix}/knn_acc1"]))
        self.measured_at.update({name: trainer.global_step for name in metrics})
        return metrics

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.run_at_start and trainer.global_step == 0:
            # self.log here would be written at the end of the first epoch: write at step 0 directly.
            metrics = self.evaluate(trainer, pl_module)
            if self.pixel_baseline:
                metrics.update({f"{name}_init": value for name, value in metrics.items()})
                metrics.update(self.evaluate(trainer, pl_module, pixels=True))
                self.measured_at.update({name: 0 for name in metrics})
            log_now(trainer, metrics)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            for name, value in self.evaluate(trainer, pl_module).items():
                # identical on every rank already; sync_dist only silences Lightning's DDP warning
                pl_module.log(name, value, on_step=False, on_epoch=True, sync_dist=True)

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = [tuple(h) for h in state_dict.get("history", [])]
