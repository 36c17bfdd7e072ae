"""moco-lightning: MoCo v1/v2/v3 self-supervised pretraining for PyTorch Lightning."""

__version__ = "0.1.0"

from .moco import MoCo  # noqa: E402

__all__ = ["MoCo", "__version__"]
