"""How an image folder's files become batches: one object per ``ImageFolderDataModule(backend=...)``.

- :class:`PILBackend` (``"pil"``): DataLoader workers decode with PIL and draw the views (or crop, leaving the colour
  to the device: ``augment_on="device"``); :mod:`~moco_lightning.datamodules.images`.
- :class:`DaliBackend` (``"dali"``): NVIDIA DALI decodes and augments in its own pipelines, on the GPU when there is
  one; :mod:`~moco_lightning.datamodules.dali`.

A backend answers two questions: where the views are drawn (:meth:`augment_on`) and which loader serves a split
(:meth:`loader`: ``"train"``, ``"val"`` for pretraining views of the held-out images, ``"eval"`` for the evaluation
transform).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch

from moco_lightning.errors import ConfigError

from .images import EpochTaggedSampler, ImageFileDataset

Split = Literal["train", "val", "eval"]


class PILBackend:
    """PIL in DataLoader workers (the default)."""

    name = "pil"

    def augment_on(self, requested: str, fused_crop: bool) -> str:
        """Where the views are drawn: ``"auto"`` is ``"device"`` with CUDA (batched colour ops pay off on a GPU;
        on CPUs the workers share them out), else ``"workers"``."""
        if fused_crop:
            raise ConfigError("dali_fused_crop=true needs backend='dali' (the PIL path crops after one decode)")
        if requested == "auto":
            return "device" if torch.cuda.is_available() else "workers"
        return requested

    def loader(self, dm: Any, ds: ImageFileDataset, split: Split, device: Optional[torch.device] = None) -> Any:
        if split == "train":  # a new seeded order every epoch, the last partial batch dropped
            return dm._loader(ds, sampler=EpochTaggedSampler(len(ds), dm.seed), drop_last=True)
        return dm._loader(ds, persistent=split != "eval")


class DaliBackend:
    """NVIDIA DALI pipelines, sharded over the trainer's ranks, on its device (without a trainer or a ``device``:
    a CPU pipeline)."""

    name = "dali"

    def augment_on(self, requested: str, fused_crop: bool) -> str:
        from .dali import require_dali

        require_dali()
        return "workers"  # DALI makes the views itself: nothing left for on_after_batch_transfer

    def loader(self, dm: Any, ds: ImageFileDataset, split: Split, device: Optional[torch.device] = None) -> Any:
        from .dali import DaliLoader

        trainer = dm.trainer
        if device is None:
            device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        mode = "eval" if split == "eval" else ("pretrain" if dm.pretrain or split == "val" else "linear")
        return DaliLoader(
            ds.paths, ds.targets.tolist(), mode, dm.view_settings, dm.mean, dm.std, dm.batch_size,
            seed=dm.seed, rank=rank, world=world, device_id=device.index if device.type == "cuda" else None,
            num_threads=max(1, dm.num_workers), eval_resize=dm.eval_resize, channels=dm.in_channels,
            shuffle=split != "val", files=ds, fused_crop=dm.dali_fused_crop,
        )  # fmt: skip


BACKENDS = {backend.name: backend for backend in (PILBackend(), DaliBackend())}
