"""The PIL path of the views: a preset's settings as a per-image lightly transform (run in DataLoader workers),
and the evaluation and linear-evaluation transforms of a PIL image."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    from .view_settings import ViewSettings


def lightly_views(st: "ViewSettings", mean: Sequence[float], std: Sequence[float]) -> Callable:
    """``st`` as a lightly transform (``MoCoV1Transform``, ``MoCoV2Transform``; ``BYOLView1Transform`` /
    ``BYOLView2Transform`` for asymmetric views and multi-crop): PIL image -> list of normalised tensors."""
    st.tensor_path_only("the PIL path")
    from lightly.transforms import BYOLView1Transform, BYOLView2Transform, MoCoV1Transform, MoCoV2Transform
    from lightly.transforms.multi_view_transform import MultiViewTransform

    b, c, s, h = st.jitter
    common = dict(
        input_size=st.image_size,
        cj_prob=st.jitter_prob,
        cj_strength=1.0,
        cj_bright=b,
        cj_contrast=c,
        cj_sat=s,
        cj_hue=h,
        min_scale=st.min_scale,
        random_gray_scale=st.gray_prob,
        sigmas=st.sigma_pixels,
        hf_prob=st.hflip_prob,
        normalize={"mean": list(mean), "std": list(std)},
    )
    b1, b2 = st.blur_prob
    s1, s2 = st.solarize_prob
    if b1 == b2 and s1 == s2 == 0 and not st.local_views:  # symmetric views: lightly's MoCo transforms
        cls = MoCoV1Transform if st.preset == "moco_v1" else MoCoV2Transform
        return cls(gaussian_blur=b1, **common)
    views = [
        BYOLView1Transform(gaussian_blur=b1, solarization_prob=s1, **common),
        BYOLView2Transform(gaussian_blur=b2, solarization_prob=s2, **common),
    ]
    if st.local_views:  # the small views: the same colour, their own crop (lightly's RandomResizedCrop scale)
        from torchvision import transforms as T

        local = BYOLView1Transform(
            gaussian_blur=(b1 + b2) / 2,
            solarization_prob=(s1 + s2) / 2,
            **{
                **common,
                "input_size": st.local_size,
                "min_scale": st.local_scale[0],
                "sigmas": tuple(v * st.local_size / st.image_size for v in st.sigma_pixels),
            },
        )
        for i, t in enumerate(local.transform.transforms):
            if isinstance(t, T.RandomResizedCrop):
                local.transform.transforms[i] = T.RandomResizedCrop(st.local_size, scale=st.local_scale)
        views += [local] * st.local_views
    return MultiViewTransform(views)


def eval_transform(
    image_size: int, mean: Sequence[float], std: Sequence[float], resize: Optional[int] = None
) -> Callable:
    """No augmentation: resize the shorter side to ``resize`` (default ``image_size / 0.875``, 256 for
    224), centre-crop ``image_size``, normalise."""
    from torchvision import transforms as T

    resize = resize if resize is not None else int(round(image_size / 0.875))
    return T.Compose([T.Resize(resize), T.CenterCrop(image_size), T.ToTensor(), T.Normalize(mean, std)])


def linear_eval_train_transform(image_size: int, mean: Sequence[float], std: Sequence[float]) -> Callable:
    """The linear-evaluation protocol's training augmentation: random resized crop 0.08-1 and flip."""
    from torchvision import transforms as T

    return T.Compose(
        [
            T.RandomResizedCrop(image_size, scale=(0.08, 1.0)),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(mean, std),
        ]
    )
