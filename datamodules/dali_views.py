"""The DALI operator graph of the views (:class:`~.dali.DaliLoader`'s pipelines): decoding, the preset's random
resized crops, colour jitter, grayscale, blur, solarization, flip and normalisation, as DALI operators; per-sample
probabilities as blends with a coin flip (DALI has no per-sample branch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .transforms import ViewSettings


@dataclass(frozen=True)
class DaliViews:
    """The views of a preset as DALI operators. ``channels``: 3 (RGB) or 1; ``eval_resize``: the shorter side before
    the evaluation centre crop; ``fused_crop``: each random-resized crop decodes only its window (ROI decoding)."""

    settings: ViewSettings
    mean: Tuple[float, ...]
    std: Tuple[float, ...]
    channels: int = 3
    eval_resize: Optional[int] = None
    fused_crop: bool = False

    def outputs(self, encoded, gpu: bool, mode: str) -> tuple:
        """The pipeline's image outputs for ``mode``: ``"eval"`` one centre crop, ``"linear"`` one crop and flip,
        ``"pretrain"`` the preset's two views and its local views."""
        from nvidia.dali import fn, types

        st = self.settings
        decode = dict(device="mixed" if gpu else "cpu", output_type=types.RGB if self.channels == 3 else types.GRAY)
        if mode == "eval":
            x = fn.resize(fn.decoders.image(encoded, **decode), resize_shorter=self.eval_resize)
            return (self.normalise(x, crop=(st.image_size, st.image_size)),)
        # fused: each view decodes only its crop window (ROI decoding), else one decode and a crop per view
        images = (encoded, decode) if self.fused_crop else fn.decoders.image(encoded, **decode)
        if mode == "linear":
            return (self.view(images, st.image_size, (0.08, 1.0), colour=False),)
        blur, solarize = st.blur_prob, st.solarize_prob
        views = [self.view(images, st.image_size, (st.min_scale, 1.0), blur=blur[v], solarize=solarize[v])
                 for v in range(2)]  # fmt: skip
        local = (sum(blur) / 2, sum(solarize) / 2)
        views += [self.view(images, st.local_size, st.local_scale, blur=local[0], solarize=local[1])
                  for _ in range(st.local_views)]  # fmt: skip
        return tuple(views)

    def view(
        self,
        images,
        size: int,
        scale: Tuple[float, float],
        colour: bool = True,
        blur: float = 0.0,
        solarize: float = 0.0,
    ):
        from nvidia.dali import fn, types

        st = self.settings
        area = dict(random_area=scale, random_aspect_ratio=(3 / 4, 4 / 3))
        if self.fused_crop:  # (encoded, decoder arguments): decode the random window only, then resize it
            encoded, decode = images
            x = fn.resize(fn.decoders.image_random_crop(encoded, **decode, **area), size=(size, size), antialias=True)
        else:
            x = fn.random_resized_crop(images, size=(size, size), **area)
        x = fn.cast(x, dtype=types.FLOAT)
        if colour and st.jitter_prob > 0 and any(st.jitter):
            b, c, s, h = st.jitter
            brightness = fn.random.uniform(range=(max(0, 1 - b), 1 + b))
            contrast = fn.random.uniform(range=(max(0, 1 - c), 1 + c))
            if self.channels == 3:
                twisted = fn.color_twist(
                    x,
                    brightness=brightness,
                    contrast=contrast,
                    saturation=fn.random.uniform(range=(max(0, 1 - s), 1 + s)),
                    hue=fn.random.uniform(range=(-360 * h, 360 * h)),
                )
            else:  # one channel: no colour to change, brightness and contrast only
                twisted = fn.brightness_contrast(x, brightness=brightness, contrast=contrast, contrast_center=128.0)
            x = _mix(x, twisted, st.jitter_prob)
        if colour and st.gray_prob > 0 and self.channels == 3:
            x = _mix(x, fn.hsv(x, saturation=0.0), st.gray_prob)
        if blur > 0:
            lo, hi = st.blur_sigma
            sigma = fn.random.uniform(range=(lo * size / 224, hi * size / 224))
            k = max(3, int(0.1 * size) // 2 * 2 + 1)
            x = _mix(x, fn.gaussian_blur(x, sigma=sigma, window_size=k), blur)
        if solarize > 0:
            x = _mix(x, x + fn.cast(x >= 128.0, dtype=types.FLOAT) * (255.0 - 2.0 * x), solarize)
        return self.normalise(x, mirror=fn.random.coin_flip(probability=st.hflip_prob))

    def normalise(self, x, crop=None, mirror=None):
        from nvidia.dali import fn, types

        kw = {"crop": crop} if crop is not None else {}
        if mirror is not None:
            kw["mirror"] = mirror
        return fn.crop_mirror_normalize(
            x,
            dtype=types.FLOAT,
            output_layout="CHW",
            mean=[255 * m for m in self.mean],
            std=[255 * s for s in self.std],
            **kw,
        )


def _mix(x, y, p: float):
    """``y`` with probability ``p`` per sample, else ``x`` (DALI has no per-sample branch: a blend with 0/1)."""
    from nvidia.dali import fn, types

    if p >= 1:
        return y
    c = fn.cast(fn.random.coin_flip(probability=p), dtype=types.FLOAT)
    return c * y + (1.0 - c) * x
