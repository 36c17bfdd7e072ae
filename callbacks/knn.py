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

from typing import Any, Callable, Literal, Optional, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn

from moco_lightning.errors import ConfigError

from ._utils import (
    LoaderLike,
    concat_all_gather,
    embed,
    forward_context,
    log_now,
    max_across_ranks,
    resolve_loader,
    resolve_num_classes,
    sum_across_ranks,
    world_size,
)

__all__ = ["KNNMonitor", "knn_accuracy", "knn_counts", "knn_scores", "sharded_knn_counts"]


def knn_scores(
    features: Tensor, bank: Tensor, bank_targets: Tensor, num_classes: int, k: int, temperature: float
) -> Tensor:
    """Class scores (N, C) of the weighted kNN vote: ``sum over the k most similar bank rows of exp(sim / T)``.

    ``features`` (N, D) and ``bank`` (M, D) L2-normalised, so ``sim`` is the cosine similarity;
    ``bank_targets`` (M,) int64 in ``[0, num_classes)``; ``k <= M``.
    """
    sim, idx = (features @ bank.t()).topk(k, dim=1)
    return _vote(sim, bank_targets[idx], num_classes, temperature)


def _vote(sim: Tensor, labels: Tensor, num_classes: int, temperature: float) -> Tensor:
    scores = torch.zeros(sim.shape[0], num_classes, device=sim.device, dtype=torch.float32)
    return scores.scatter_add_(1, labels, (sim.float() / temperature).exp())


def _correct(scores: Tensor, y: Tensor, num_classes: int, topk: Sequence[int]) -> Tensor:
    return torch.stack([(scores.topk(min(j, num_classes), dim=1).indices == y[:, None]).any(1).sum() for j in topk])


@torch.no_grad()
def knn_counts(
    features: Tensor,
    targets: Tensor,
    bank: Tensor,
    bank_targets: Tensor,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    chunk_size: int = 256,
    topk: Sequence[int] = (1, 5),
    sharded: bool = False,
) -> Tensor:
    """Counts of correct weighted-kNN predictions: ``[correct@k for k in topk] + [total]``.

    ``features`` (N, D) and ``bank`` (M, D) must be L2-normalised (similarity = dot product). ``k`` is clipped to
    the bank size and each ``topk`` to ``num_classes``. Queries are classified ``chunk_size`` at a time, so memory
    is O(chunk_size * (M + num_classes)).

    ``sharded`` (a collective under DDP): the bank is split over the ranks, each holding its own share (never
    gathered: an ImageNet bank of 1.28M x 2048 fp32 features is 10.5 GB, and a gather would put all of it on every
    device) and its own queries. The queries of all ranks are gathered (small next to the bank); for each chunk
    every rank finds the ``k`` most similar rows of its shard, the ranks exchange these (chunk x k similarities and
    labels), and the merged top ``k`` over all shards is exactly the single-process neighbourhood. The counts are
    over all queries, the same on every rank.
    """
    if sharded:
        features, targets = concat_all_gather(features), concat_all_gather(targets.to(features.device).long())
    size = torch.tensor([bank.shape[0]], device=bank.device)
    n_bank = int(sum_across_ranks(size)) if sharded else bank.shape[0]
    if n_bank == 0:
        raise ConfigError("the kNN feature bank is empty: the bank loader gave no samples")
    k = min(k, n_bank)
    local_k = min(k, bank.shape[0])
    bank_targets = bank_targets.to(bank.device).long()
    correct = torch.zeros(len(topk), dtype=torch.long, device=bank.device)
    for start in range(0, features.shape[0], chunk_size):
        f = features[start : start + chunk_size].to(bank.device, bank.dtype)
        y = targets[start : start + chunk_size].to(bank.device).long()
        sim = torch.full((f.shape[0], k), float("-inf"), device=f.device)
        labels = torch.zeros((f.shape[0], k), dtype=torch.long, device=f.device)
        if local_k:
            s, idx = (f @ bank.t()).topk(local_k, dim=1)
            sim[:, :local_k], labels[:, :local_k] = s.float(), bank_targets[idx]
        if sharded and world_size() > 1:  # (world x chunk, k) -> (chunk, world * k): every shard's candidates
            sim, labels = _all_candidates(sim), _all_candidates(labels)
            sim, best = sim.topk(k, dim=1)
            labels = labels.gather(1, best)
        correct += _correct(_vote(sim, labels, num_classes, temperature), y, num_classes, topk)
    total = torch.tensor([features.shape[0]], dtype=torch.long, device=bank.device)
    return torch.cat([correct, total])


def sharded_knn_counts(*args: Any, **kwargs: Any) -> Tensor:
    """:func:`knn_counts` with the bank split over the ranks (``sharded=True``)."""
    return knn_counts(*args, sharded=True, **kwargs)


def _all_candidates(x: Tensor) -> Tensor:
    n = x.shape[0]
    gathered = concat_all_gather(x, equal_sizes=True)  # every rank classifies the same chunk of the same queries
    return gathered.view(world_size(), n, -1).permute(1, 0, 2).reshape(n, -1)


def knn_accuracy(
    module: nn.Module,
    bank_loader,
    val_loader,
    num_classes: Optional[int] = None,
    k: int = 200,
    temperature: float = 0.1,
    max_bank_size: Optional[int] = None,
    chunk_size: int = 256,
    device: Optional[torch.device] = None,
    forward_ctx: Optional[Callable] = None,
    bank_dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Weighted-kNN top-1 / top-5 accuracy (in [0, 1]) of ``module``'s features, on one or many processes.

    Each rank embeds its shard of ``bank_loader`` (the first ``max_bank_size`` samples when set) and keeps it
    (:func:`sharded_knn_counts`: the bank is never gathered), and its shard of ``val_loader``. ``bank_dtype``
    ``torch.bfloat16`` halves the bank's memory (the vote weights stay fp32). ``num_classes`` None: 1 + the
    largest bank label. Returns ``{"acc1", "acc5", "total"}`` (the same on every rank).
    """
    if device is None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
    bank, bank_targets = embed(
        module, bank_loader, device, limit=max_bank_size, gather=False, forward_context=forward_ctx, dtype=bank_dtype
    )
    top = bank_targets.max().reshape(1) if bank_targets.numel() else torch.full((1,), -1, device=bank_targets.device)
    top = int(max_across_ranks(top))
    if num_classes is None:
        num_classes = top + 1 if top >= 0 else 1
    elif top >= num_classes:
        raise ConfigError(f"the bank holds label {top} but num_classes is {num_classes}")
    feats, targets = embed(module, val_loader, device, gather=False, forward_context=forward_ctx)
    counts = sharded_knn_counts(feats, targets, bank, bank_targets, num_classes, k, temperature, chunk_size).tolist()
    total = max(counts[2], 1)
    return {"acc1": counts[0] / total, "acc5": counts[1] / total, "total": counts[2]}


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
