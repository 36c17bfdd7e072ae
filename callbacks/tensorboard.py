"""TensorBoard views of a run: the augmented pairs MoCo trains on, and the learned embedding.

- :class:`ViewGrid` shows the two augmented views of a few images of the first training batch.
  MoCo's accuracy depends heavily on its augmentations (He et al. 2020, §3.3; Chen et al. 2020,
  MoCo v2, https://arxiv.org/abs/2003.04297, Table 1): seeing them is the quickest sanity check.
- :class:`EmbeddingProjector` writes backbone features of held-out images, with their labels and
  thumbnails, for TensorBoard's projector (t-SNE / PCA / UMAP), the kind of qualitative view
  InstDisc (Wu et al. 2018, https://arxiv.org/abs/1805.01978) and MoCo use to inspect neighbours.

Both work with any LightningModule whose ``forward(x)`` returns features, and do nothing (with a
warning) unless one of the trainer's loggers is a ``TensorBoardLogger``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torchvision.utils import make_grid

from moco_lightning.errors import ConfigError

from ._utils import LoaderLike, denormalize, eval_mode, forward_context, resolve_loader, tensorboard_writer

__all__ = ["EmbeddingProjector", "ViewGrid"]


def _stats(trainer: Trainer, mean: Optional[Sequence[float]], std: Optional[Sequence[float]]):
    dm = getattr(trainer, "datamodule", None)
    return (mean if mean is not None else getattr(dm, "mean", None)), (
        std if std is not None else getattr(dm, "std", None)
    )


def _writer_or_warn(trainer: Trainer, who: str) -> Any:
    writer = tensorboard_writer(trainer)
    if writer is None:
        rank_zero_warn(f"{who} does nothing: none of the trainer's loggers is a TensorBoardLogger")
    return writer


class ViewGrid(Callback):
    """Logs ``tag`` (default ``"train/views"``): row 1 the first views, row 2 the second views.

    Taken once, from the first training batch as the module receives it (after
    ``on_after_batch_transfer``, where the datamodules of this library draw the views), so
    ``batch[0]`` is ``[view_1, view_2]`` of normalised images; they are de-normalised with
    ``trainer.datamodule.mean/std`` when present (or ``mean``/``std`` given here).

    Args:
        n_images: images per row.
        mean, std: normalisation statistics, overriding the datamodule's.
        tag: the image's name in TensorBoard.
    """

    def __init__(
        self,
        n_images: int = 8,
        mean: Optional[Sequence[float]] = None,
        std: Optional[Sequence[float]] = None,
        tag: str = "train/views",
    ) -> None:
        super().__init__()
        if n_images < 1:
            raise ConfigError(f"n_images must be >= 1, got {n_images}")
        self.n_images, self.mean, self.std, self.tag = n_images, mean, std, tag
        self._done = False
        self._writer: Any = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._writer = _writer_or_warn(trainer, "ViewGrid")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._done or self._writer is None or not trainer.is_global_zero:
            return
        self._done = True
        views = batch[0] if isinstance(batch[0], (list, tuple)) else [batch[0]]
        mean, std = _stats(trainer, self.mean, self.std)
        n = min(self.n_images, views[0].shape[0])
        images = torch.cat([denormalize(v[:n], mean, std) for v in views])
        self._writer.add_image(self.tag, make_grid(images, nrow=n, padding=2, pad_value=1.0), trainer.global_step)


class EmbeddingProjector(Callback):
    """At the end of fitting, writes features of ``n_samples`` held-out images for TensorBoard's projector.

    The samples are the first ``n_samples`` of ``trainer.datamodule.eval_val_dataloader()`` (or
    of ``dataloader``); features are ``pl_module(x)`` in eval mode, L2-normalised (the geometry the
    kNN monitor sees). Metadata are the labels (``class_names[label]`` when given), and thumbnails
    the de-normalised images, downsized to at most ``thumbnail_size`` pixels.

    Args:
        n_samples: how many images (on rank 0).
        dataloader: a loader, or a callable returning one, instead of ``eval_val_dataloader()``.
        class_names: label names for the metadata.
        thumbnail_size: side of the sprite thumbnails (TensorBoard caps the sprite at 8192 px).
        mean, std: normalisation statistics, overriding the datamodule's.
        tag: the embedding's name in TensorBoard.
    """

    def __init__(
        self,
        n_samples: int = 500,
        dataloader: Optional[LoaderLike] = None,
        class_names: Optional[Sequence[str]] = None,
        thumbnail_size: int = 32,
        mean: Optional[Sequence[float]] = None,
        std: Optional[Sequence[float]] = None,
        tag: str = "features",
    ) -> None:
        super().__init__()
        if n_samples < 1 or thumbnail_size < 1:
            raise ConfigError(f"n_samples and thumbnail_size must be >= 1, got {n_samples}, {thumbnail_size}")
        self.n_samples, self.dataloader, self.class_names = n_samples, dataloader, class_names
        self.thumbnail_size, self.mean, self.std, self.tag = thumbnail_size, mean, std, tag
        self._writer: Any = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._writer = _writer_or_warn(trainer, "EmbeddingProjector")

    @torch.no_grad()
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._writer is None or not trainer.is_global_zero:
            return
        loader = resolve_loader(self.dataloader, trainer, "eval_val_dataloader")
        images, labels, features, seen = [], [], [], 0
        ctx = forward_context(trainer) or contextlib.nullcontext
        with eval_mode(pl_module):  # rank 0 alone: no collective here
            for batch in loader:
                x, y = batch[0][: self.n_samples - seen], torch.as_tensor(batch[1][: self.n_samples - seen])
                with ctx():
                    f = pl_module(x.to(pl_module.device))
                features.append(F.normalize(f.float().flatten(1), dim=1).cpu())
                images.append(x.cpu())
                labels.append(y.cpu())
                seen += len(y)
                if seen >= self.n_samples:
                    break
        x, y = torch.cat(images), torch.cat(labels)
        mean, std = _stats(trainer, self.mean, self.std)
        thumbs = denormalize(x, mean, std)
        if thumbs.shape[1] == 1:
            thumbs = thumbs.expand(-1, 3, -1, -1)
        if max(thumbs.shape[-2:]) > self.thumbnail_size:
            thumbs = F.interpolate(
                thumbs,
                size=(self.thumbnail_size, self.thumbnail_size),
                mode="bilinear",
                antialias=True,
                align_corners=False,
            ).clamp(0, 1)
        names = self.class_names
        metadata = [str(names[int(t)]) if names is not None else str(int(t)) for t in y]
        self._writer.add_embedding(
            torch.cat(features), metadata=metadata, label_img=thumbs, global_step=trainer.global_step, tag=self.tag
        )
        self._writer.flush()
