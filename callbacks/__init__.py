"""Evaluation callbacks: they work on any LightningModule whose ``forward(x)`` returns features.

- :class:`KNNMonitor`: weighted kNN accuracy of the features (InstDisc; the MoCo CIFAR demo).
- :class:`LinearProbe`: an online linear classifier on detached features.
- :class:`ViewGrid`, :class:`EmbeddingProjector`: TensorBoard images of the views and the projector.
- :class:`RepresentationDiagnostics`: alignment / uniformity, key-encoder drift, queue age.

Offline linear evaluation (the paper's protocol) is :class:`moco_lightning.downstream.linear_eval.LinearClassifier`.

Imports: the core and the downstream side (features and kNN live in :mod:`moco_lightning.downstream`; the callbacks
use them, never the reverse); nothing imports the callbacks but the CLI and the package's public names.
"""

from ._utils import embed
from .diagnostics import RepresentationDiagnostics, alignment, mean_queue_age, uniformity
from .knn import KNNMonitor, knn_accuracy, knn_counts, knn_scores
from .linear_probe import LinearProbe, probe_accuracy
from .tensorboard import EmbeddingProjector, ViewGrid

__all__ = [
    "EmbeddingProjector",
    "KNNMonitor",
    "LinearProbe",
    "RepresentationDiagnostics",
    "ViewGrid",
    "alignment",
    "embed",
    "knn_accuracy",
    "knn_counts",
    "knn_scores",
    "mean_queue_age",
    "probe_accuracy",
    "uniformity",
]
