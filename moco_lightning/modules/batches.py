"""What a training batch of views looks like, and one-line errors for batches that are not."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from moco_lightning.errors import ConfigError


def split_views(batch: Any, who: str, in_channels: Optional[int] = None) -> tuple[list[Tensor], Optional[Tensor]]:
    """``(views, index)`` of a training batch ``([view_1, view_2, *local_views], target[, index])``.

    The views may also come stacked, one ``(N, V, C, H, W)`` tensor (``torch.stack([v1, v2])`` per item: a common
    dataset format), taken as V views; anything else is an error saying what a batch must look like (unpacking a
    stacked tensor along the batch dimension would train on garbage without a word). ``in_channels``: the channels
    the backbone was built for (checked when given)."""
    views = batch[0] if isinstance(batch, (list, tuple)) and batch else None
    if isinstance(views, Tensor) and views.ndim == 5:
        views = list(views.unbind(1))
    if not (isinstance(views, (list, tuple)) and len(views) >= 2 and all(isinstance(v, Tensor) for v in views)):
        raise ConfigError(
            f"{who}: a training batch must be ([view_1, view_2, ...], target[, index]): a list of two or more "
            f"(N, C, H, W) view tensors, or one (N, V, C, H, W) tensor of stacked views; got {describe_batch(batch)}. "
            "Use a two-view transform (lightly's MoCoV2Transform), or a moco_lightning datamodule given as "
            "trainer.fit(model, datamodule=dm): its loaders alone give single images, whose views the datamodule "
            "makes on the device (on_after_batch_transfer, which Lightning runs only for a datamodule)"
        )
    shapes = {tuple(v.shape[:2]) for v in views[:2]}
    if len(shapes) != 1 or views[0].ndim != 4:
        raise ConfigError(
            f"{who}: the two global views must be (N, C, H, W) tensors of the same N and C; got {describe_batch(batch)}"
        )
    if in_channels and views[0].shape[1] != in_channels:
        raise ConfigError(
            f"{who}: model.in_channels={in_channels}, but the views have {views[0].shape[1]} channel(s) "
            f"({describe_batch(batch)}): set model.in_channels {views[0].shape[1]}"
        )
    index = batch[2] if len(batch) > 2 and isinstance(batch[2], Tensor) else None
    return list(views), index


def two_views(views: list[Tensor], who: str) -> list[Tensor]:
    """The two global views of a two-view method, refusing local views it would otherwise leave unused."""
    if len(views) > 2:
        raise ConfigError(
            f"{who} uses two views, but the batch has {len(views)}: set the datamodule's local_views to 0 (multi-crop "
            "is for MoCo and SwAV)"
        )
    return views


def is_views_batch(batch: Any) -> bool:
    """A batch of views (a list of view tensors, or stacked (N, V, C, H, W)) rather than an evaluation batch."""
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else None
    return isinstance(first, (list, tuple)) or (isinstance(first, Tensor) and first.ndim == 5)


def describe_batch(batch: Any) -> str:
    """What a batch is, for error messages: its structure with tensor shapes."""

    def one(x: Any, depth: int = 0) -> str:
        if isinstance(x, Tensor):
            return f"Tensor{tuple(x.shape)}"
        if isinstance(x, dict):
            return "dict with keys " + str(list(x)[:5])
        if isinstance(x, (list, tuple)) and depth < 2:
            inner = ", ".join(one(v, depth + 1) for v in x[:4]) + (", ..." if len(x) > 4 else "")
            return f"{type(x).__name__}[{inner}]"
        return type(x).__name__

    return one(batch)
