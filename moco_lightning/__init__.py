"""moco-lightning: MoCo v1/v2/v3 self-supervised pretraining for PyTorch Lightning, with SimCLR, BYOL and SwAV
beside it for comparison."""

from moco_lightning.downstream.encoder import Encoder, load_transform
from moco_lightning.downstream.export import load_backbone
from moco_lightning.methods.base import Pretraining
from moco_lightning.methods.byol import BYOL
from moco_lightning.methods.end_to_end import EndToEnd
from moco_lightning.methods.memory_bank_moco import MemoryBankMoCo
from moco_lightning.methods.moco import MoCo
from moco_lightning.methods.simclr import SimCLR
from moco_lightning.methods.swav import SwAV
from moco_lightning.methods.v3 import MoCoV3
from moco_lightning.training.compat import install_moved_modules
from moco_lightning.training.precision import auto_precision
from moco_lightning.version import __version__

install_moved_modules()  # the flat layout's module names (moco_lightning.moco, ...) import the moved modules

__all__ = [
    "BYOL",
    "Encoder",
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
