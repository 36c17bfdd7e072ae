"""Shared fixtures: a tiny backbone and tiny Fashion-MNIST subsets, so every test runs in seconds on a CPU."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch import nn

os.environ.setdefault("PL_DISABLE_FORK", "1")
# one thread per pytest-xdist worker (scripts/test.sh runs two on two cores), else two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")


def tiny_backbone(in_channels: int = 1) -> nn.Module:
    """A 2-layer conv net returning 16-d features: small enough for exact, fast tests."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 8, 3, 2, 1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, 2, 1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


def tiny_moco(cls=None, **kwargs):
    from moco_lightning import MoCo

    cls = cls or MoCo
    args = dict(
        backbone=tiny_backbone(),
        in_channels=1,
        image_size=28,
        head="mlp",
        hidden_dim=32,
        dim=8,
        queue_size=32,
        momentum=0.9,
        temperature=0.2,
        lr=0.06,
        lr_schedule="constant",
        shuffle_bn="off",
    )
    if cls.__name__ in ("EndToEnd", "MemoryBankMoCo"):  # no queue, no key encoder: their own arguments
        for name in ("queue_size", "momentum", "shuffle_bn"):
            args.pop(name)
    if cls.__name__ == "MoCoV3":  # v3's own heads, no queue
        args.pop("head")
        args.pop("queue_size")
    args.update(kwargs)
    return cls(**args)


FIXTURE_CKPT = os.path.join(os.path.dirname(__file__), "fixtures", "format2", "MoCo.ckpt")  # tiny, 1-channel, 28 px


def tiny_data(**kwargs):
    from moco_lightning.datamodules import FashionMNISTDataModule

    args = dict(batch_size=16, train_subset=64, val_subset=32, seed=0)
    args.update(kwargs)
    return FashionMNISTDataModule(**args)


CPU_TRAINER = dict(  # a test's Trainer: one CPU process, one epoch, nothing written, nothing printed
    accelerator="cpu",
    devices=1,
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)


def cpu_trainer(**kwargs) -> Trainer:
    return Trainer(**{**CPU_TRAINER, **kwargs})


@pytest.fixture
def one_torch_thread():
    """Small tensor ops on a shared, busy machine are far slower with 2 OpenMP threads than with 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def seeded():
    from lightning.pytorch import seed_everything

    seed_everything(0, verbose=False)
    return 0


class KillAt(Callback):
    """SIGKILLs its own process at the end of optimizer step ``step`` (after the callbacks listed before it, e.g. a
    ModelCheckpoint, have run): a kill at a chosen moment, independent of the machine's speed."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        if trainer.global_step == self.step:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


class RecordSchedules(Callback):
    """The lr each optimizer step uses (at its start) and the momentum it logs (``train/momentum``: the m of the
    update that follows it), by global step."""

    def __init__(self) -> None:
        self.lrs, self.momenta = {}, {}

    def on_train_batch_start(self, trainer, *args, **kwargs) -> None:
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        momentum = trainer.callback_metrics.get("train/momentum")
        if momentum is not None:
            self.momenta[trainer.global_step - 1] = float(momentum)


class SignalAt(Callback):
    """Sends ``signum`` (a number, or a name such as ``"SIGTERM"``) to its own process at the end of optimizer step
    ``step`` (after the callbacks listed before it), on every rank or on ``rank`` only: a preemption at a chosen
    moment."""

    def __init__(self, step: int, signum, rank=None) -> None:
        import signal

        self.step, self.rank = step, rank
        self.signum = getattr(signal, signum) if isinstance(signum, str) else signum

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), self.signum)
