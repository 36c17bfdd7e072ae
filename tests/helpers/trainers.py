"""The tests' Trainer (one CPU process, one epoch, nothing written, nothing printed) and a logger that records."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger

CPU_TRAINER = dict(
    accelerator="cpu",
    devices=1,
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)


def cpu_trainer(**kwargs: Any) -> Trainer:
    return Trainer(**{**CPU_TRAINER, **kwargs})


def trainer(**kwargs: Any) -> Trainer:
    """:func:`cpu_trainer`, logging every step."""
    return cpu_trainer(**{"log_every_n_steps": 1, **kwargs})


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict, step: Optional[int] = None) -> None:
        self.records.append((step, {k: float(v) for k, v in metrics.items()}))

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(s, m[key]) for s, m in self.records if key in m]
