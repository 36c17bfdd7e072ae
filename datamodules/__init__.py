"""Datamodules giving MoCo's two views for pretraining and the evaluation views for the callbacks."""

from .base import ImageTensorDataset, InMemoryDataModule, NormalizeCollate, SeededRandomSampler
from .batch_views import BatchViews
from .fashion_mnist import FashionMNISTDataModule

__all__ = [
    "BatchViews",
    "FashionMNISTDataModule",
    "ImageTensorDataset",
    "InMemoryDataModule",
    "NormalizeCollate",
    "SeededRandomSampler",
]
