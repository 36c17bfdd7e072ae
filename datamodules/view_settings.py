"""The settings of one preset's views (:class:`ViewSettings`): plain data, which every view path reads (the batched
tensor path, :mod:`~moco_lightning.datamodules.batch_views` and :mod:`~moco_lightning.datamodules.device_views`; the
PIL path, :mod:`~moco_lightning.datamodules.pil_transforms`; DALI); the presets are
:func:`moco_lightning.datamodules.transforms.view_settings`'s. Imports only the tensor path's
:class:`~moco_lightning.datamodules.batch_views.BatchViews` (the other paths import this module)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

from moco_lightning.errors import ConfigError

from .batch_views import BatchViews


@dataclass(frozen=True)
class ViewSettings:
    """One preset's augmentation settings; ``blur_prob`` and ``solarize_prob`` are per view."""

    preset: str
    image_size: int
    min_scale: float
    jitter_prob: float
    jitter: Tuple[float, float, float, float]
    gray_prob: float
    blur_prob: Tuple[float, float]
    solarize_prob: Tuple[float, float]
    hflip_prob: float = 0.5
    blur_sigma: Tuple[float, float] = (0.1, 2.0)  # pixels at 224 px; scaled with image_size
    local_views: int = 0  # multi-crop: this many small views more (SwAV: 6 of 96 px at 224, scale 0.05-0.14)
    local_size: int = 0
    local_scale: Tuple[float, float] = (0.05, 0.14)
    translate: int = 0  # tensor path only: random translation (pixels), rotation (degrees), random erasing
    rotation: float = 0.0
    erase_prob: float = 0.0

    def with_local_views(
        self, n: int, size: Optional[int] = None, scale: Sequence[float] = (0.05, 0.14)
    ) -> "ViewSettings":
        """These settings plus ``n`` local views of ``size`` px (default: 96/224 of ``image_size``, SwAV's ratio)."""
        if n < 0:
            raise ConfigError(f"local_views must be >= 0, got {n}")
        size = size if size is not None else max(1, round(self.image_size * 96 / 224))
        return replace(self, local_views=n, local_size=size, local_scale=(float(scale[0]), float(scale[1])))

    @property
    def sigma_pixels(self) -> Tuple[float, float]:
        """The blur's sigma range in pixels at ``image_size`` (what PIL's GaussianBlur takes)."""
        f = self.image_size / 224
        return (self.blur_sigma[0] * f, self.blur_sigma[1] * f)

    # --- the tensor path ------------------------------------------------------------------
    def batch_views(self, mean: Sequence[float], std: Sequence[float], n_views: int = 2) -> BatchViews:
        """A :class:`BatchViews` drawing these views for whole uint8 batches on their device."""
        return BatchViews(
            self.image_size,
            min_scale=self.min_scale,
            hflip_prob=self.hflip_prob,
            jitter_prob=self.jitter_prob,
            jitter=self.jitter,
            gray_prob=self.gray_prob,
            blur_prob=self.blur_prob[:n_views],
            blur_sigma=self.blur_sigma,
            solarize_prob=self.solarize_prob[:n_views],
            mean=tuple(mean),
            std=tuple(std),
            n_views=n_views,
            local_views=self.local_views if n_views == 2 else 0,
            local_size=self.local_size,
            local_scale=self.local_scale,
            translate=self.translate,
            rotation=self.rotation,
            erase_prob=self.erase_prob,
        )

    def tensor_path_only(self, where: str) -> None:
        """Refuses the tensor-path-only augmentations where ``where`` (a PIL or worker path) cannot apply them."""
        if self.translate or self.rotation or self.erase_prob:
            raise ConfigError(
                f"translate={self.translate}, rotation={self.rotation}, erase_prob={self.erase_prob}: these views are "
                f"drawn on the tensor path (in-memory datamodules), not by {where}; set them to 0 here"
            )
