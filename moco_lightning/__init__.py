"""moco-lightning: MoCo v1/v2/v3 self-supervised pretraining for PyTorch Lightning, with SimCLR, BYOL and SwAV
beside it for comparison."""

__version__ = "0.2.0"

from .base import Pretraining  # noqa: E402
from .byol import BYOL  # noqa: E402
from .dictionaries import EndToEnd, MemoryBankMoCo  # noqa: E402
from .export import load_backbone  # noqa: E402
from .moco import MoCo  # noqa: E402
from .precision import auto_precision  # noqa: E402
from .simclr import SimCLR  # noqa: E402
from .swav import SwAV  # noqa: E402
from .v3 import MoCoV3  # noqa: E402

__all__ = [
    "BYOL",
    "EndToEnd",
    "MemoryBankMoCo",
    "MoCo",
    "MoCoV3",
    "Pretraining",
    "SimCLR",
    "SwAV",
    "__version__",
    "auto_precision",
    "load_backbone",
]
