"""moco-lightning: MoCo v1/v2/v3 self-supervised pretraining for PyTorch Lightning."""

__version__ = "0.2.0"

from .dictionaries import EndToEnd, MemoryBankMoCo  # noqa: E402
from .moco import MoCo  # noqa: E402
from .v3 import MoCoV3  # noqa: E402

__all__ = ["EndToEnd", "MemoryBankMoCo", "MoCo", "MoCoV3", "__version__"]
