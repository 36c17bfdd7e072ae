"""Fashion-MNIST (Xiao et al. 2017, https://arxiv.org/abs/1708.07747): 60 000 + 10 000 grayscale 28x28 images,
10 classes.

The library's offline default. The four IDX files are read from ``data_dir`` when given, else from
Debian's ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``), else downloaded
through torchvision when ``download=True``.
"""

from __future__ import annotations

import functools
import gzip
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from moco_lightning.errors import ConfigError, DataNotFoundError

from .in_memory import InMemoryDataModule
from .transforms import view_settings

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: Path) -> np.ndarray:
    """Reads an IDX file (LeCun's MNIST format), gzip-compressed or not, as a read-only array.

    A process reads each file once (``evaluate``'s label budgets, a notebook's datamodules, a test's runs): the
    decompressed array is kept, keyed on the file's path, size and modification time, so a replaced file is read again.
    """
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as e:
        raise _unreadable(path, e) from None
    return _read_idx(str(path), stat.st_size, stat.st_mtime_ns)


def _unreadable(path: Path, error: Exception) -> ConfigError:
    return ConfigError(f"{path}: cannot be read as an IDX file ({error}); delete it and get the dataset again")


@functools.lru_cache(maxsize=8)  # Fashion-MNIST's four files, twice over
def _read_idx(name: str, size: int, mtime_ns: int) -> np.ndarray:
    path = Path(name)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise _unreadable(path, e) from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ConfigError(f"{path}: not an unsigned-byte IDX file (bad magic number)")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    start = 4 + 4 * ndim
    if len(data) - start != int(np.prod(shape)):
        raise ConfigError(f"{path}: truncated or corrupt (header says {shape}, {len(data) - start} bytes of data)")
    return np.frombuffer(data, dtype=np.uint8, offset=start).reshape(shape)


class FashionMNISTDataModule(InMemoryDataModule):
    """Fashion-MNIST for MoCo pretraining and evaluation (see :mod:`moco_lightning.datamodules.base`).

    Args:
        data_dir: folder holding the four IDX files (``.gz`` or not; also looked for in
            ``<data_dir>/FashionMNIST/raw``). None: Debian's package location.
        download: download through torchvision into ``data_dir`` when the files are missing.
        min_scale: smallest area fraction of the random resized crop (0.2: MoCo's).
        jitter_strength: brightness and contrast jitter (0.4: MoCo's); saturation and hue are no-ops on one channel.
        jitter_prob: probability of colour jitter (v2: 0.8).
        translate: random translation by up to this many pixels (pad-and-crop, zero-filled).
        rotation: random rotation by up to this many degrees.
        erase_prob: probability of random erasing (one rectangle of 2-33 % of the image).
        blur_prob: probability of Gaussian blur (off by default at 28 px, as the official CIFAR demo), with
            ``blur_sigma``: its sigma range in pixels of the 28-px image.
        **kwargs: batch size, workers, seed, multi-crop, subsets: see
            :class:`~moco_lightning.datamodules.in_memory.InMemoryDataModule`.
    """

    num_classes = 10
    mean = (0.2860,)
    std = (0.3530,)
    in_channels = 1

    def __init__(
        self,
        data_dir: Optional[str] = None,
        download: bool = False,
        image_size: int = 28,
        min_scale: float = 0.2,
        jitter_strength: float = 0.4,
        jitter_prob: float = 0.8,
        translate: int = 0,
        rotation: float = 0.0,
        erase_prob: float = 0.0,
        blur_prob: float = 0.0,
        blur_sigma: Tuple[float, float] = (0.1, 1.0),
        **kwargs: Any,
    ) -> None:
        if jitter_strength < 0:
            raise ConfigError(f"jitter_strength must be >= 0 (0.4: MoCo's), got {jitter_strength}")
        # the moco_v2 preset (no blur, no grayscale on one channel) with the strengths given here
        settings = view_settings(
            "moco_v2",
            image_size,
            min_scale=min_scale,
            jitter_strength=jitter_strength / 0.4,
            jitter_prob=jitter_prob,
            blur=False,
        )
        if not 0 <= blur_prob <= 1 or not 0 < blur_sigma[0] <= blur_sigma[1]:
            raise ConfigError(
                f"blur_prob must be in [0, 1] and 0 < blur_sigma[0] <= blur_sigma[1]; got {blur_prob}, "
                f"{tuple(blur_sigma)}"
            )
        settings = replace(
            settings,
            translate=translate,
            rotation=rotation,
            erase_prob=erase_prob,
            blur_prob=(float(blur_prob),) * 2,
            blur_sigma=tuple(float(v) * 224 / image_size for v in blur_sigma),  # ViewSettings: pixels at 224
        )
        super().__init__(settings, image_size=image_size, **kwargs)
        self.data_dir, self.download = data_dir, download

    def prepare_data(self) -> None:
        if self.download and self._find_dir() is None:
            from torchvision.datasets import FashionMNIST

            root = self.data_dir or os.path.join(os.path.expanduser("~"), ".cache", "moco_lightning")
            FashionMNIST(root, train=True, download=True)
            FashionMNIST(root, train=False, download=True)
            self.data_dir = root

    def load_split(self, split: str) -> Tuple[Tensor, Tensor]:
        folder = self._find_dir()
        if folder is None:
            where = f"data_dir={self.data_dir!r}" if self.data_dir else f"{DEBIAN_DIR} (the default)"
            raise DataNotFoundError(
                f"Fashion-MNIST not found in {where}: expected the four IDX files "
                f"{', '.join(f + '.gz' for pair in FILES.values() for f in pair)}. Get them offline with "
                "`apt-get install dataset-fashion-mnist` (Debian), or set data.download=true to fetch them "
                "through torchvision, or point data.data_dir at a folder holding them."
            )
        image_file, label_file = (self._file(folder, name) for name in FILES[split])
        images, labels = read_idx(image_file), read_idx(label_file)
        if len(images) != len(labels):
            raise ConfigError(f"{image_file} has {len(images)} images but {label_file} has {len(labels)} labels")
        return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))

    def _candidates(self) -> list[Path]:
        if self.data_dir is None:
            return [Path(DEBIAN_DIR)]
        d = Path(self.data_dir)
        return [d, d / "raw", d / "FashionMNIST" / "raw"]

    def _find_dir(self) -> Optional[Path]:
        for d in self._candidates():
            if all(self._file(d, name) is not None for pair in FILES.values() for name in pair):
                return d
        return None

    @staticmethod
    def _file(folder: Path, name: str) -> Optional[Path]:
        for candidate in (folder / (name + ".gz"), folder / name):
            if candidate.is_file():
                return candidate
        return None
