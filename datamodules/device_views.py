"""The tensor path's pieces for views cropped elsewhere (the image-folder ``augment_on="device"`` path): the crop
box drawn as torchvision draws it, from an explicit generator, and the per-view flip and colour on the device."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from moco_lightning.errors import ConfigError

from .batch_views import BatchViews

if TYPE_CHECKING:
    from .view_settings import ViewSettings


def random_resized_crop_box(
    width: int,
    height: int,
    scale: Tuple[float, float],
    generator: torch.Generator,
    ratio: Tuple[float, float] = (3 / 4, 4 / 3),
) -> Tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params`` drawn from ``generator``: (left, top, w, h)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        u = torch.rand(4, generator=generator).tolist()
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u[0])
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[1])
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(u[2] * (width - w + 1)), int(u[3] * (height - h + 1)), w, h
    # fallback: the central crop at the nearest allowed aspect ratio
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class PerViewColour(nn.Module):
    """Flip + colour part of a preset, per view, on views cropped beforehand.

    Input: uint8 (N, V, C, H, W), V views of each image already cropped to the output size, or the tuple
    ``(global views (N, V, C, H, W), local views (N, M, C, h, w))`` (multi-crop). Output: a list of V (+ M)
    normalised float views. Each view gets its own :class:`BatchViews` with the crop fixed to the whole image
    (``min_scale = max_scale = 1``: no resample, the flip alone) and the view's own blur / solarization
    probability; the local views the mean of the two.
    """

    def __init__(self, settings: "ViewSettings", mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        settings.tensor_path_only("the image folder's worker crops")

        def colour(size: int, blur: float, solarize: float) -> BatchViews:
            return BatchViews(
                size,
                min_scale=1.0,
                max_scale=1.0,
                hflip_prob=settings.hflip_prob,
                jitter_prob=settings.jitter_prob,
                jitter=settings.jitter,
                gray_prob=settings.gray_prob,
                blur_prob=(blur,),
                blur_sigma=settings.blur_sigma,
                solarize_prob=(solarize,),
                mean=tuple(mean),
                std=tuple(std),
                n_views=1,
            )

        self.per_view = nn.ModuleList(
            colour(settings.image_size, settings.blur_prob[v], settings.solarize_prob[v]) for v in range(2)
        )
        self.local = (
            colour(settings.local_size, sum(settings.blur_prob) / 2, sum(settings.solarize_prob) / 2)
            if settings.local_views
            else None
        )

    @torch.no_grad()
    def forward(self, images, generator: Optional[torch.Generator] = None) -> List[Tensor]:
        images, local = images if isinstance(images, (list, tuple)) else (images, None)
        if images.ndim != 5 or images.shape[1] != len(self.per_view):
            raise ConfigError(
                f"expected pre-cropped views (N, {len(self.per_view)}, C, H, W), got {tuple(images.shape)}"
            )
        views = [bv(images[:, v], generator)[0] for v, bv in enumerate(self.per_view)]
        if local is not None and self.local is not None:
            views += [self.local(local[:, j], generator)[0] for j in range(local.shape[1])]
        return views
