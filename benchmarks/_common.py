"""Helpers shared by the benchmark scripts in this folder (not part of the library, not tests).

- the quickstart model settings and their command-line flags;
- a header that prints the command line, the versions, the threads and the machine's load;
- interleaved timing (A, B, ... then reversed order, median of the repeats, ratios paired per repeat);
- Fashion-MNIST as uint8 tensors (from the same IDX files as :class:`FashionMNISTDataModule`);
- the *reference* MoCo, written the way lightly's own examples write it (``examples/pytorch_lightning/moco.py``):
  lightly's ``MoCoProjectionHead``, ``NTXentLoss(memory_bank_size=(K, dim))``, ``deactivate_requires_grad``
  and ``update_momentum`` at the start of ``training_step``, per-image PIL ``MoCoV2Transform`` in DataLoader
  workers, a plain ``lightning.pytorch`` Trainer.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

# The quickstart model (configs/quickstart.yaml): ResNet-18 at half width, torchvision's standard stem, one input
# channel, 28 px, channels-last; MoCo v2 head and loss settings.
QUICKSTART = dict(
    backbone="resnet18", width=0.5, cifar_stem=False, in_channels=1, image_size=28, channels_last=True,
    head="mlp", dim=128, hidden_dim=512, queue_size=4096, momentum=0.99, temperature=0.2, lr=0.06,
    weight_decay=5e-4,
)
FASHION_MEAN, FASHION_STD = (0.2860,), (0.3530,)


def quiet() -> None:
    """Silence Lightning's advice (workers, logging intervals, ...), which would bury the tables."""
    warnings.filterwarnings("ignore")
    import logging

    import lightning.pytorch  # noqa: F401 - it sets its loggers' levels on import: override them afterwards

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


# --- command line ------------------------------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser, batch_size: int = 256, threads: Optional[int] = 1,
                   threads_help: Optional[str] = None) -> None:
    q = QUICKSTART
    g = p.add_argument_group("model (default: the quickstart backbone)")
    g.add_argument("--backbone", default=q["backbone"])
    g.add_argument("--width", type=float, default=q["width"], help="ResNet width multiplier")
    g.add_argument("--cifar-stem", action="store_true", help="3x3 stride-1 stem without max-pool (default: standard stem)")
    g.add_argument("--no-channels-last", dest="channels_last", action="store_false", help="keep NCHW layout")
    g.add_argument("--batch-size", type=int, default=batch_size)
    g.add_argument("--queue-size", type=int, default=q["queue_size"], help="K")
    g.add_argument("--dim", type=int, default=q["dim"])
    g.add_argument("--hidden-dim", type=int, default=q["hidden_dim"])
    g.add_argument("--momentum", type=float, default=q["momentum"])
    g.add_argument("--temperature", type=float, default=q["temperature"])
    g.add_argument("--lr", type=float, default=q["lr"], help="per 256 images")
    g.add_argument("--weight-decay", type=float, default=q["weight_decay"])
    p.add_argument("--threads", type=int, default=threads,
                   help=threads_help or f"torch intra-op threads of the main process (default {threads}; 0: torch's choice, "
                        "one per core). On a busy shared machine one thread avoids OpenMP threads waiting for each other: a "
                        "step of the quickstart model took 3-8x longer with 2 threads than with 1 while other jobs ran")
    p.add_argument("--seed", type=int, default=0)


def moco_kwargs(args: argparse.Namespace, **overrides) -> dict:
    kw = dict(
        backbone=args.backbone, width=args.width, cifar_stem=args.cifar_stem, in_channels=1, image_size=28,
        channels_last=args.channels_last, head="mlp", dim=args.dim, hidden_dim=args.hidden_dim,
        queue_size=args.queue_size, momentum=args.momentum, temperature=args.temperature, lr=args.lr,
        weight_decay=args.weight_decay, lr_schedule="cosine",
    )
    kw.update(overrides)
    return kw


def describe_model(args: argparse.Namespace) -> str:
    return (f"{args.backbone} width {args.width}, {'CIFAR' if args.cifar_stem else 'standard'} stem, in_channels 1, "
            f"28 px, {'channels_last' if args.channels_last else 'NCHW'}, MLP head {args.hidden_dim}-{args.dim}, "
            f"batch {args.batch_size}, K {args.queue_size}, m {args.momentum}, T {args.temperature}")


def header(title: str, args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"== {title} ==")
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print("settings: " + ", ".join(f"{k}={v}" for k, v in sorted(vars(args).items())))
    import lightning
    import lightly

    print(f"python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}, "
          f"lightly {lightly.__version__}; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    load = os.getloadavg()
    print("load average at start (1/5/15 min): %.1f %.1f %.1f" % load
          + ("  <- busy machine: other processes share these cores, expect noise" if load[0] > (os.cpu_count() or 1) * 0.75 else ""))
    print(flush=True)


def footer(t0: float) -> None:
    print("load average at end (1/5/15 min): %.1f %.1f %.1f" % os.getloadavg()
          + f"; total wall time {time.perf_counter() - t0:.0f} s", flush=True)


# --- timing -------------------------------------------------------------------------------------------
def time_per_call(fn: Callable[[], object], n: int, warmup: int = 1) -> float:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then the mean of ``n`` timed calls."""
    for _ in range(warmup):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def interleaved(cases: Dict[str, Callable[[], float]], repeats: int) -> Dict[str, List[float]]:
    """Runs every case once per repeat (order reversed every other repeat); each call returns one measurement."""
    names = list(cases)
    out: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            out[name].append(cases[name]())
    return out


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median over repeats of a[r] / b[r] (both measured in the same repeat, so slow drift cancels)."""
    return statistics.median(x / y for x, y in zip(a, b))


def print_table(rows: List[List[str]], head: List[str]) -> None:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  " + " | ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    print(line(head))
    print("  " + "-+-".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    print(flush=True)


def spread(v: Sequence[float], scale: float = 1e3, fmt: str = "{:.0f}") -> str:
    """'median [min-max]' of a list of seconds, in ms by default."""
    return f"{fmt.format(statistics.median(v) * scale)} [{fmt.format(min(v) * scale)}-{fmt.format(max(v) * scale)}]"


# --- data -----------------------------------------------------------------------------------------------
def fashion_mnist(split: str, data_dir: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """uint8 images (N, 1, 28, 28) and int64 labels of the ``"train"`` (60k) or ``"test"`` (10k) split."""
    from moco_lightning.datamodules.fashion_mnist import DEBIAN_DIR, FILES, read_idx

    folder = Path(data_dir or DEBIAN_DIR)
    names = FILES["train" if split == "train" else "val"]
    arrays = []
    for name in names:
        path = folder / (name + ".gz") if (folder / (name + ".gz")).is_file() else folder / name
        arrays.append(read_idx(path))
    images, labels = arrays
    return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


class PILFashionMNIST(Dataset):
    """A torchvision-``FashionMNIST``-like dataset: item ``(transform(PIL 'L' image), label)``."""

    def __init__(self, images: Tensor, labels: Tensor, transform: Callable) -> None:
        self.images = images[:, 0].numpy()
        self.labels = labels.tolist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.images[i], mode="L")), self.labels[i]


def lightly_moco_v2_transform():
    """lightly's MoCoV2Transform at 28 px: crop 0.2-1, flip, jitter (0.4, 0.4, 0.4, 0.1) p 0.8, grayscale p 0.2
    (a no-op on one channel), no blur (as the official CIFAR demo at 32 px), Fashion-MNIST normalisation."""
    from lightly.transforms import MoCoV2Transform

    return MoCoV2Transform(input_size=28, gaussian_blur=0.0, cj_prob=0.8, cj_strength=1.0, min_scale=0.2,
                           normalize={"mean": list(FASHION_MEAN), "std": list(FASHION_STD)})


def reference_loader(images: Tensor, labels: Tensor, batch_size: int, workers: int, seed: int = 0) -> DataLoader:
    return DataLoader(
        PILFashionMNIST(images, labels, lightly_moco_v2_transform()), batch_size=batch_size, shuffle=True,
        drop_last=True, num_workers=workers, persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )


# --- the reference MoCo, the lightly-examples way, in lightning.pytorch ---------------------------------
def make_reference(args: argparse.Namespace, total_steps: Optional[int] = None, channels_last: bool = False):
    """A LightningModule written like lightly's ``examples/pytorch_lightning/moco.py``, with the same backbone
    as ours (``build_backbone`` builds plain torchvision ResNet code) and the same hyper-parameters (constant
    momentum, T, K, SGD lr per 256 images, weight decay; cosine lr over ``total_steps`` when given).
    lightly's examples keep NCHW; ``channels_last`` is there to measure what the layout alone is worth."""
    import lightning.pytorch as pl
    from lightly.loss import NTXentLoss
    from lightly.models.modules import MoCoProjectionHead
    from lightly.models.utils import deactivate_requires_grad, update_momentum

    from moco_lightning.backbones import build_backbone

    class ReferenceMoCo(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, feature_dim = build_backbone(args.backbone, args.cifar_stem, 1, 28, args.width)
            self.projection_head = MoCoProjectionHead(feature_dim, args.hidden_dim, args.dim)
            self.backbone_momentum = copy.deepcopy(self.backbone)
            self.projection_head_momentum = copy.deepcopy(self.projection_head)
            deactivate_requires_grad(self.backbone_momentum)
            deactivate_requires_grad(self.projection_head_momentum)
            self.criterion = NTXentLoss(temperature=args.temperature, memory_bank_size=(args.queue_size, args.dim))
            if channels_last:
                self.to(memory_format=torch.channels_last)

        def features(self, x: Tensor) -> Tensor:
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            return self.backbone(x).flatten(start_dim=1)

        def forward(self, x: Tensor) -> Tensor:
            return self.projection_head(self.features(x))

        def forward_momentum(self, x: Tensor) -> Tensor:
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            key = self.backbone_momentum(x).flatten(start_dim=1)
            return self.projection_head_momentum(key).detach()

        def training_step(self, batch, batch_idx):
            update_momentum(self.backbone, self.backbone_momentum, m=args.momentum)
            update_momentum(self.projection_head, self.projection_head_momentum, m=args.momentum)
            x_query, x_key = batch[0]
            query = self.forward(x_query)
            key = self.forward_momentum(x_key)
            loss = self.criterion(query, key)
            self.log("train_loss_ssl", loss)
            return loss

        def configure_optimizers(self):
            optim = torch.optim.SGD(self.parameters(), lr=args.lr * args.batch_size / 256, momentum=0.9,
                                    weight_decay=args.weight_decay)
            if not total_steps:
                return optim
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=max(1, total_steps))
            return {"optimizer": optim, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return ReferenceMoCo()


class FeatureExtractor(nn.Module):
    """``forward(x)`` = backbone features, for the kNN / probe evaluation of the reference module."""

    def __init__(self, reference) -> None:
        super().__init__()
        self.reference = reference

    def forward(self, x: Tensor) -> Tensor:
        return self.reference.features(x)


# --- Lightning plumbing -----------------------------------------------------------------------------------
class StepClock:
    """A Lightning callback recording ``perf_counter`` at every ``on_train_batch_end`` (a callback's hook runs
    before the module's own ``on_train_batch_end``; the interval between two of them is one whole loop
    iteration: the module's end-of-step hook, fetching + augmenting the next batch, the next step)."""

    def __new__(cls, *a, **k):  # build the Callback subclass lazily so that importing this file stays cheap
        from lightning.pytorch import Callback

        class _StepClock(Callback):
            def __init__(self) -> None:
                self.ends: List[float] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                self.ends.append(time.perf_counter())

            def seconds(self, warmup: int, steps: int) -> float:
                """Wall time of iterations warmup+1 ... warmup+steps (1-based)."""
                return self.ends[warmup + steps - 1] - self.ends[warmup - 1]

        return _StepClock(*a, **k)


def trainer_kwargs(max_steps: int, logger: str, log_dir: str, callbacks: list, **extra) -> dict:
    """A plain single-process CPU Trainer: no validation, no checkpoints, no progress bar."""
    if logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        lg = TensorBoardLogger(log_dir, name="bench")
    elif logger == "csv":
        from lightning.pytorch.loggers import CSVLogger

        lg = CSVLogger(log_dir, name="bench")
    else:
        lg = False
    # max_steps ends the runs; max_epochs=1 keeps Lightning's estimated_stepping_batches = max_steps (callers pass
    # more epochs when max_steps spans several).
    kw = dict(accelerator="cpu", devices=1, max_epochs=1, max_steps=max_steps, limit_val_batches=0,
              num_sanity_val_steps=0, logger=lg, log_every_n_steps=10, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    kw.update(extra)
    return kw
