"""Helpers shared by the benchmark scripts in this folder (not part of the library, not tests).

- the model and data of a benchmark come from a config of ``configs/`` with overrides, through the same CLI
  machinery as ``moco-lightning fit`` (:func:`from_config`): no argument is declared twice;
- a header that prints the command line, the versions, the threads and the machine's load;
- interleaved timing (A, B, ... then reversed order, median of the repeats, ratios paired per repeat);
- Fashion-MNIST as uint8 tensors, and the evaluation of frozen features with the library's kNN and linear probe;
- the *reference* MoCo, written the way lightly's own examples write it (``examples/pytorch_lightning/moco.py``):
  lightly's ``MoCoProjectionHead``, ``NTXentLoss(memory_bank_size=(K, dim))``, ``deactivate_requires_grad`` and
  ``update_momentum`` at the start of ``training_step``, per-image PIL ``MoCoV2Transform`` in DataLoader workers.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, List, Optional

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
#: the budget unit, 1 QE: one epoch (60k images) of ``configs/quickstart.yaml`` with the ImageNet stem it had in
#: rounds 1-3, so that the unit stays the same when the shipped quickstart changes (round 4: ``cifar_stride2``)
QE_CONFIG, QE_OVERRIDES = "quickstart", ("--model.stem=imagenet",)
QE_IMAGES = 60000  #: 1 QE is one epoch of QE_CONFIG (with QE_OVERRIDES) over these, the 60k train images
CONFIGS = ROOT / "configs"
FASHION_MEAN, FASHION_STD = (0.2860,), (0.3530,)


def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: its module docstring as description and epilog, ``--threads`` and ``--seed``."""
    first, _, rest = doc.partition("\n\n")
    p = argparse.ArgumentParser(description=first, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--seed", type=int, default=0)
    return p


def quiet() -> None:
    """Silence Lightning's advice (workers, logging intervals, ...), which would bury the tables."""
    warnings.filterwarnings("ignore")
    import logging

    import lightning.pytorch  # noqa: F401 - it sets its loggers' levels on import: override them afterwards

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


def header(title: str, args) -> None:
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    print(f"== {title} ==")
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print("settings: " + ", ".join(f"{k}={v}" for k, v in sorted(vars(args).items())))
    import lightly
    import lightning

    print(
        f"python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}, "
        f"lightly {lightly.__version__}; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    load = os.getloadavg()
    busy = load[0] > (os.cpu_count() or 1) * 0.75
    print(
        "load average at start (1/5/15 min): %.1f %.1f %.1f" % load
        + ("  <- busy machine: other processes share these cores, expect noise" if busy else "")
    )
    print(flush=True)


def footer(t0: float) -> None:
    print(
        "load average at end (1/5/15 min): %.1f %.1f %.1f" % os.getloadavg()
        + f"; total wall time {time.perf_counter() - t0:.0f} s",
        flush=True,
    )


# --- configs -------------------------------------------------------------------------------------------------
def from_config(config: str | Path, *overrides: str):
    """(model, datamodule) of a config with CLI-style overrides (``"--model.width=0.25"``), built by the CLI itself
    (the library's :func:`moco_lightning.cli.from_config`)."""
    from moco_lightning.cli import from_config as build

    return build(config, *overrides)


def config_path(name: str) -> Path:
    path = Path(name)
    return path if path.suffix == ".yaml" and path.exists() else CONFIGS / f"{name}.yaml"


def print_table(rows: List[List[str]], head: List[str]) -> None:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]

    def line(r: List[str]) -> str:
        return "  " + " | ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))
        )

    print(line(head))
    print("  " + "-+-".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    print(flush=True)


def trainer_kwargs(max_steps: int, callbacks: list, **extra) -> dict:
    """A plain single-process CPU Trainer: no logger, validation, checkpoints or progress bar."""
    kw = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=-1,
        max_steps=max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    kw.update(extra)
    return kw


def forward_context(precision: str, device: str = "cpu") -> Callable:
    """The forward's precision context as ``Trainer(precision=precision)`` enters it, a factory: Lightning's own
    plugin (``torch.autocast`` with its weight-cast cache off under ``*-mixed``, nothing otherwise). Enter a new one
    for each step's forward: a cached autocast held over many steps would reuse bf16 copies of weights the optimizer
    has since changed (a stale, faster step than training runs)."""
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    return (MixedPrecision(precision, device) if precision.endswith("-mixed") else Precision()).forward_context


# --- data and evaluation --------------------------------------------------------------------------------------
def fashion_mnist(split: str) -> tuple[Tensor, Tensor]:
    """uint8 images (N, 1, 28, 28) and int64 labels of the ``"train"`` (60k) or ``"test"`` (10k) split."""
    from moco_lightning.datamodules import FashionMNISTDataModule

    dm = FashionMNISTDataModule()
    images, labels = dm.load_split("train" if split == "train" else "val")
    return images, labels


def eval_loader(
    images: Tensor, labels: Tensor, mean=FASHION_MEAN, std=FASHION_STD, batch_size: int = 512
) -> DataLoader:
    """The evaluation transform (normalise only), as the datamodules' ``eval_*_dataloader``."""
    from moco_lightning.datamodules import ImageTensorDataset, NormalizeCollate

    return DataLoader(
        ImageTensorDataset(images, labels),
        batch_size=batch_size,
        collate_fn=NormalizeCollate(mean, std, images.shape[-1]),
    )


def features(module: nn.Module, images: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Unnormalised features of ``module`` (eval mode, no grad) with the library's ``embed``."""
    from moco_lightning.callbacks import embed

    return embed(module, eval_loader(images, labels), torch.device("cpu"), gather=False, normalize=False)


def knn_top1(bank: Tensor, bank_y: Tensor, queries: Tensor, queries_y: Tensor, k: int = 200) -> float:
    """The README's protocol: weighted kNN (k 200, T 0.1, cosine):
    :func:`moco_lightning.downstream.evaluate.knn_top1`."""
    from moco_lightning.downstream.evaluate import knn_top1 as library_knn_top1

    return library_knn_top1((bank, bank_y), (queries, queries_y), 10, k)


#: the low-label linear probe: this fraction of each class of the bank, trained for this many optimizer steps
LOW_LABEL_FRACTION, LOW_LABEL_STEPS = 0.01, 500


def low_label_probe(
    bank_f: Tensor, bank_y: Tensor, q_f: Tensor, q_y: Tensor, fraction: float = LOW_LABEL_FRACTION, seed: int = 0
) -> float:
    """Top-1 of a linear classifier on frozen, standardised features of ``fraction`` of each class of the bank
    (seeded, class-stratified: the library's ``balanced_subset``): Adam, batches of 256, at least ``LOW_LABEL_STEPS``
    steps and 20 epochs (``fraction=1``: the full-label probe of :func:`evaluate`)."""
    from moco_lightning.datamodules.selection import balanced_subset
    from moco_lightning.downstream.evaluate import linear_top1

    idx = balanced_subset(bank_y, fraction=fraction, seed=seed)
    return linear_top1((bank_f[idx], bank_y[idx]), (q_f, q_y), 10, LOW_LABEL_STEPS, seed)


def evaluate(
    module: nn.Module, bank: tuple[Tensor, Tensor], queries: tuple[Tensor, Tensor], probe_epochs: int, seed: int = 0
) -> dict:
    """kNN top-1, linear-probe top-1 and the 1 %-label linear top-1 of ``module``'s frozen features
    (``nn.Flatten()``: raw pixels)."""
    from moco_lightning.callbacks import probe_accuracy

    t = time.perf_counter()
    bank_f, bank_y = features(module, *bank)
    q_f, q_y = features(module, *queries)
    out = {"knn_top1": knn_top1(bank_f, bank_y, q_f, q_y), "feature_dim": bank_f.shape[1]}
    if probe_epochs:
        out["probe_top1"] = probe_accuracy(bank_f, bank_y, q_f, q_y, 10, epochs=probe_epochs, seed=seed)
        out["low_label_top1"] = low_label_probe(bank_f, bank_y, q_f, q_y, seed=seed)
    out["eval_s"] = time.perf_counter() - t
    return out


# --- the reference MoCo, the lightly-examples way, in lightning.pytorch -----------------------------------------
class PILFashionMNIST(Dataset):
    """A torchvision-``FashionMNIST``-like dataset: item ``(transform(PIL 'L' image), label)``."""

    def __init__(self, images: Tensor, labels: Tensor, transform: Callable) -> None:
        self.images, self.labels, self.transform = images[:, 0].numpy(), labels.tolist(), transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.images[i], mode="L")), self.labels[i]


def reference_loader(
    images: Tensor, labels: Tensor, batch_size: int, workers: int, min_scale: float = 0.2, seed: int = 0
) -> DataLoader:
    """lightly's MoCoV2Transform at 28 px (crop ``min_scale``-1, flip, jitter (0.4, 0.4, 0.4, 0.1) p 0.8, no blur)."""
    from lightly.transforms import MoCoV2Transform

    transform = MoCoV2Transform(
        input_size=28,
        gaussian_blur=0.0,
        cj_prob=0.8,
        cj_strength=1.0,
        min_scale=min_scale,
        normalize={"mean": list(FASHION_MEAN), "std": list(FASHION_STD)},
    )
    return DataLoader(
        PILFashionMNIST(images, labels, transform),
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )


def make_reference(hp, batch_size: int, total_steps: Optional[int] = None):
    """A LightningModule written like lightly's ``examples/pytorch_lightning/moco.py``, with our model's backbone
    (``build_backbone`` builds plain torchvision code) and hyper-parameters ``hp`` (a MoCo's ``hparams``): constant
    momentum, T, K, SGD lr per 256 images, weight decay, cosine lr over ``total_steps``; NCHW, as lightly's examples."""
    import lightning.pytorch as pl
    from lightly.loss import NTXentLoss
    from lightly.models.modules import MoCoProjectionHead
    from lightly.models.utils import deactivate_requires_grad, update_momentum

    from moco_lightning.modules.backbones import build_backbone

    class ReferenceMoCo(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, feature_dim = build_backbone(
                hp.backbone, hp.cifar_stem, hp.in_channels, hp.image_size, hp.width, stem=hp.get("stem")
            )
            self.projection_head = MoCoProjectionHead(feature_dim, hp.hidden_dim, hp.dim)
            self.backbone_momentum = copy.deepcopy(self.backbone)
            self.projection_head_momentum = copy.deepcopy(self.projection_head)
            deactivate_requires_grad(self.backbone_momentum)
            deactivate_requires_grad(self.projection_head_momentum)
            self.criterion = NTXentLoss(temperature=hp.temperature, memory_bank_size=(hp.queue_size, hp.dim))

        def forward(self, x: Tensor) -> Tensor:  # features, for the evaluation
            return self.backbone(x).flatten(start_dim=1)

        def training_step(self, batch, batch_idx):
            update_momentum(self.backbone, self.backbone_momentum, m=hp.momentum)
            update_momentum(self.projection_head, self.projection_head_momentum, m=hp.momentum)
            x_query, x_key = batch[0]
            query = self.projection_head(self(x_query))
            key = self.projection_head_momentum(self.backbone_momentum(x_key).flatten(start_dim=1)).detach()
            loss = self.criterion(query, key)
            self.log("train_loss_ssl", loss)
            return loss

        def configure_optimizers(self):
            optim = torch.optim.SGD(
                self.parameters(), lr=hp.lr * batch_size / 256, momentum=0.9, weight_decay=hp.weight_decay
            )
            if not total_steps:
                return optim
            from moco_lightning.training.plan import StepPlan

            # the library's plan, so that quality.py re-plans the reference as it re-plans the library's modules
            self.step_plan = plan = StepPlan(max(1, total_steps), 0, [], batch_size)
            sched = torch.optim.lr_scheduler.LambdaLR(
                optim, lambda s: 0.5 * (1 + math.cos(math.pi * min(plan.position(s), plan.planned) / plan.planned))
            )
            return {"optimizer": optim, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return ReferenceMoCo()
