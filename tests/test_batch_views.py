"""BatchViews: the batched view augmentation, checked against the distributions it claims to draw."""

import math

import pytest
import torch
from torchvision.transforms import RandomResizedCrop

from moco_lightning.datamodules import BatchViews

OFF = dict(jitter_prob=0.0, gray_prob=0.0, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
# one view: the per-view probabilities must be given, see test_one_view_with_default_probabilities
ONE = dict(n_views=1, blur_prob=(0.0,), solarize_prob=(0.0,))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def coordinate_images(n, size):
    """Channel 0 = x / (size - 1), channel 1 = y / (size - 1): a view tells which part of the image it shows."""
    r = torch.arange(size, dtype=torch.float32) / (size - 1)
    img = torch.stack([r.view(1, -1).expand(size, size), r.view(-1, 1).expand(size, size), torch.zeros(size, size)])
    return img.expand(n, 3, size, size).contiguous()


def crop_geometry(view):
    """Per view: (width fraction, height fraction, flipped) of the crop it was cut from."""
    x, y = view[:, 0], view[:, 1]
    width = x.amax((1, 2)) - x.amin((1, 2))
    height = y.amax((1, 2)) - y.amin((1, 2))
    flipped = x[:, :, 0].mean(1) > x[:, :, -1].mean(1)
    return width, height, flipped


def test_crop_scale_ratio_and_flip_follow_torchvision():
    n, size = 2000, 32
    bv = BatchViews(size, min_scale=0.2, **ONE, **OFF)
    g = torch.Generator().manual_seed(0)
    (view,) = bv(coordinate_images(n, size), g)
    width, height, flipped = crop_geometry(view)
    area, ratio = width * height, width / height
    assert area.min() > 0.2 - 0.02 and area.max() <= 1 + 1e-4
    assert ratio.min() > 3 / 4 - 0.03 and ratio.max() < 4 / 3 + 0.03
    assert abs(flipped.float().mean().item() - 0.5) < 0.03
    # same area distribution as torchvision's RandomResizedCrop sampling on a square image
    torch.manual_seed(0)
    tv_area = torch.tensor(
        [
            (lambda t: t[2] * t[3] / size**2)(
                RandomResizedCrop.get_params(torch.empty(3, size, size), (0.2, 1.0), (3 / 4, 4 / 3))
            )
            for _ in range(n)
        ]
    )
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):
        assert abs(area.quantile(q).item() - tv_area.quantile(q).item()) < 0.03, q
    # crops sit anywhere: the centres cover the image
    centre_x = view[:, 0].mean((1, 2))
    assert centre_x.min() < 0.3 and centre_x.max() > 0.7


def test_scale_one_keeps_the_whole_image_and_normalises_exactly():
    x = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    bv = BatchViews(16, min_scale=1.0, hflip_prob=0.0, jitter_prob=0.0, gray_prob=0.0, mean=mean, std=std)
    v1, v2 = bv(x, torch.Generator().manual_seed(0))
    expected = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert torch.allclose(v1, expected, atol=1e-5) and torch.allclose(v2, expected, atol=1e-5)
    # uint8 and float inputs are the same images
    (vf,) = BatchViews(16, min_scale=1.0, hflip_prob=0.0, jitter_prob=0.0, gray_prob=0.0, mean=mean, std=std, **ONE)(
        x.float() / 255, torch.Generator().manual_seed(0)
    )
    assert torch.allclose(vf, v1, atol=1e-5)


def test_normalised_statistics_of_augmented_views():
    """Views of images with the dataset's statistics come out roughly zero-mean, unit-std."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(512, 1, 28, 28, generator=g) * 0.6 + 0.1  # mean 0.4, std 0.17
    mean, std = x.mean().item(), x.std().item()
    bv = BatchViews(28, jitter=(0.4, 0.4, 0.0, 0.0), mean=(mean,), std=(std,))
    v1, v2 = bv(x, g)
    for v in (v1, v2):
        assert v.shape == (512, 1, 28, 28) and v.dtype == torch.float32
        assert abs(v.mean().item()) < 0.1 and 0.6 < v.std().item() < 1.4


def test_same_generator_seed_same_views_and_the_generator_advances():
    x = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    bv = BatchViews(32, blur_prob=(0.5, 0.5), solarize_prob=(0.0, 0.2), mean=(0.5,) * 3, std=(0.5,) * 3)
    a = bv(x, torch.Generator().manual_seed(3))
    b = bv(x, torch.Generator().manual_seed(3))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    g = torch.Generator().manual_seed(3)
    first, second = bv(x, g), bv(x, g)
    assert not torch.equal(first[0], second[0])
    assert not torch.equal(a[0], a[1])  # the two views differ
    torch.manual_seed(0)
    c = bv(x, torch.Generator().manual_seed(3))
    torch.manual_seed(1)
    assert all(torch.equal(u, v) for u, v in zip(c, a))  # the global RNG plays no part


def test_jitter_probability_and_brightness_range():
    n = 4000
    x = torch.full((n, 3, 4, 4), 0.5)
    bv = BatchViews(
        4,
        min_scale=1.0,
        hflip_prob=0.0,
        jitter_prob=0.8,
        jitter=(0.4, 0.0, 0.0, 0.0),
        gray_prob=0.0,
        mean=(0.0,) * 3,
        std=(1.0,) * 3,
        **ONE,
    )
    (v,) = bv(x, torch.Generator().manual_seed(0))
    factor = v[:, 0, 0, 0] / 0.5
    changed = (factor - 1).abs() > 1e-4
    assert abs(changed.float().mean().item() - 0.8) < 0.03
    assert factor.min() >= 0.6 - 1e-4 and factor.max() <= 1.4 + 1e-4
    assert abs(factor[changed].mean().item() - 1.0) < 0.02  # uniform around 1


def test_grayscale_probability_and_hue_keeps_grays():
    n = 4000
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, 1, 1, generator=g).expand(n, 3, 4, 4).contiguous()
    bv = BatchViews(4, min_scale=1.0, jitter_prob=0.0, gray_prob=0.2, mean=(0.0,) * 3, std=(1.0,) * 3, **ONE)
    (v,) = bv(x, g)
    gray = (v[:, 0] == v[:, 1]).all((1, 2)) & (v[:, 1] == v[:, 2]).all((1, 2))
    assert abs(gray.float().mean().item() - 0.2) < 0.03
    # a hue rotation leaves gray pixels gray
    grays = torch.rand(64, 1, 4, 4, generator=g).expand(64, 3, 4, 4)
    hue = BatchViews(
        4,
        min_scale=1.0,
        hflip_prob=0.0,
        jitter_prob=1.0,
        jitter=(0.0, 0.0, 0.0, 0.5),
        gray_prob=0.0,
        mean=(0.0,) * 3,
        std=(1.0,) * 3,
        **ONE,
    )
    (h,) = hue(grays, g)
    assert torch.allclose(h, grays, atol=1e-5)


def test_one_channel_images():
    x = torch.randint(0, 256, (8, 1, 28, 28), dtype=torch.uint8)
    bv = BatchViews(
        28,
        jitter=(0.4, 0.4, 0.4, 0.1),
        gray_prob=0.2,
        blur_prob=(1.0, 0.0),
        solarize_prob=(0.0, 1.0),
        mean=(0.5,),
        std=(0.5,),
    )
    v1, v2 = bv(x, torch.Generator().manual_seed(0))
    assert v1.shape == v2.shape == (8, 1, 28, 28) and torch.isfinite(v1).all() and torch.isfinite(v2).all()


def test_v3_asymmetric_blur_and_solarize_probabilities_per_view():
    """MoCo v3: view 1 always blurred, never solarized; view 2 blurred with p 0.1, solarized with p 0.2."""
    n, size = 1000, 32
    g = torch.Generator().manual_seed(0)
    bv = BatchViews(
        size,
        min_scale=1.0,
        hflip_prob=0.0,
        jitter_prob=0.0,
        gray_prob=0.0,
        blur_prob=(1.0, 0.1),
        blur_sigma=(10.0, 10.0),
        solarize_prob=(0.0, 0.2),
        mean=(0.0,),
        std=(1.0,),
    )  # 1.4 px at 32 px
    checker = ((torch.arange(size).view(-1, 1) + torch.arange(size).view(1, -1)) % 2).float()
    v1, v2 = bv(checker.expand(n, 1, size, size), g)
    # blurred: values strictly between 0 and 1 (solarizing alone maps the 0/1 board to 0)
    blurred = [((v > 0.01) & (v < 0.99)).flatten(1).any(1) for v in (v1, v2)]
    assert blurred[0].all()
    assert abs(blurred[1].float().mean().item() - 0.1) < 0.03
    # solarization inverts the pixels >= 0.5 (blur leaves a constant image alone)
    v1, v2 = bv(torch.full((n, 1, size, size), 0.75), g)
    solarized = [(v - 0.25).abs().amax((1, 2, 3)) < 1e-4 for v in (v1, v2)]
    assert not solarized[0].any()
    assert abs(solarized[1].float().mean().item() - 0.2) < 0.04


def test_blur_strength_scales_with_image_size():
    """Same sigma relative to the image at 112 and 224 px: a blurred step edge spreads over the same fraction."""
    widths = []
    for size in (112, 224):
        edge = (torch.arange(size) >= size // 2).float().view(1, 1, 1, size).expand(1, 1, size, size)
        bv = BatchViews(
            size,
            min_scale=1.0,
            hflip_prob=0.0,
            jitter_prob=0.0,
            gray_prob=0.0,
            blur_prob=(1.0,),
            blur_sigma=(2.0, 2.0),
            mean=(0.0,),
            std=(1.0,),
            n_views=1,
            solarize_prob=(0.0,),
        )
        (v,) = bv(edge, torch.Generator().manual_seed(0))
        row = v[0, 0, size // 2]
        widths.append(((row > 0.05) & (row < 0.95)).sum().item() / size)
    assert widths[0] > 0 and math.isclose(widths[0], widths[1], rel_tol=0.35)


def test_one_view_with_default_probabilities():
    (v,) = BatchViews(8, n_views=1)(torch.rand(2, 3, 8, 8))
    assert v.shape == (2, 3, 8, 8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_scale=0.0), "min_scale"),
        (dict(min_scale=0.5, max_scale=0.4), "min_scale"),
        (dict(mean=(0.5, 0.5), std=(0.5,)), "mean and std"),
        (dict(blur_prob=(0.5,)), "blur_prob"),
        (dict(solarize_prob=(0.0, 1.5)), "solarize_prob"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchViews(32, **kwargs)


@pytest.mark.parametrize("preset", ["moco_v1", "moco_v2", "moco_v3"])
def test_every_tensor_of_the_views_follows_the_batch_device(preset):
    """The datamodule owning the views is never moved to the GPU: the views must follow the batch. The meta device
    stands in for a GPU here: any tensor left on the CPU raises 'Tensor on device cpu is not on the expected device'."""
    from moco_lightning.datamodules.device_views import PerViewColour
    from moco_lightning.datamodules.transforms import linear_eval_views, view_settings

    st = view_settings(preset, 48, blur=True)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.2, 0.2)
    images = torch.randint(0, 256, (4, 3, 40, 40), dtype=torch.uint8).to("meta")
    for views in (
        st.batch_views(mean, std)(images),
        linear_eval_views(48, mean, std)(images),
        PerViewColour(st, mean, std)(torch.zeros(4, 2, 3, 48, 48, dtype=torch.uint8, device="meta")),
    ):
        assert all(v.device.type == "meta" and v.shape == (4, 3, 48, 48) for v in views)


def test_in_memory_datamodule_makes_views_on_the_batch_device():
    from types import SimpleNamespace

    from helpers.data import tiny_data

    dm = tiny_data()
    dm.trainer = SimpleNamespace(training=True, validating=False, sanity_checking=False, global_rank=0)
    dm._train_generator = lambda device: None  # the meta device has no generator; everything else runs as on a GPU
    images = torch.zeros(8, 1, 28, 28, dtype=torch.uint8, device="meta")
    (v1, v2), _, _ = dm.on_after_batch_transfer((images, torch.zeros(8), torch.arange(8)), 0)
    assert v1.device.type == v2.device.type == "meta"


# --- the views that make a small centred image's pretext task hard: translation, rotation, erasing ----------
def plain(**kwargs):
    """No crop, flip or colour: only what a test switches on; normalised with mean 0, std 1 (values stay [0, 1])."""
    args = dict(min_scale=1.0, hflip_prob=0.0, jitter_prob=0.0, gray_prob=0.0, mean=(0.0,), std=(1.0,), n_views=1)
    return BatchViews(8, **{**args, **kwargs})


def test_translation_shifts_by_whole_pixels_and_fills_with_zeros():
    """Pad-and-crop: every view is the image shifted by an integer (dx, dy) in [-2, 2], zeros shifted in."""
    x = torch.rand(64, 1, 8, 8) * 0.9 + 0.1  # no zero pixel of its own
    (v,) = plain(translate=2)(x, torch.Generator().manual_seed(0))
    shifts = set()
    for img, out in zip(x, v):
        found = [
            (dx, dy)
            for dx in range(-2, 3)
            for dy in range(-2, 3)
            if torch.allclose(out, shifted(img, dx, dy), atol=1e-5)
        ]
        assert len(found) == 1, "not a whole-pixel shift"
        shifts.add(found[0])
    assert len(shifts) > 10  # the shifts vary per image, both signs, both axes
    assert {dx for dx, _ in shifts} == {-2, -1, 0, 1, 2} and {dy for _, dy in shifts} == {-2, -1, 0, 1, 2}


def shifted(img, dx, dy):
    out = torch.zeros_like(img)
    h, w = img.shape[-2:]
    ys, yd = (slice(0, h - dy), slice(dy, h)) if dy >= 0 else (slice(-dy, h), slice(0, h + dy))
    xs, xd = (slice(0, w - dx), slice(dx, w)) if dx >= 0 else (slice(-dx, w), slice(0, w + dx))
    out[..., yd, xd] = img[..., ys, xs]
    return out


def test_rotation_stays_within_its_angle_and_keeps_the_centre():
    """A rotation about the centre: a centred disc is unchanged, a bar along x turns by at most the angle."""
    yy, xx = torch.meshgrid(torch.arange(32.0) - 15.5, torch.arange(32.0) - 15.5, indexing="ij")
    bar = ((yy.abs() < 1.5) & (xx.abs() < 12)).float()[None, None].repeat(200, 1, 1, 1)
    big = dict(min_scale=1.0, hflip_prob=0.0, jitter_prob=0.0, gray_prob=0.0, mean=(0.0,), std=(1.0,), n_views=1)
    (v,) = BatchViews(32, rotation=20.0, **big)(bar, torch.Generator().manual_seed(0))
    w = v[:, 0].clamp(min=0)
    # the bar's angle from its second moments
    mxx, myy, mxy = (w * xx**2).sum((1, 2)), (w * yy**2).sum((1, 2)), (w * xx * yy).sum((1, 2))
    angle = torch.rad2deg(0.5 * torch.atan2(2 * mxy, mxx - myy)).abs()
    assert angle.max() <= 20.5 and angle.max() > 15 and angle.min() < 3  # uniform in [-20, 20] degrees
    disc = ((xx**2 + yy**2) < 25).float()[None, None]
    (d,) = BatchViews(32, rotation=45.0, **big)(disc, torch.Generator().manual_seed(1))
    r2 = xx**2 + yy**2
    assert (d[0, 0][r2 < 16] > 0.99).all() and (d[0, 0][r2 > 49] < 0.01).all()  # only the rim is resampled
    assert (d[0, 0] - disc[0, 0]).abs().mean() < 0.02


def test_random_erasing_fills_one_rectangle_with_the_mean_at_its_probability():
    x = torch.full((400, 1, 8, 8), 0.9)
    (v,) = plain(erase_prob=0.5, mean=(0.3,), std=(0.5,))(x, torch.Generator().manual_seed(0))
    erased = (v - (0.9 - 0.3) / 0.5).abs() > 1e-5  # pixels no longer the image's value
    any_erased = erased.flatten(1).any(1)
    assert 0.4 < any_erased.float().mean() < 0.6  # erase_prob
    assert torch.allclose(v[erased], torch.zeros(()))  # the mean: 0 after normalisation
    for mask in erased[any_erased][:50, 0]:  # one axis-aligned rectangle
        rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
        assert mask[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1].all()
        assert mask.sum() == len(rows) * len(cols)
    area = erased.flatten(1).sum(1)[any_erased].float() / 64
    assert area.min() >= 1 / 64 and area.max() <= 0.5


def test_the_hard_views_are_refused_where_they_cannot_be_drawn():
    from moco_lightning.datamodules.pil_transforms import lightly_views
    from moco_lightning.datamodules.transforms import view_settings

    settings = view_settings("moco_v2", 32)
    from dataclasses import replace

    with pytest.raises(ValueError, match="translate=3.*tensor path.*not by the PIL path"):
        lightly_views(replace(settings, translate=3), (0.5,), (0.5,))
    with pytest.raises(ValueError, match="translate and rotation must be >= 0"):
        BatchViews(8, rotation=-1.0)
