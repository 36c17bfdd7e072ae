"""Which files an image folder trains and validates on: a pure function of the folders and the settings.

:func:`folder_samples` lists ``(path, class)`` pairs: the labelled training images, the held-out ones (``val_dir``,
or ``holdout`` of the training images drawn alike from every class), the evenly spread subsets, and the unlabelled
folders added to pretraining only. It reads the folders' listings, never an image.

Layout (torchvision's ``ImageFolder``): ``<root>/<class>/**/*.jpg``; a folder of images without class folders is
unlabelled (targets -1). Extensions: .jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp, any case.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from moco_lightning.errors import ConfigError, DataNotFoundError

from .selection import balanced_subset

Samples = List[Tuple[str, int]]

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


def scan_image_folder(
    root: Path, classes: Optional[Sequence[str]] = None, allow_empty: bool = False
) -> Tuple[List[Tuple[str, int]], List[str]]:
    """Returns ``(samples [(path, target)], classes)``.

    Class subfolders give the targets (in sorted order, or the order of ``classes`` when given, so a
    val folder uses the train folder's indices); a folder with images and no subfolders is unlabelled
    (targets -1, classes []). An empty class folder is refused (a class without images would still count among the
    classes a classifier is trained on), unless ``allow_empty`` (embedding: it just has no rows).
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
        raise ConfigError(
            f"{root} has class folders the training folder lacks: {unknown[:5]}; the two must use the same class names"
        )
    samples: List[Tuple[str, int]] = []
    for name in subdirs:
        files = _images_below(root / name)
        if not files and not allow_empty:
            raise ConfigError(
                f"class folder {root / name} holds no images (extensions: {' '.join(IMG_EXTENSIONS)}): remove it "
                "or add "
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


def spread(samples: List[Tuple[str, int]], n: Optional[int]) -> List[Tuple[str, int]]:
    """``n`` evenly spaced samples of the sorted list, so a subset covers every class; all when ``n`` is None."""
    if n is None or n >= len(samples):
        return samples
    return [samples[int(i)] for i in np.linspace(0, len(samples) - 1, n)]


class FolderSamples(NamedTuple):
    """The files of each split: ``train`` (labelled, or target -1 without class folders), ``val`` (held out),
    ``pretrain`` (``train`` and the unlabelled folders' images) and the ``classes`` (sorted folder names)."""

    train: Samples
    val: Samples
    pretrain: Samples
    classes: List[str]


def folder_samples(
    train_root: Path,
    val_root: Optional[Path],
    *,
    pretrain: bool = True,
    holdout: Optional[float] = None,
    seed: int = 0,
    train_subset: Optional[int] = None,
    val_subset: Optional[int] = None,
    unlabelled_roots: Sequence[Path] = (),
) -> FolderSamples:
    """The samples of an image folder (see the module docstring); ``val_root`` None: no validation folder."""
    train, classes = scan_image_folder(train_root)
    if not classes and not pretrain:
        raise ConfigError(unlabelled_message(train_root, "linear evaluation (pretrain=False)"))
    val: Samples = []
    if val_root is not None:
        val, val_classes = scan_image_folder(val_root, classes if classes else None)
        if classes and not val_classes:
            raise ConfigError(
                f"{val_root} holds images without class folders while {train_root} has classes: put the validation "
                f"images in class folders ({val_root}/<class>/*.jpg; for ImageNet's flat val folder use the usual "
                "valprep.sh), or set val_dir=null"
            )
        if not classes:  # unlabelled pretraining: val labels mean nothing to it
            val = [(p, -1) for p, _ in val]
    if holdout is not None:
        train, val = held_out(train, classes, holdout, seed, train_root)
    train, val = spread(train, train_subset), spread(val, val_subset)
    unlabelled = [(p, -1) for root in unlabelled_roots for p, _ in scan_unlabelled(root)]
    return FolderSamples(train, val, train + unlabelled if pretrain else train, classes)


def held_out(
    train: Samples, classes: List[str], holdout: float, seed: int, train_root: Path
) -> Tuple[Samples, Samples]:
    """``(training, held-out)`` images: ``holdout`` (a share below 1, else a number) of the labelled training
    images, the same share of each class, drawn with ``seed``."""
    targets = torch.tensor([t for _, t in train])
    if not len(targets) or (targets < 0).any():
        raise ConfigError(f"holdout={holdout}: {train_root} has no class folders to hold images out of")
    share = holdout if holdout < 1 else holdout / len(targets)
    held = set(balanced_subset(targets, fraction=min(share, 1.0), seed=seed).tolist())
    kept = {t for i, (_, t) in enumerate(train) if i not in held}
    if kept != set(targets.tolist()):
        emptied = classes[min(set(targets.tolist()) - kept)]
        raise ConfigError(f"holdout={holdout} leaves class {emptied!r} without training images: hold out fewer")
    return [s for i, s in enumerate(train) if i not in held], [s for i, s in enumerate(train) if i in held]


def scan_unlabelled(root: Path) -> Samples:
    """The images under ``root``, whatever folders they sit in (an ``unlabelled_dirs`` entry)."""
    if not root.is_dir():
        raise ConfigError(f"unlabelled_dirs: {root} is not a folder; give folders of images")
    return scan_image_folder(root)[0]


def unlabelled_message(train_root: Path, what: str) -> str:
    """Why ``what`` cannot run on a train folder without class folders, and what to do."""
    return (
        f"{train_root} holds images without class folders (unlabelled, num_classes=0): {what} needs labels. Put the "
        f"images in class folders ({train_root}/<class>/*.jpg), or drop the kNN / linear-probe callbacks for "
        "unlabelled pretraining."
    )
