"""CIFAR-10 and CIFAR-100 (Krizhevsky 2009, https://www.cs.toronto.edu/~kriz/cifar.html): 50 000 + 10 000
colour 32x32 images, 10 or 100 classes.

Read from the "python version" pickles torchvision downloads and extracts:
``<data_dir>/cifar-10-batches-py/{data_batch_1..5, test_batch}`` and
``<data_dir>/cifar-100-python/{train, test}``. Both splits fit in memory as uint8 (180 MB), so the
views are drawn batched on the device (:class:`~moco_lightning.datamodules.in_memory.InMemoryDataModule`).

``download=True`` fetches the archive with torchvision's ``CIFAR10(data_dir, download=True)`` /
``CIFAR100(...)`` (MD5-checked) when the files are missing. Loading reads the pickles directly,
in torchvision's format, rather than through torchvision's class: that class re-hashes every file
on each construction and rejects any file that is not the original (so no test fixture could be read),
and its "Dataset not found or corrupted" does not say which file is wrong; here each error names it.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from moco_lightning.errors import ConfigError, DataNotFoundError

from .in_memory import InMemoryDataModule
from .transforms import Preset, view_settings


def read_cifar_pickle(path: Path, label_key: str) -> Tuple[np.ndarray, np.ndarray]:
    """One CIFAR python pickle -> (uint8 images (N, 3, 32, 32), int64 labels (N,))."""
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
    except Exception as e:  # truncated or not a pickle: UnpicklingError, EOFError, ValueError...
        raise ConfigError(
            f"{path}: cannot be read as a CIFAR python pickle ({type(e).__name__}: {e}); delete the folder and get "
            "the dataset again (data.download=true)"
        ) from None
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: not a CIFAR pickle (holds a {type(entry).__name__}, expected a dict)")
    entry = {k.decode() if isinstance(k, bytes) else k: v for k, v in entry.items()}
    if "data" not in entry or label_key not in entry:
        raise ConfigError(
            f"{path}: not a CIFAR pickle of this dataset (keys {sorted(entry)}, expected 'data' and {label_key!r})"
        )
    data = np.asarray(entry["data"], dtype=np.uint8)
    labels = np.asarray(entry[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ConfigError(f"{path}: 'data' has shape {data.shape}, expected (N, 3072)")
    if len(data) != len(labels):
        raise ConfigError(f"{path}: {len(data)} images but {len(labels)} labels")
    return data.reshape(-1, 3, 32, 32), labels


class CIFAR10DataModule(InMemoryDataModule):
    """CIFAR-10 for MoCo pretraining and evaluation (see :mod:`moco_lightning.datamodules.base`).

    Args:
        data_dir: folder holding ``cifar-10-batches-py/`` (or that folder itself).
        download: download through torchvision into ``data_dir`` when the files are missing.
        **kwargs: batch size, workers, seed, pretrain, multi-crop, subsets: see
            :class:`~moco_lightning.datamodules.in_memory.InMemoryDataModule`. Evaluation uses the test split.
        image_size: side of the views (32: native; larger upsamples).
        preset: view augmentation (:mod:`~moco_lightning.datamodules.transforms`); the default
            ``moco_v2`` at 32 px, blur off, is the official CIFAR-10 demo's augmentation.
        min_scale: overrides the preset's smallest crop area (the official demo uses 0.08).
        jitter_strength: multiplies the preset's colour-jitter strengths.
        blur: None: the preset's blur, off at <= 32 px; True / False forces it on / off.
    """

    num_classes = 10
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)
    in_channels = 3
    name = "CIFAR-10"
    base_folder = "cifar-10-batches-py"
    files = {"train": [f"data_batch_{i}" for i in range(1, 6)], "val": ["test_batch"]}
    label_key = "labels"

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = False,
        image_size: int = 32,
        preset: Preset = "moco_v2",
        min_scale: Optional[float] = None,
        jitter_strength: float = 1.0,
        blur: Optional[bool] = None,
        **kwargs: Any,
    ) -> None:
        settings = view_settings(preset, image_size, min_scale=min_scale, jitter_strength=jitter_strength, blur=blur)
        super().__init__(settings, image_size=image_size, **kwargs)
        self.data_dir, self.download, self.preset = data_dir, download, preset

    # --- files --------------------------------------------------------------------------------
    def _all_files(self) -> Sequence[str]:
        return [f for names in self.files.values() for f in names]

    def _find_dir(self) -> Optional[Path]:
        d = Path(self.data_dir).expanduser()
        for candidate in (d / self.base_folder, d):
            if all((candidate / f).is_file() for f in self._all_files()):
                return candidate
        return None

    def _torchvision_class(self):
        from torchvision.datasets import CIFAR10

        return CIFAR10

    def prepare_data(self) -> None:
        if self.download and self._find_dir() is None:
            # downloads and extracts the whole archive (both splits), MD5-checked
            self._torchvision_class()(os.fspath(Path(self.data_dir).expanduser()), train=False, download=True)

    def load_split(self, split: str) -> Tuple[Tensor, Tensor]:
        folder = self._find_dir()
        if folder is None:
            expected = Path(self.data_dir).expanduser() / self.base_folder
            missing = [f for f in self._all_files() if not (expected / f).is_file()]
            raise DataNotFoundError(
                f"{self.name} not found: expected {expected}/{{{', '.join(self._all_files())}}} (missing: "
                f"{', '.join(missing)}), the python version from https://www.cs.toronto.edu/~kriz/cifar.html. "
                f"Set data.download=true to fetch it through torchvision into data_dir={self.data_dir!r}, or point "
                f"data.data_dir at the folder holding {self.base_folder}/."
            )
        parts = [read_cifar_pickle(folder / f, self.label_key) for f in self.files[split]]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        bad = (labels < 0) | (labels >= self.num_classes)
        if bad.any():
            raise ConfigError(f"{folder}: {split} labels outside 0..{self.num_classes - 1} (e.g. {labels[bad][0]})")
        return torch.from_numpy(images), torch.from_numpy(labels)


class CIFAR100DataModule(CIFAR10DataModule):
    """CIFAR-100 (100 fine classes); ``data_dir`` holds ``cifar-100-python/{train, test}``.
    Arguments as :class:`CIFAR10DataModule`."""

    num_classes = 100
    mean = (0.5071, 0.4865, 0.4409)
    std = (0.2673, 0.2564, 0.2762)
    name = "CIFAR-100"
    base_folder = "cifar-100-python"
    files = {"train": ["train"], "val": ["test"]}
    label_key = "fine_labels"

    def _torchvision_class(self):
        from torchvision.datasets import CIFAR100

        return CIFAR100
