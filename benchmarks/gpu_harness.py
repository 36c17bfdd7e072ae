"""What the checks of :mod:`benchmarks.gpu_check` share: the summary row, a synthetic in-memory datamodule, the
MoCo model and the trainer at a check's sizes, and the timing callbacks. Every class is module-level, so that
``DDPStrategy(start_method="spawn")`` can pickle it into its processes."""

from __future__ import annotations

import json
import os
import time
from typing import List, Optional, Tuple

import torch
from lightning.pytorch import Callback
from torch import nn

from moco_lightning.datamodules import InMemoryDataModule, view_settings

NO_DALI = False  # --no-dali (set by gpu_check)


class Row:
    """One line of the summary table."""

    def __init__(self, figure: str, value: str, meaning: str, ok: Optional[bool] = None) -> None:
        self.figure, self.value, self.meaning, self.ok = figure, value, meaning, ok

    def cells(self) -> List[str]:
        verdict = "" if self.ok is None else ("pass" if self.ok else "**fail**")
        return [self.figure, self.value, self.meaning, verdict]


class Synthetic(InMemoryDataModule):
    """Random uint8 images in memory. Module-level (as every class of this check), so that
    ``DDPStrategy(start_method="spawn")`` can pickle the trainer and the datamodule into its processes."""

    num_classes = 10

    def __init__(self, settings, images: int, image: int, batch: int, channels: int = 3) -> None:
        self.in_channels, self.mean, self.std = channels, (0.5,) * channels, (0.25,) * channels
        self.n_images, self.side = images, image
        super().__init__(settings, batch_size=batch, image_size=image)

    def load_split(self, split: str):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        n = self.n_images if split == "train" else self.batch_size * 2
        images = torch.randint(0, 256, (n, self.in_channels, self.side, self.side), generator=g, dtype=torch.uint8)
        return images, torch.randint(0, 10, (n,), generator=g)


class Clock(Callback):
    """``perf_counter`` at the end of every training batch; stops the fit once ``deadline`` (a ``time.time()``) has
    passed and at least ``min_steps`` were timed after the ``warmup`` steps. On every rank, ``folder``: each rank
    writes its times and queue there at the end (the DDP check reads them back)."""

    def __init__(self, warmup: int, deadline: float, min_steps: int = 2, folder: Optional[str] = None) -> None:
        self.warmup, self.deadline, self.min_steps, self.folder = warmup, deadline, min_steps, folder
        self.ends: List[float] = []
        self.decoded_on = "?"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())
        if len(self.ends) == 1:
            self.decoded_on = getattr(trainer.train_dataloader, "decoded_on", "workers")
        timed = len(self.ends) - self.warmup - 1
        stop = timed >= self.min_steps and time.time() > self.deadline
        if trainer.world_size > 1:  # every rank stops at the same step
            stop = bool(trainer.strategy.reduce_boolean_decision(stop, all=False))
        if stop:
            trainer.should_stop = True

    def rate(self, batch: int) -> float:
        """Images/s of this rank over the timed steps (after the warm-up)."""
        return images_per_s(self.ends, self.warmup, batch)

    def on_train_end(self, trainer, pl_module):
        if self.folder is None:
            return
        record = dict(ends=self.ends, queue=pl_module.dictionary.keys.cpu().tolist(), world=trainer.world_size)
        with open(os.path.join(self.folder, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


def images_per_s(ends: List[float], warmup: int, batch: int) -> float:
    """Images/s from the end times of a rank's batches, over the steps after the ``warmup`` first ones."""
    timed = len(ends) - warmup - 1
    return batch * timed / (ends[-1] - ends[warmup]) if timed > 0 else float("nan")


class ShardedKNNPeak(Callback):
    """After the fit, each rank runs the kNN monitor's evaluation on its shard of an N x D bank (the bank is never
    gathered) and writes its peak memory and the accuracy (which must be the same on every rank)."""

    def __init__(self, folder: str, n: int, d: int) -> None:
        self.folder, self.n, self.d = folder, n, d

    def on_train_end(self, trainer, pl_module):
        from moco_lightning.callbacks.knn import knn_accuracy

        bank, queries = knn_loaders(self.n, self.d)
        cuda = pl_module.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        acc = knn_accuracy(nn.Identity(), bank, queries, num_classes=1000, device=pl_module.device)
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else float("nan")
        with open(os.path.join(self.folder, f"knn{trainer.global_rank}.json"), "w") as f:
            json.dump(dict(peak=peak, acc1=acc["acc1"], total=acc["total"]), f)


def knn_loaders(n: int, d: int):
    """A bank of ``n`` random ``d``-dim features over 1000 classes and 10 000 of them as queries (seeded: the same in
    every process)."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    feats, labels = torch.randn(n, d, generator=g), torch.randint(0, 1000, (n,), generator=g)
    q = min(10_000, n)
    bank = DataLoader(TensorDataset(feats, labels), batch_size=8192)
    return bank, DataLoader(TensorDataset(feats[:q], labels[:q]), batch_size=8192)


def synthetic_datamodule(
    size: dict,
    channels: int = 3,
    image: Optional[int] = None,
    batch: Optional[int] = None,
    local_views: int = 0,
    local_size: Optional[int] = None,
    images: Optional[int] = None,
):
    image, batch = image or size["image"], batch or size["batch"]
    settings = view_settings("moco_v2", image).with_local_views(local_views, local_size, (0.05, 0.14))
    return Synthetic(settings, images or size["images"], image, batch, channels)


def moco(size: dict, batch: Optional[int] = None, **kw):
    """MoCo for the check, split BN in 8 (2 under a batch of 64, as the throughput configs) of ``batch`` images."""
    from moco_lightning import MoCo

    args = dict(
        bn_splits=8 if (batch or size["batch"]) >= 64 else 2,
        backbone="resnet18",
        width=size["width"],
        cifar_stem=True,
        image_size=size["image"],
        queue_size=size["queue"],
        momentum=0.99,
        lr=0.06,
        channels_last=True,
        hidden_dim=512,
    )
    args.update(kw)
    return MoCo(**args)


def trainer(device: str, steps: int, **kw):
    from lightning.pytorch import Trainer

    args = dict(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        precision=precision(device),
    )
    args.update(kw)
    return Trainer(**args)


def precision(device: str) -> str:
    """bf16-mixed on the GPU; fp32 on a CPU, whose bf16 is emulated and would make the toy run take minutes."""
    return "bf16-mixed" if device == "cuda" else "32-true"


def fit_rate(device: str, size: dict, deadline: float, model, batch: int, **data) -> Tuple[float, str]:
    """(images/s of ``fit`` after the warm-up, where the training batches were decoded), stopping at ``deadline``."""
    warm, steps = size["warmup"], size["bench_steps"]
    clock = Clock(warm, deadline)
    trainer(device, steps + warm + 1, callbacks=[clock]).fit(model, **data)
    return clock.rate(batch), clock.decoded_on


# --- the checks: each returns (its line, its rows of the summary table) -------------------------------------------
Result = Tuple[str, List[Row]]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
