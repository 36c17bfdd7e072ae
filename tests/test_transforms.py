"""View presets: the paper's settings, the PIL (lightly) and tensor (BatchViews) paths agreeing, small and gray
images."""

import numpy as np
import pytest
import torch
from lightly.transforms import MoCoV1Transform, MoCoV2Transform
from lightly.transforms.gaussian_blur import GaussianBlur
from lightly.transforms.multi_view_transform import MultiViewTransform
from lightly.transforms.solarize import RandomSolarization
from PIL import Image
from torchvision.transforms import RandomResizedCrop

from moco_lightning.datamodules import PRESETS, BatchViews, moco_v1, moco_v2, moco_v3, view_settings
from moco_lightning.datamodules.pil_transforms import lightly_views
from moco_lightning.datamodules.transforms import (
    PerViewColour,
    eval_transform,
    linear_eval_views,
    random_resized_crop_box,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_preset_table_matches_the_papers():
    v1, v2, v3 = (view_settings(p, 224) for p in PRESETS)
    assert (v1.min_scale, v1.jitter, v1.jitter_prob, v1.gray_prob, v1.blur_prob) == (
        0.2,
        (0.4, 0.4, 0.4, 0.4),
        1.0,
        0.2,
        (0, 0),
    )
    assert (v2.min_scale, v2.jitter, v2.jitter_prob, v2.gray_prob, v2.blur_prob) == (
        0.2,
        (0.4, 0.4, 0.4, 0.1),
        0.8,
        0.2,
        (0.5, 0.5),
    )
    assert (v3.min_scale, v3.jitter, v3.jitter_prob, v3.gray_prob) == (0.08, (0.4, 0.4, 0.2, 0.1), 0.8, 0.2)
    assert v3.blur_prob == (1.0, 0.1) and v3.solarize_prob == (0.0, 0.2)
    assert v1.solarize_prob == v2.solarize_prob == (0.0, 0.0)


@pytest.mark.parametrize("size, blur_on", [(28, False), (32, False), (33, True), (96, True), (224, True)])
def test_blur_is_off_for_small_images_only(size, blur_on):
    assert (view_settings("moco_v2", size).blur_prob == (0.5, 0.5)) == blur_on
    v3 = view_settings("moco_v3", size)
    assert v3.blur_prob == ((1.0, 0.1) if blur_on else (0.0, 0.0)) and v3.solarize_prob == (0.0, 0.2)
    assert view_settings("moco_v2", size, blur=True).blur_prob == (0.5, 0.5)
    assert view_settings("moco_v2", size, blur=False).blur_prob == (0.0, 0.0)


def test_overrides_and_bad_values():
    st = view_settings("moco_v2", 32, min_scale=0.08, jitter_strength=0.5)
    assert st.min_scale == 0.08 and st.jitter == (0.2, 0.2, 0.2, 0.05)
    assert view_settings("moco_v1", 224, jitter_strength=2.0).jitter[3] == 0.5  # hue capped as torchvision does
    assert view_settings("moco_v2", 96).sigma_pixels == pytest.approx((0.1 * 96 / 224, 2.0 * 96 / 224))
    with pytest.raises(ValueError, match="preset='simclr' is not one of"):
        view_settings("simclr", 32)
    with pytest.raises(ValueError, match="min_scale"):
        view_settings("moco_v2", 32, min_scale=0.0)


def test_pil_presets_are_lightly_transforms_with_the_paper_settings():
    t1, t2, t3 = moco_v1(224), moco_v2(224), moco_v3(224)
    assert isinstance(t1, MoCoV1Transform) and isinstance(t2, MoCoV2Transform)
    assert isinstance(t3, MultiViewTransform) and len(t3.transforms) == 2

    def ops(view, cls):
        return [op for op in view.transform.transforms if isinstance(op, cls)]

    blur = [ops(v, GaussianBlur)[0] for v in t3.transforms]
    solarize = [ops(v, RandomSolarization)[0] for v in t3.transforms]
    assert [b.prob for b in blur] == [1.0, 0.1] and [s.prob for s in solarize] == [0.0, 0.2]
    assert blur[0].sigmas == pytest.approx((0.1, 2.0))  # pixels at 224, as the papers
    assert ops(t2.transforms[0], GaussianBlur)[0].prob == 0.5
    assert moco_v2(32).transforms[0].transform.transforms[-3].prob == 0.0  # blur off at 32 px


def smooth_images(n, size, channels, seed=0):
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (n, 4, 4, channels), dtype=np.uint8)
    mode = "RGB" if channels == 3 else "L"
    return [
        Image.fromarray(s.squeeze(-1) if channels == 1 else s, mode).resize((size, size), Image.BILINEAR) for s in small
    ]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("channels", [3, 1])
def test_pil_views_on_rgb_and_grayscale(preset, channels):
    mean, std = (0.5,) * channels, (0.25,) * channels
    t = lightly_views(view_settings(preset, 32), mean, std)
    torch.manual_seed(0)
    np.random.seed(0)
    img = smooth_images(1, 40, channels)[0]
    v1, v2 = t(img)
    assert v1.shape == v2.shape == (channels, 32, 32) and v1.dtype == torch.float32
    assert not torch.equal(v1, v2)
    # normalised with (0.5, 0.25): [0, 1] -> [-2, 2], the dark half of the pixels below 0 (an unnormalised view is
    # never negative)
    assert -2.0 - 1e-6 <= v1.min() < -0.5 and 0.0 < v1.max() <= 2.0 + 1e-6


def test_pil_and_tensor_paths_draw_the_same_grayscale_rate_and_intensity():
    """Same preset both ways on the same images: the fraction of gray views and the mean intensity agree."""
    n, size = 400, 32
    imgs = smooth_images(n, size, 3)
    mean, std = (0.0,) * 3, (1.0,) * 3
    st = view_settings("moco_v2", size)
    pil = lightly_views(st, mean, std)
    torch.manual_seed(0)
    np.random.seed(0)
    pil_views = torch.stack([pil(im)[0] for im in imgs])
    batch = torch.stack([torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1) for im in imgs])
    (tensor_views, _) = st.batch_views(mean, std)(batch, torch.Generator().manual_seed(0))

    def gray_rate(v):
        return ((v[:, 0] - v[:, 1]).abs().amax((1, 2)) < 1e-6).float().mean().item()

    assert abs(gray_rate(pil_views) - 0.2) < 0.06 and abs(gray_rate(tensor_views) - 0.2) < 0.06
    assert abs(pil_views.mean().item() - tensor_views.mean().item()) < 0.03
    assert abs(pil_views.std().item() - tensor_views.std().item()) < 0.03


def test_tensor_presets_carry_the_per_view_settings():
    bv = view_settings("moco_v3", 96).batch_views((0.5,) * 3, (0.5,) * 3)
    assert isinstance(bv, BatchViews) and bv.scale == (0.08, 1.0) and bv.jitter == (0.4, 0.4, 0.2, 0.1)
    assert bv.blur_prob == (1.0, 0.1) and bv.solarize_prob == (0.0, 0.2) and bv.gray_prob == 0.2
    v1 = view_settings("moco_v1", 32).batch_views((0.5,), (0.5,))
    assert v1.jitter_prob == 1.0 and v1.jitter[3] == 0.4 and v1.blur_prob == (0.0, 0.0)


def test_random_resized_crop_box_matches_torchvision_bounds():
    g = torch.Generator().manual_seed(0)
    boxes = [random_resized_crop_box(500, 375, (0.2, 1.0), g) for _ in range(2000)]
    areas = np.array([w * h / (500 * 375) for _, _, w, h in boxes])
    ratios = np.array([w / h for _, _, w, h in boxes])
    assert all(0 <= left and left + w <= 500 and 0 <= t and t + h <= 375 for left, t, w, h in boxes)
    assert areas.min() >= 0.19 and areas.max() <= 1.0 and 0.74 <= ratios.min() and ratios.max() <= 1.34
    torch.manual_seed(0)
    tv = [RandomResizedCrop.get_params(torch.empty(3, 375, 500), (0.2, 1.0), (3 / 4, 4 / 3)) for _ in range(2000)]
    tv_areas = np.array([h * w / (500 * 375) for _, _, h, w in tv])
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):
        assert abs(np.quantile(areas, q) - np.quantile(tv_areas, q)) < 0.03, q
    # an extreme aspect ratio falls back to the central crop at the nearest allowed ratio
    left, top, w, h = random_resized_crop_box(1000, 10, (0.9, 1.0), torch.Generator().manual_seed(0))
    assert (w, h) == (13, 10) and left == (1000 - 13) // 2


def test_per_view_colour_is_identity_without_colour_ops():
    st = view_settings("moco_v2", 16)
    from dataclasses import replace

    plain = replace(st, jitter_prob=0.0, gray_prob=0.0, hflip_prob=0.0)
    x = torch.randint(0, 256, (4, 2, 3, 16, 16), dtype=torch.uint8)
    v1, v2 = PerViewColour(plain, (0.0,) * 3, (1.0,) * 3)(x, torch.Generator().manual_seed(0))
    assert torch.allclose(v1, x[:, 0].float() / 255, atol=1e-5) and torch.allclose(v2, x[:, 1].float() / 255, atol=1e-5)
    with pytest.raises(ValueError, match="pre-cropped views"):
        PerViewColour(plain, (0.0,) * 3, (1.0,) * 3)(x[:, 0])


def test_linear_eval_views_and_eval_transform():
    (v,) = linear_eval_views(16, (0.5,), (0.5,))(torch.randint(0, 256, (4, 1, 20, 20), dtype=torch.uint8))
    assert v.shape == (4, 1, 16, 16)
    img = Image.fromarray(np.full((300, 400, 3), 128, np.uint8))
    x = eval_transform(224, (0.5,) * 3, (0.5,) * 3)(img)
    assert x.shape == (3, 224, 224) and torch.allclose(x, torch.full_like(x, (128 / 255 - 0.5) / 0.5), atol=1e-5)
