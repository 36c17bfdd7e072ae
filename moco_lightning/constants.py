"""Constants shared by the datamodules and the downstream side: the normalisation of ImageNet-pretrained
encoders (torchvision's) and its one-channel average; the checkpoint format's version. Imports nothing."""

#: the layout of ``checkpoint["moco_lightning"]``: bumped when it changes (older formats are upgraded on reading,
#: :func:`moco_lightning.training.compat.upgrade`; a newer one is refused)
FORMAT_VERSION = 4

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: one-channel (grayscale) images: the averages of ImageNet's three
GRAY_MEAN, GRAY_STD = (0.449,), (0.226,)


def default_normalisation(channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` for ``channels`` (3: ImageNet's; 1: their averages)."""
    return (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else (GRAY_MEAN * channels, GRAY_STD * channels)
