"""Image files for the image-folder datamodules: decoding any of them, unreadable files, and the seeded per-image
work done in DataLoader workers (finding them: :mod:`~.folder_samples`).

- Every image becomes RGB (``channels=3``) or grayscale (``channels=1``) whatever its mode: grayscale is
  replicated, palette images are expanded, images with transparency are composited over white, 16-bit images are
  scaled to 8 bits (not clipped), CMYK is converted.
- A file that cannot be decoded makes :class:`ImageFileDataset` check every file of its split and raise one error
  naming all the unreadable ones; with ``skip_bad_images`` each is replaced by the next readable image *of the
  same class* (so no item is ever mislabelled), counted in a registry shared with the worker processes.
- Every image's randomness is drawn from ``(seed, epoch, index, stream)`` (:func:`item_seed`; the sampler tags
  each index with its epoch), so the views do not depend on ``num_workers`` and a resumed run sees the same views.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from moco_lightning.errors import BadInputError

from .device_views import random_resized_crop_box
from .folder_samples import IMG_EXTENSIONS, list_classes, scan_image_folder, spread  # noqa: F401
from .loading import SeededRandomSampler


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


class BadImageError(BadInputError):
    """Image files that cannot be decoded (corrupt, truncated, not an image): ``path``/``cause`` is the first,
    ``found`` all of them ``[(path, cause)]`` when the split was scanned."""

    #: how the message says to skip them, in a config; :meth:`for_option` names a command's own flag instead
    REMEDY = "set data.skip_bad_images=true"

    def __init__(
        self,
        path: str,
        cause: Optional[BaseException] = None,
        found: Sequence[Tuple[str, BaseException]] = (),
        scanned: int = 0,
    ) -> None:
        self.path, self.cause, self.found = path, cause, list(found) or [(path, cause)]
        if cause is None:  # re-raised from a DataLoader worker: the message alone, without the worker's traceback
            if "Original Traceback" in path:
                last = [line for line in path.splitlines() if line.strip()][-1]
                path = last.split("BadImageError: ", 1)[-1]
            super().__init__(path)
            return
        names = "; ".join(f"{p}: cannot be read as an image ({type(c).__name__}: {c})" for p, c in self.found)
        where = f" ({len(self.found)} unreadable of the {scanned} files of this split, all checked)" if scanned else ""
        super().__init__(
            f"{names}{where}. Delete or replace them, or {self.REMEDY} to skip unreadable "
            "images (each is replaced by a readable image of the same class, counted and reported)"
        )

    def for_option(self, option: str) -> str:
        """The message, telling to pass a command's ``option`` (``--skip_bad_images``) instead of the config key."""
        return str(self).replace(self.REMEDY, f"pass {option}")


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
    tensors: (n_views, C, size, size), or (C, size, size) for ``n_views=1``; with ``local_views``, the tuple
    ``(global crops, (local_views, C, local_size, local_size) local crops)``."""

    def __init__(
        self,
        size: int,
        scale: Tuple[float, float],
        n_views: int = 2,
        local_views: int = 0,
        local_size: int = 0,
        local_scale: Tuple[float, float] = (0.05, 0.14),
    ) -> None:
        self.size, self.scale, self.n_views = size, scale, n_views
        self.local_views, self.local_size, self.local_scale = local_views, local_size, local_scale

    def __call__(self, img: Image.Image, seed: int) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        g = torch.Generator().manual_seed(seed)
        crops = torch.stack(self._crops(img, g, self.n_views, self.size, self.scale))
        crops = crops if self.n_views > 1 else crops[0]
        if not self.local_views:
            return crops
        return crops, torch.stack(self._crops(img, g, self.local_views, self.local_size, self.local_scale))

    @staticmethod
    def _crops(img: Image.Image, g: torch.Generator, n: int, size: int, scale: Tuple[float, float]) -> List[Tensor]:
        out = []
        for _ in range(n):
            left, top, w, h = random_resized_crop_box(img.width, img.height, scale, g)
            crop = img.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
            a = np.asarray(crop, dtype=np.uint8)
            out.append(torch.from_numpy(a.reshape(size, size, -1).copy()).permute(2, 0, 1))
        return out


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
        self,
        samples: Sequence[Tuple[str, int]],
        make: Callable[[Image.Image, int], Any],
        channels: int = 3,
        seed: int = 0,
        stream: int = 0,
        skip_bad_images: bool = False,
        bad: Optional[Tensor] = None,
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
                raise self.scanned(e) from None
        return self.stand_in(i)[1]

    def scanned(self, e: BadImageError) -> BadImageError:
        """``e`` with every unreadable file of the split named (the whole split checked once)."""
        return BadImageError(e.path, e.cause, find_bad_images(self.paths, self.channels), len(self.paths))

    def stand_in(self, i: int) -> Tuple[int, Image.Image]:
        """``(j, image j)``: image ``i``, or, when it cannot be read, the next readable image *of its class*
        (``skip_bad_images``: each unreadable file is marked in the shared registry; the first one warns)."""
        n, target = len(self.paths), self.targets[i]
        for j in (i + step for step in range(n)):
            j %= n
            if self.bad[j] or self.targets[j] != target:  # a stand-in only from the same class: labels stay right
                continue
            try:
                return j, load_image(self.paths[j], self.channels)
            except BadImageError as e:
                self.bad[j] = True
                if not bool(self.warned[0]):
                    self.warned[0] = True
                    warnings.warn(
                        f"skip_bad_images: {e.path} cannot be read ({type(e.cause).__name__}: {e.cause}); it is "
                        "replaced "
                        "by the next readable image of its class. Further unreadable images are skipped without a "
                        "warning; the datamodule's `bad_images` lists them, `bad_image_count` counts them, and the "
                        "run's final output reports them.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        what = f"class {int(target)}" if target >= 0 else "the folder"
        raise BadImageError(
            f"skip_bad_images: none of the images of {what} ({os.path.dirname(self.paths[i])}, ...) can "
            "be read: there is no readable image of the same class to stand in for them"
        )

    @property
    def bad_images(self) -> List[str]:
        return [self.paths[int(j)] for j in self.bad.nonzero().flatten()]
