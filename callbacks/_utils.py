"""Helpers shared by the evaluation callbacks: loaders, logging, TensorBoard (features, sharding and modes come from
:mod:`moco_lightning.downstream.features`).

Everything here works on any ``nn.Module`` whose ``forward(x)`` returns features (N, D) and on any
iterable of ``(image, target[, index])`` batches; the collectives are no-ops without a process group.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from torch.utils.data import DataLoader

from moco_lightning.downstream.features import embed, eval_mode, max_across_ranks, shard, sum_across_ranks
from moco_lightning.errors import ConfigError
from moco_lightning.modules.distributed import concat_all_gather, rank, world_size

LoaderLike = Union[Iterable, Callable[[], Iterable]]

__all__ = [
    "LoaderLike",
    "concat_all_gather",
    "denormalize",
    "embed",
    "eval_mode",
    "first_view",
    "forward_context",
    "log_now",
    "max_across_ranks",
    "rank",
    "resolve_loader",
    "resolve_num_classes",
    "shard",
    "sum_across_ranks",
    "tensorboard_writer",
    "world_size",
]


def first_view(x: Any) -> Tensor:
    """The first view of a pretraining batch's ``[view_1, view_2]`` (or of stacked views (N, V, C, H, W)), or the
    image tensor itself."""
    if isinstance(x, Tensor) and x.ndim == 5:
        return x[:, 0]
    return x[0] if isinstance(x, (list, tuple)) else x


def resolve_loader(explicit: Optional[LoaderLike], trainer: Optional[Trainer], method: str) -> Iterable:
    """``explicit`` (a loader, or a callable returning one) if given, else ``trainer.datamodule.<method>()``."""
    if explicit is not None:
        return explicit() if callable(explicit) and not isinstance(explicit, DataLoader) else explicit
    dm = getattr(trainer, "datamodule", None) if trainer is not None else None
    fn = getattr(dm, method, None)
    if fn is None:
        raise ConfigError(
            f"no loader to evaluate with: the trainer's datamodule has no {method}() (see "
            "moco_lightning.datamodules.base for the contract); pass the loader to the callback instead"
        )
    return fn()


def resolve_num_classes(explicit: Optional[int], trainer: Optional[Trainer]) -> Optional[int]:
    """``explicit`` if given, else ``trainer.datamodule.num_classes``, else None."""
    if explicit is not None:
        return int(explicit)
    n = getattr(getattr(trainer, "datamodule", None), "num_classes", None)
    return int(n) if n is not None else None


def forward_context(trainer: Optional[Trainer]) -> Optional[Callable[[], contextlib.AbstractContextManager]]:
    """The precision plugin's forward context (autocast under mixed precision), if there is a trainer."""
    plugin = getattr(trainer, "precision_plugin", None) if trainer is not None else None
    return getattr(plugin, "forward_context", None)


def log_now(trainer: Trainer, metrics: dict[str, float], step: Optional[int] = None) -> None:
    """Writes ``metrics`` to every logger at ``step`` (default: the global step) and into
    ``trainer.callback_metrics`` (so ``ModelCheckpoint``/``EarlyStopping`` can monitor them).

    For hooks where ``LightningModule.log`` is not allowed, or would defer the write to a later step.
    Loggers write on rank 0 only.
    """
    step = trainer.global_step if step is None else step
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
    trainer.callback_metrics.update({k: torch.tensor(float(v)) for k, v in metrics.items()})


def tensorboard_writer(trainer: Trainer) -> Any:
    """The ``SummaryWriter`` of the first ``TensorBoardLogger`` among the trainer's loggers, else None."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def denormalize(x: Tensor, mean: Optional[Sequence[float]], std: Optional[Sequence[float]]) -> Tensor:
    """``x * std + mean`` per channel, clamped to [0, 1]; unchanged (but clamped) without statistics."""
    x = x.detach().float().cpu()
    if mean is not None and std is not None:
        m = torch.as_tensor(mean, dtype=x.dtype).view(1, -1, 1, 1)
        s = torch.as_tensor(std, dtype=x.dtype).view(1, -1, 1, 1)
        x = x * s + m
    return x.clamp(0, 1)
