"""Image folders (ImageNet, Imagenette, your own photos): images decoded with PIL in DataLoader workers.

Layout (torchvision's ``ImageFolder``)::

    <data_dir>/train/<class>/*.jpg      pretraining, kNN bank, linear-probe training
    <data_dir>/val/<class>/*.jpg        validation (optional)

Images may sit in nested folders below each class folder. Unlabelled pretraining: ``train/`` holding
the images themselves (no class subfolders): targets are -1, ``num_classes`` is 0 and the evaluation
loaders raise (there is nothing to classify). Extensions: .jpg .jpeg .png .ppm .bmp .pgm .tif .tiff
.webp, any case; other files are ignored.

Every image becomes RGB (``in_channels=3``) or grayscale (``in_channels=1``) whatever its mode:
grayscale is replicated, palette images are expanded, images with transparency (RGBA, LA, palette +
transparency) are composited over white, 16-bit images are scaled to 8 bits (not clipped), CMYK
is converted.

Two ways to draw the training views (``augment_on``), same distributions:

- ``"workers"``: the whole per-image lightly transform (:mod:`~.transforms` presets) in the workers;
  batches arrive as two float views.
- ``"device"``: the workers decode and cut the two random resized crops (torchvision's sampling and
  PIL's antialiased resize, so the crop geometry is exactly the paper's) as uint8; flip, colour
  jitter, grayscale, blur, solarization and normalisation run batched on the batch's device
  (:class:`~.transforms.PerViewColour`) in ``on_after_batch_transfer``. The workers send a quarter of
  the bytes (uint8, not float32).
- ``"auto"`` (default): ``"device"`` when CUDA is available, else ``"workers"``.

Measured (``benchmarks/data_throughput.py --threads 1``, 500x375 JPEGs, 224-px views, moco_v2 preset,
a shared 2-core CPU): a worker spends 25.2 ms per image on the ``"workers"`` path (decode 1.9 ms +
two lightly views) and 6.5 ms on the ``"device"`` path (decode + two crops): 3.9x more images per
worker core once a GPU does the batched part. Without a GPU the batched part runs in the training
process (24.7 ms per image on the CPU), serially with the model, and ``"workers"`` was faster (64 vs
53-57 views/s with 0-2 workers): hence ``"auto"``. A third design, decoding and resizing the whole
image to a fixed square in the workers and cropping on the device (4.7 ms per image in the worker),
was not adopted: it squashes each image's aspect ratio before the crop's own aspect jitter and cuts
small crops from a 256-px copy instead of the full-resolution image.

Both are deterministic: every image's randomness is drawn from ``(seed, epoch, index)`` (the
sampler tags each index with its epoch), so the views do not depend on ``num_workers`` and a resumed
run sees the same views as an uninterrupted one.

A file that cannot be decoded makes the dataset check every file of its split and raise one error naming all
the unreadable ones. With ``skip_bad_images=True`` each is replaced by the next readable image *of the same
class* (the batch keeps its size, and no item is ever mislabelled), one warning is given per run,
:attr:`ImageFolderDataModule.bad_images` lists all files skipped so far (across workers) and the CLI reports
their count at the end.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from .base import InMemoryDataModule, SeededRandomSampler
from .transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Preset,
    ViewSettings,
    eval_transform,
    linear_eval_train_transform,
    linear_eval_views,
    random_resized_crop_box,
    view_settings,
)
from moco_lightning.errors import ConfigError, DataNotFoundError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


# --- finding the images -------------------------------------------------------------------------
def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMG_EXTENSIONS)


def _images_below(folder: Path) -> List[str]:
    found = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(os.path.join(root, f) for f in sorted(files) if _is_image(f))
    return found


def list_classes(root: Path) -> List[str]:
    """Class folder names of an image folder (sorted); [] for an unlabelled folder."""
    if not root.is_dir():
        raise DataNotFoundError(_layout_message(root, "does not exist or is not a folder"))
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def scan_image_folder(root: Path, classes: Optional[Sequence[str]] = None) -> Tuple[List[Tuple[str, int]], List[str]]:
    """Returns ``(samples [(path, target)], classes)``.

    Class subfolders give the targets (in sorted order, or the order of ``classes`` when given, so a
    val folder uses the train folder's indices); a folder with images and no subfolders is unlabelled
    (targets -1, classes []).
    """
    subdirs = list_classes(root)
    top_images = sorted(e.name for e in os.scandir(root) if e.is_file() and _is_image(e.name))
    if not subdirs:
        if not top_images:
            raise ConfigError(_layout_message(root, "holds no images (extensions: " + " ".join(IMG_EXTENSIONS) + ")"))
        return [(os.path.join(root, f), -1) for f in top_images], []
    if top_images:
        raise ConfigError(
            f"{root} holds both image files ({top_images[0]}, ...) and class folders ({subdirs[0]}, ...): put every "
            f"image in a class folder ({root}/<class>/*.jpg), or, for unlabelled pretraining, no folders at all"
        )
    if classes is None:
        classes = subdirs
    index = {c: i for i, c in enumerate(classes)}
    unknown = [d for d in subdirs if d not in index]
    if unknown:
        raise ConfigError(f"{root} has class folders the training folder lacks: {unknown[:5]}; the two must use the same class names")
    samples: List[Tuple[str, int]] = []
    for name in subdirs:
        files = _images_below(root / name)
        if not files:
            raise ConfigError(
                f"class folder {root / name} holds no images (extensions: {' '.join(IMG_EXTENSIONS)}): remove it or add "
                "its images, since an empty class would still count in num_classes"
            )
        samples.extend((f, index[name]) for f in files)
    return samples, list(classes)


def _layout_message(root: Path, problem: str) -> str:
    return (
        f"image folder {root} {problem}. Expected layout: <data_dir>/train/<class>/*.jpg and (optional) "
        "<data_dir>/val/<class>/*.jpg, as torchvision's ImageFolder (ImageNet: reorganise val with the usual "
        "valprep.sh; Imagenette: extract imagenette2-320.tgz); or <data_dir>/train/*.jpg for unlabelled pretraining."
    )


# --- reading one image ------------------------------------------------------------------------------
def to_mode(img: Image.Image, channels: int) -> Image.Image:
    """Any PIL image as 8-bit RGB (``channels=3``) or L (``channels=1``).

    16-bit and 32-bit integer images are scaled to 8 bits (PIL's ``convert`` would clip them to 255);
    transparency is composited over white; palettes are expanded.
    """
    target = "RGB" if channels == 3 else "L"
    mode = img.mode
    if mode.startswith("I;16") or mode == "I":
        a = np.asarray(img).astype(np.float64)
        if mode.startswith("I;16") or a.max(initial=0) > 255:  # 16-bit data
            a = a / 257.0
        img = Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), "L")
    elif mode == "F":
        a = np.asarray(img, dtype=np.float64)
        if a.max(initial=0) <= 1.0:  # a [0, 1] float image
            a = a * 255.0
        img = Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), "L")
    elif mode in ("RGBA", "LA", "La", "RGBa", "PA") or (mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    if img.mode != target:
        img = img.convert(target)
    return img


def find_bad_images(paths: Sequence[str], channels: int = 3) -> List[Tuple[str, BaseException]]:
    """Decodes every file (threads: PIL releases the GIL while decoding); returns ``[(path, error)]`` of those
    that fail, in order. Checking a whole split costs far less than a fix-and-rerun cycle per bad file."""
    from concurrent.futures import ThreadPoolExecutor

    def check(path: str) -> Optional[Tuple[str, BaseException]]:
        try:
            load_image(path, channels)
        except BadImageError as e:
            return path, e.cause
        return None

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return [r for r in pool.map(check, paths, chunksize=64) if r is not None]


def load_image(path: str, channels: int = 3) -> Image.Image:
    """Decodes ``path`` completely; any failure raises an error naming the file."""
    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            img.load()
        return to_mode(img, channels)
    except Exception as e:  # UnidentifiedImageError, truncated data (OSError), bad headers (SyntaxError)...
        raise BadImageError(path, e) from e


class BadImageError(RuntimeError):
    """Image files that cannot be decoded (corrupt, truncated, not an image): ``path``/``cause`` is the first,
    ``found`` all of them ``[(path, cause)]`` when the split was scanned."""

    def __init__(self, path: str, cause: Optional[BaseException] = None, found: Sequence[Tuple[str, BaseException]] = (),
                 scanned: int = 0) -> None:
        self.path, self.cause, self.found = path, cause, list(found) or [(path, cause)]
        if cause is None:  # re-raised from a DataLoader worker: the message alone
            super().__init__(path)
            return
        names = "; ".join(f"{p}: cannot be read as an image ({type(c).__name__}: {c})" for p, c in self.found)
        where = f" ({len(self.found)} unreadable of the {scanned} files of this split, all checked)" if scanned else ""
        super().__init__(f"{names}{where}. Delete or replace them, or set data.skip_bad_images=true to skip unreadable "
                         "images (each is replaced by a readable image of the same class, counted and reported)")


# --- what the workers make of an image --------------------------------------------------------------
def item_seed(seed: int, epoch: int, index: int, stream: int) -> int:
    """A 63-bit seed for one image's randomness; Python's tuple hash of ints is the same in every process."""
    return hash((seed, epoch, index, stream)) & (2**63 - 1)


class SeededPIL:
    """Runs a transform that draws from the global torch and numpy generators (torchvision, lightly) from
    a given seed. In the main process (``num_workers=0``) the generators' states are restored after."""

    def __init__(self, transform: Callable) -> None:
        self.transform = transform

    def __call__(self, img: Image.Image, seed: int) -> Any:
        in_worker = torch.utils.data.get_worker_info() is not None
        if not in_worker:
            torch_state, np_state = torch.default_generator.get_state(), np.random.get_state()
        torch.default_generator.manual_seed(seed)  # CPU generator only: leaves CUDA generators alone
        np.random.seed(seed % 2**32)
        try:
            return self.transform(img)
        finally:
            if not in_worker:
                torch.default_generator.set_state(torch_state)
                np.random.set_state(np_state)


class RandomCrops:
    """``n_views`` random resized crops (torchvision's sampling, PIL's antialiased bilinear resize) as uint8
    tensors: (n_views, C, size, size), or (C, size, size) for ``n_views=1``."""

    def __init__(self, size: int, scale: Tuple[float, float], n_views: int = 2) -> None:
        self.size, self.scale, self.n_views = size, scale, n_views

    def __call__(self, img: Image.Image, seed: int) -> Tensor:
        g = torch.Generator().manual_seed(seed)
        crops = []
        for _ in range(self.n_views):
            left, top, w, h = random_resized_crop_box(img.width, img.height, self.scale, g)
            crop = img.resize((self.size, self.size), Image.BILINEAR, box=(left, top, left + w, top + h))
            a = np.asarray(crop, dtype=np.uint8)
            crops.append(torch.from_numpy(a.reshape(self.size, self.size, -1).copy()).permute(2, 0, 1))
        return torch.stack(crops) if self.n_views > 1 else crops[0]


class Deterministic:
    """A transform without randomness (the evaluation transform)."""

    def __init__(self, transform: Callable) -> None:
        self.transform = transform

    def __call__(self, img: Image.Image, seed: int) -> Any:
        return self.transform(img)


class EpochTaggedSampler(SeededRandomSampler):
    """:class:`SeededRandomSampler` yielding ``(index, epoch)``: the dataset seeds each image's views from them."""

    def __iter__(self) -> Iterator[Tuple[int, int]]:  # type: ignore[override]
        epoch = self.epoch
        return ((i, epoch) for i in super().__iter__())


class ImageFileDataset(Dataset):
    """Image files -> ``(make(image, seed), target, index)``; items are ``index`` or ``(index, epoch)``.

    Args:
        samples: ``[(path, target)]``.
        make: ``(PIL image, seed) -> output`` (:class:`SeededPIL`, :class:`RandomCrops`, :class:`Deterministic`).
        channels: 3 (RGB) or 1 (L).
        seed, stream: with the epoch and index, the image's seed.
        skip_bad_images: replace an unreadable image by the next readable one *of the same class* (so no item is
            ever mislabelled) instead of raising; without it, the first unreadable file makes the dataset check
            all its files and raise one error naming every unreadable one.
        bad, warned: shared registries (datasets over the same files share ``bad``; a datamodule's datasets share
            ``warned``, so a run warns once); created when not given. Shared with the worker processes.
    """

    def __init__(
        self, samples: Sequence[Tuple[str, int]], make: Callable[[Image.Image, int], Any], channels: int = 3,
        seed: int = 0, stream: int = 0, skip_bad_images: bool = False, bad: Optional[Tensor] = None,
        warned: Optional[Tensor] = None,
    ) -> None:
        self.paths = [p for p, _ in samples]
        self.targets = torch.tensor([t for _, t in samples], dtype=torch.long)
        self.make, self.channels, self.seed, self.stream = make, channels, seed, stream
        self.skip_bad_images = skip_bad_images
        self.bad = bad if bad is not None else torch.zeros(len(self.paths), dtype=torch.bool).share_memory_()
        self.warned = warned if warned is not None else torch.zeros(1, dtype=torch.bool).share_memory_()

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, key: Union[int, Tuple[int, int]]) -> Tuple[Any, Tensor, int]:
        i, epoch = key if isinstance(key, tuple) else (key, 0)
        img = self._load(i)
        return self.make(img, item_seed(self.seed, epoch, i, self.stream)), self.targets[i], i

    def _load(self, i: int) -> Image.Image:
        if not self.skip_bad_images:
            try:
                return load_image(self.paths[i], self.channels)
            except BadImageError as e:
                raise BadImageError(e.path, e.cause, find_bad_images(self.paths, self.channels), len(self.paths)) from None
        n, target = len(self.paths), self.targets[i]
        for j in (i + step for step in range(n)):
            j %= n
            if self.bad[j] or self.targets[j] != target:  # a stand-in only from the same class: labels stay right
                continue
            try:
                return load_image(self.paths[j], self.channels)
            except BadImageError as e:
                self.bad[j] = True
                if not bool(self.warned[0]):
                    self.warned[0] = True
                    warnings.warn(
                        f"skip_bad_images: {e.path} cannot be read ({type(e.cause).__name__}: {e.cause}); it is replaced "
                        "by the next readable image of its class. Further unreadable images are skipped without a "
                        "warning; the datamodule's `bad_images` lists them, `bad_image_count` counts them, and the "
                        "run's final output reports them.", RuntimeWarning, stacklevel=2,
                    )
        what = f"class {int(target)}" if target >= 0 else "the folder"
        raise BadImageError(f"skip_bad_images: none of the images of {what} ({os.path.dirname(self.paths[i])}, ...) can "
                            "be read: there is no readable image of the same class to stand in for them")

    @property
    def bad_images(self) -> List[str]:
        return [self.paths[int(j)] for j in self.bad.nonzero().flatten()]


def _spread(samples: List[Tuple[str, int]], n: Optional[int]) -> List[Tuple[str, int]]:
    """``n`` evenly spaced samples of the sorted list, so a subset covers every class; all when ``n`` is None."""
    if n is None or n >= len(samples):
        return samples
    return [samples[int(i)] for i in np.linspace(0, len(samples) - 1, n)]


# --- the datamodule ---------------------------------------------------------------------------------
class ImageFolderDataModule(InMemoryDataModule):
    """An image folder for MoCo pretraining and evaluation (see :mod:`moco_lightning.datamodules.base`).

    Args:
        data_dir: folder holding ``train_dir`` and ``val_dir``.
        train_dir, val_dir: their names inside ``data_dir``. ``val_dir=None`` or a missing folder: no
            validation (``val_dataloader`` is empty, ``eval_val_dataloader`` raises).
        batch_size, seed, pretrain: see :class:`~moco_lightning.datamodules.base.InMemoryDataModule`.
        train_subset, val_subset: N files evenly spaced over the sorted list (so every class is kept).
        image_size: side of the views and of the evaluation centre crop.
        num_workers: decoding processes (0: in the main process).
        preset, min_scale, jitter_strength, blur: view augmentation (:mod:`~.transforms`).
        augment_on: ``"device"`` (crops in the workers, colour batched on the device), ``"workers"``
            (the whole lightly transform per image in the workers), or ``"auto"``: ``"device"`` when CUDA
            is available, else ``"workers"``. See the module docstring.
        in_channels: 3 (RGB) or 1 (grayscale); every image is converted.
        mean, std: normalisation (default: ImageNet's; for one channel their averages, 0.449 and 0.226).
        eval_resize: shorter side before the evaluation centre crop (default ``image_size / 0.875``).
        skip_bad_images: replace unreadable files by the next readable one, with one warning.
    """

    def __init__(
        self,
        data_dir: str,
        train_dir: str = "train",
        val_dir: Optional[str] = "val",
        batch_size: int = 256,
        image_size: int = 224,
        num_workers: int = 8,
        seed: int = 0,
        pretrain: bool = True,
        preset: Preset = "moco_v2",
        min_scale: Optional[float] = None,
        jitter_strength: float = 1.0,
        blur: Optional[bool] = None,
        augment_on: Literal["auto", "device", "workers"] = "auto",
        in_channels: Literal[1, 3] = 3,
        mean: Optional[Sequence[float]] = None,
        std: Optional[Sequence[float]] = None,
        eval_resize: Optional[int] = None,
        skip_bad_images: bool = False,
        train_subset: Optional[int] = None,
        val_subset: Optional[int] = None,
    ) -> None:
        if in_channels not in (1, 3):
            raise ConfigError(f"in_channels must be 1 (grayscale) or 3 (RGB), got {in_channels}")
        if augment_on not in ("auto", "device", "workers"):
            raise ConfigError(f"augment_on must be 'auto', 'device' or 'workers', got {augment_on!r}")
        if augment_on == "auto":  # batched colour ops pay off on a GPU; on CPUs the workers share them out
            augment_on = "device" if torch.cuda.is_available() else "workers"
        self.in_channels = in_channels
        gray_mean, gray_std = (0.449,), (0.226,)
        self.mean = tuple(mean) if mean is not None else (IMAGENET_MEAN if in_channels == 3 else gray_mean)
        self.std = tuple(std) if std is not None else (IMAGENET_STD if in_channels == 3 else gray_std)
        if len(self.mean) != in_channels or len(self.std) != in_channels:
            raise ConfigError(f"mean and std need {in_channels} values (in_channels={in_channels}), got {self.mean} and {self.std}")
        settings = view_settings(preset, image_size, min_scale=min_scale, jitter_strength=jitter_strength, blur=blur)
        super().__init__(
            batch_size=batch_size, image_size=image_size, num_workers=num_workers, seed=seed, pretrain=True,
            min_scale=settings.min_scale, jitter_prob=settings.jitter_prob, gray_prob=settings.gray_prob,
            blur_prob=settings.blur_prob[0], train_subset=train_subset, val_subset=val_subset,
        )
        self.view_settings: ViewSettings = settings
        self.data_dir, self.train_dir, self.val_dir = data_dir, train_dir, val_dir
        self.preset, self.augment_on, self.eval_resize = preset, augment_on, eval_resize
        self.skip_bad_images = skip_bad_images
        # built with pretrain=True, views replaced (see CIFAR10DataModule: base.py's pretrain=False views raise)
        self.pretrain = pretrain
        if augment_on == "device":
            # the workers crop; the device flips and colours (pretraining) or only flips (linear evaluation)
            self.views = settings.colour_views(self.mean, self.std) if pretrain else linear_eval_views(
                image_size, self.mean, self.std, min_scale=1.0
            )
        else:  # unused: the views are made in the workers
            self.views = settings.batch_views(self.mean, self.std) if pretrain else linear_eval_views(image_size, self.mean, self.std)
        self._classes: Optional[List[str]] = None
        self._eval_splits: dict[str, ImageFileDataset] = {}
        self._warned = torch.zeros(1, dtype=torch.bool).share_memory_()  # skip_bad_images warns once per run

    # --- folders and classes ------------------------------------------------------------------
    @property
    def train_root(self) -> Path:
        return Path(self.data_dir).expanduser() / self.train_dir

    @property
    def val_root(self) -> Optional[Path]:
        if self.val_dir is None:
            return None
        root = Path(self.data_dir).expanduser() / self.val_dir
        return root if root.is_dir() else None

    @property
    def classes(self) -> List[str]:
        """Class names (sorted folder names); [] for an unlabelled train folder."""
        if self._classes is None:
            self._classes = list_classes(self.train_root)
        return self._classes

    @property
    def num_classes(self) -> int:  # type: ignore[override]
        return len(self.classes)

    @property
    def labelled(self) -> bool:
        return self.num_classes > 0

    @property
    def bad_images(self) -> List[str]:
        """Files skipped so far (``skip_bad_images=True``), from every split and worker."""
        found = [p for ds in (*self._splits.values(), *self._eval_splits.values()) for p in ds.bad_images]
        return sorted(set(found))

    @property
    def bad_image_count(self) -> int:
        return len(self.bad_images)

    # --- datasets -----------------------------------------------------------------------------
    def _dataset(self, samples: Sequence[Tuple[str, int]], make: Callable, stream: int,
                 same_files: Optional[ImageFileDataset] = None) -> ImageFileDataset:
        bad = same_files.bad if same_files is not None else None  # one registry of unreadable files per file list
        return ImageFileDataset(samples, make, self.in_channels, self.seed, stream, self.skip_bad_images, bad,
                                self._warned)

    def _train_make(self) -> Callable:
        st = self.view_settings
        if self.pretrain:
            if self.augment_on == "device":
                return RandomCrops(self.image_size, (st.min_scale, 1.0), n_views=2)
            return SeededPIL(st.pil_views(self.mean, self.std))
        if self.augment_on == "device":
            return RandomCrops(self.image_size, (0.08, 1.0), n_views=1)
        return SeededPIL(linear_eval_train_transform(self.image_size, self.mean, self.std))

    def _eval_make(self) -> Callable:
        return Deterministic(eval_transform(self.image_size, self.mean, self.std, self.eval_resize))

    def setup(self, stage: Optional[str] = None) -> None:
        if "train" in self._splits:
            return
        train, classes = scan_image_folder(self.train_root)
        self._classes = classes
        if not classes and not self.pretrain:
            raise ConfigError(self._unlabelled_message("linear evaluation (pretrain=False)"))
        val: List[Tuple[str, int]] = []
        if self.val_root is not None:
            val, val_classes = scan_image_folder(self.val_root, classes if classes else None)
            if classes and not val_classes:
                raise ConfigError(
                    f"{self.val_root} holds images without class folders while {self.train_root} has classes: put the "
                    f"validation images in class folders ({self.val_root}/<class>/*.jpg; for ImageNet's flat val folder "
                    "use the usual valprep.sh), or set val_dir=null"
                )
            if not classes:  # unlabelled pretraining: val labels mean nothing to it
                val = [(p, -1) for p, _ in val]
        train, val = _spread(train, self.train_subset), _spread(val, self.val_subset)
        self._splits["train"] = self._dataset(train, self._train_make(), stream=0)
        if val:
            self._splits["val"] = self._dataset(val, self._train_make(), stream=1)
        self._eval_splits["train"] = self._dataset(train, self._eval_make(), stream=2, same_files=self._splits["train"])
        if val:
            self._eval_splits["val"] = self._dataset(val, self._eval_make(), stream=3, same_files=self._splits["val"])
        if self.pretrain and len(train) < self.batch_size:
            raise ConfigError(
                f"batch_size={self.batch_size} is larger than the {len(train)} training images in {self.train_root} "
                "(pretraining drops the last partial batch): lower batch_size or add images"
            )

    def _unlabelled_message(self, what: str) -> str:
        return (
            f"{self.train_root} holds images without class folders (unlabelled, num_classes=0): {what} needs labels. "
            f"Put the images in class folders ({self.train_root}/<class>/*.jpg), or drop the kNN / linear-probe callbacks "
            "for unlabelled pretraining."
        )

    # --- loaders -------------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        ds = self._splits["train"]
        return self._loader(ds, sampler=EpochTaggedSampler(len(ds), self.seed), drop_last=True)

    def val_dataloader(self) -> Union[DataLoader, List]:
        if not self.pretrain:
            return self.eval_val_dataloader()
        if "val" not in self._splits:
            return []  # no val folder: no validation
        return self._loader(self._splits["val"])

    def eval_train_dataloader(self) -> DataLoader:
        if not self.labelled:
            raise ConfigError(self._unlabelled_message("the evaluation loaders (kNN bank, linear probe)"))
        return self._loader(self._eval_splits["train"])

    def eval_val_dataloader(self) -> DataLoader:
        if not self.labelled:
            raise ConfigError(self._unlabelled_message("the evaluation loaders (kNN bank, linear probe)"))
        if "val" not in self._eval_splits:
            where = "val_dir=None" if self.val_dir is None else f"{Path(self.data_dir).expanduser() / self.val_dir} does not exist"
            raise ConfigError(f"no validation images ({where}): put them in <data_dir>/{self.val_dir or 'val'}/<class>/*.jpg")
        return self._loader(self._eval_splits["val"])

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not isinstance(batch[0], Tensor):  # views made in the workers
            return batch
        return super().on_after_batch_transfer(batch, dataloader_idx)

    def load_split(self, split: str) -> Tuple[Tensor, Tensor]:
        raise NotImplementedError("ImageFolderDataModule reads its images in the DataLoader workers")
