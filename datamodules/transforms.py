"""MoCo view-augmentation presets, for the per-image PIL path and for the batched tensor path.

One table of settings per preset (:func:`view_settings`), turned into either

- a per-image PIL transform built on lightly (``MoCoV1Transform``, ``MoCoV2Transform``, and
  ``BYOLView1Transform`` / ``BYOLView2Transform`` for v3's asymmetric views): :func:`moco_v1`,
  :func:`moco_v2`, :func:`moco_v3`, or :func:`pil_views`; it maps a PIL image to a list
  of two normalised tensors and runs in DataLoader workers;
- a :class:`~moco_lightning.datamodules.batch_views.BatchViews` drawing the same distributions for
  a whole uint8 batch on its device: :func:`batch_views` or :meth:`ViewSettings.batch_views`.

The presets (He et al. 2020 §3.3 and the official ``main_moco.py``; Chen et al. 2020 (v2); Chen, Xie,
He 2021 (v3) and the official ``moco-v3`` code):

=========  ============  ==============================  ========  ==========  ============
preset     crop scale    colour jitter (b, c, s, h), p   gray p    blur p      solarize p
=========  ============  ==============================  ========  ==========  ============
moco_v1    0.2 - 1       0.4, 0.4, 0.4, 0.4, p 1.0       0.2       0, 0        0, 0
moco_v2    0.2 - 1       0.4, 0.4, 0.4, 0.1, p 0.8       0.2       0.5, 0.5    0, 0
moco_v3    0.08 - 1      0.4, 0.4, 0.2, 0.1, p 0.8       0.2       1.0, 0.1    0, 0.2
=========  ============  ==============================  ========  ==========  ============

All add a horizontal flip with p 0.5. Small images: at ``image_size <= 32`` (CIFAR's 32 px,
Fashion-MNIST's 28 px) blur is switched off in every preset, as the official CIFAR-10 demo does
(a 3-px kernel at 32 px erases most of the image); v3 keeps its solarization. ``blur=True/False``
overrides this.

Blur strength: the papers draw sigma in [0.1, 2.0] pixels at 224 px. Both paths scale that range
with the image side (sigma x ``image_size / 224``), so a 96-px STL-10 view is blurred as much,
relative to its content, as a 224-px ImageNet view (lightly's default would blur it 2.3x harder).

Grayscale (one-channel) images: kept one-channel in both paths (``in_channels = 1``, the model gets a
one-channel first convolution), with ``mean``/``std`` of one value. Brightness and contrast jitter
apply; saturation, hue and random grayscale are no-ops since there is no colour to change; blur and
solarization apply. The alternative, replicating the channel three times, triples the input cost for
the same information; :class:`~moco_lightning.datamodules.ImageFolderDataModule` offers
``in_channels=3`` (to use an RGB backbone) or ``in_channels=1`` for any folder.

Documented differences from the papers' code: v1's official code applies grayscale before colour
jitter, here (as in lightly) jitter comes first; the PIL path applies lightly's order of operations,
the tensor path the fixed order documented in :mod:`~moco_lightning.datamodules.batch_views`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Literal, Optional, Sequence, Tuple

from moco_lightning.constants import GRAY_MEAN, GRAY_STD, IMAGENET_MEAN, IMAGENET_STD  # noqa: F401
from moco_lightning.errors import ConfigError

from .batch_views import BatchViews
from .device_views import PerViewColour, random_resized_crop_box  # noqa: F401
from .pil_transforms import eval_transform, lightly_views, linear_eval_train_transform  # noqa: F401
from .view_settings import ViewSettings

Preset = Literal["moco_v1", "moco_v2", "moco_v3"]
PRESETS: Tuple[str, ...] = ("moco_v1", "moco_v2", "moco_v3")

#: At or below this side (pixels) blur is off by default: CIFAR (32) and Fashion-MNIST (28).
SMALL_IMAGE_SIZE = 32


def view_settings(
    preset: Preset,
    image_size: int,
    *,
    min_scale: Optional[float] = None,
    jitter_strength: float = 1.0,
    blur: Optional[bool] = None,
    jitter_prob: Optional[float] = None,
    gray_prob: Optional[float] = None,
) -> ViewSettings:
    """The settings of ``preset`` at ``image_size``.

    Args:
        preset: ``"moco_v1"``, ``"moco_v2"`` or ``"moco_v3"`` (table in the module docstring).
        image_size: output side in pixels.
        min_scale: overrides the preset's smallest crop area fraction.
        jitter_strength: multiplies the four colour-jitter strengths (lightly's ``cj_strength``;
            lightly suggests 0.5 for CIFAR).
        blur: None: the preset's blur, switched off at ``image_size <= 32``; True: the preset's blur at
            any size; False: no blur.
        jitter_prob, gray_prob: override the preset's probabilities of colour jitter and of grayscale.
    """
    if preset not in PRESETS:
        raise ConfigError(f"preset={preset!r} is not one of {list(PRESETS)}")
    if image_size < 1:
        raise ConfigError(f"image_size must be >= 1, got {image_size}")
    if jitter_strength < 0:
        raise ConfigError(f"jitter_strength must be >= 0, got {jitter_strength}")
    if preset == "moco_v1":
        st = ViewSettings(preset, image_size, 0.2, 1.0, (0.4, 0.4, 0.4, 0.4), 0.2, (0.0, 0.0), (0.0, 0.0))
    elif preset == "moco_v2":
        st = ViewSettings(preset, image_size, 0.2, 0.8, (0.4, 0.4, 0.4, 0.1), 0.2, (0.5, 0.5), (0.0, 0.0))
    else:
        st = ViewSettings(preset, image_size, 0.08, 0.8, (0.4, 0.4, 0.2, 0.1), 0.2, (1.0, 0.1), (0.0, 0.2))
    if min_scale is not None:
        if not 0 < min_scale <= 1:
            raise ConfigError(f"min_scale must be in (0, 1], got {min_scale}")
        st = replace(st, min_scale=float(min_scale))
    if jitter_strength != 1.0:
        b, c, s, h = st.jitter
        # hue is a fraction of the colour circle; torchvision caps it at 0.5
        st = replace(
            st, jitter=(b * jitter_strength, c * jitter_strength, s * jitter_strength, min(h * jitter_strength, 0.5))
        )
    if blur is False or (blur is None and image_size <= SMALL_IMAGE_SIZE):
        st = replace(st, blur_prob=(0.0, 0.0))
    for name, value in (("jitter_prob", jitter_prob), ("gray_prob", gray_prob)):
        if value is not None:
            if not 0 <= value <= 1:
                raise ConfigError(f"{name} must be in [0, 1], got {value}")
            st = replace(st, **{name: float(value)})
    return st


def batch_views(
    preset: Preset, image_size: int, mean: Sequence[float], std: Sequence[float], **settings: Any
) -> BatchViews:
    """The tensor-path views of ``preset``; ``settings``: the keyword arguments of :func:`view_settings`."""
    return view_settings(preset, image_size, **settings).batch_views(mean, std)


def pil_views(
    preset: Preset, image_size: int, mean: Sequence[float], std: Sequence[float], **settings: Any
) -> Callable:
    """The PIL-path views of ``preset``; ``settings`` as :func:`batch_views`."""
    return lightly_views(view_settings(preset, image_size, **settings), mean, std)


def moco_v1(
    image_size: int = 224, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD, **kwargs
):
    """MoCo v1's views as lightly's ``MoCoV1Transform`` (jitter always applied, hue 0.4, no blur)."""
    return pil_views("moco_v1", image_size, mean, std, **kwargs)


def moco_v2(
    image_size: int = 224, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD, **kwargs
):
    """MoCo v2's views as lightly's ``MoCoV2Transform`` (blur p 0.5, off at <= 32 px)."""
    return pil_views("moco_v2", image_size, mean, std, **kwargs)


def moco_v3(
    image_size: int = 224, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD, **kwargs
):
    """MoCo v3's asymmetric views: lightly's ``BYOLView1Transform`` / ``BYOLView2Transform`` with blur
    1.0 / 0.1 and solarization 0 / 0.2 (blur off at <= 32 px)."""
    return pil_views("moco_v3", image_size, mean, std, **kwargs)


def linear_eval_views(
    image_size: int, mean: Sequence[float], std: Sequence[float], min_scale: float = 0.08
) -> BatchViews:
    """The linear-evaluation protocol's training augmentation on the tensor path: one view, random resized
    crop 0.08-1 and flip, nothing else (what ``InMemoryDataModule(pretrain=False)`` means to build)."""
    return BatchViews(
        image_size,
        min_scale=min_scale,
        jitter_prob=0.0,
        gray_prob=0.0,
        blur_prob=(0.0,),
        solarize_prob=(0.0,),
        mean=tuple(mean),
        std=tuple(std),
        n_views=1,
    )
