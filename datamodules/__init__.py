"""Datamodules giving MoCo's two views for pretraining and the evaluation views for the callbacks: the built-in
datasets (``fashion_mnist``, ``cifar``, ``stl10``), a user's image folder (``image_folder``, with the PIL and DALI
backends), the transforms and their presets, and the resumable loading they share.

Imports: torch, torchvision, Lightning and the core's parts (:mod:`moco_lightning.modules`,
:mod:`moco_lightning.training`, :mod:`moco_lightning.errors`); never the methods' internals, the downstream side, the
callbacks or the CLI."""

from .base import TwoViewDataModule
from .batch_views import BatchViews
from .cifar import CIFAR10DataModule, CIFAR100DataModule
from .fashion_mnist import FashionMNISTDataModule
from .image_folder import ImageFolderDataModule
from .images import BadImageError, ImageFileDataset, find_bad_images, load_image, scan_image_folder
from .in_memory import ImageTensorDataset, InMemoryDataModule, NormalizeCollate
from .loading import ResumableDataLoader, SeededRandomSampler
from .stl10 import STL10DataModule
from .transforms import PRESETS, ViewSettings, batch_views, moco_v1, moco_v2, moco_v3, pil_views, view_settings

__all__ = [
    "BadImageError",
    "ImageFileDataset",
    "BatchViews",
    "CIFAR10DataModule",
    "CIFAR100DataModule",
    "FashionMNISTDataModule",
    "ImageFolderDataModule",
    "ImageTensorDataset",
    "InMemoryDataModule",
    "NormalizeCollate",
    "PRESETS",
    "STL10DataModule",
    "ResumableDataLoader",
    "SeededRandomSampler",
    "TwoViewDataModule",
    "ViewSettings",
    "batch_views",
    "find_bad_images",
    "load_image",
    "moco_v1",
    "moco_v2",
    "moco_v3",
    "pil_views",
    "scan_image_folder",
    "view_settings",
]
