"""moco-lightning: MoCo v1/v2/v3 self-supervised pretraining for PyTorch Lightning, with SimCLR, BYOL and SwAV
beside it for comparison."""

from .base import Pretraining
from .byol import BYOL
from .encoder import load_transform
from .end_to_end import EndToEnd
from .export import load_backbone
from .memory_bank_moco import MemoryBankMoCo
from .moco import MoCo
from .precision import auto_precision
from .simclr import SimCLR
from .swav import SwAV
from .v3 import MoCoV3
from .version import __version__

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
    "load_transform",
]
