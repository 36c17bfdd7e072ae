"""Image folders (ImageNet, Imagenette, your own photos): decoded by a backend (:mod:`~.folder_backends`: PIL in
DataLoader workers, or DALI), the files listed by :func:`~.folder_samples.folder_samples`.

Layout (torchvision's ``ImageFolder``)::

    <data_dir>/train/<class>/*.jpg      pretraining, kNN bank, linear-probe training
    <data_dir>/val/<class>/*.jpg        validation (optional)

Images may sit in nested folders below each class folder. Unlabelled pretraining: ``train/`` holding the images
themselves (no class subfolders): targets are -1, ``num_classes`` is 0 and the evaluation loaders raise. Decoding,
unreadable files and the seeded per-image work: :mod:`~moco_lightning.datamodules.images`.

Two ways to draw the training views (``augment_on``), same distributions: ``"workers"``, the whole per-image
lightly transform (:mod:`~.transforms` presets) in the workers; ``"device"``, the workers cut the random resized
crops (torchvision's sampling, PIL's antialiased resize) as uint8 and flip, colour jitter, grayscale, blur,
solarization and normalisation run batched on the batch's device in ``on_after_batch_transfer`` (a quarter of the
bytes); ``"auto"`` (default): ``"device"`` with CUDA, else ``"workers"`` (why: benchmarks/README.md, "Image folders:
where the views are drawn"). Both are deterministic (every image's randomness comes from ``(seed, epoch, index)``):
the views do not depend on ``num_workers`` and a resumed run sees the views of an uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, List, Literal, Optional, Sequence, Tuple, Union

import torch

from moco_lightning.constants import default_normalisation
from moco_lightning.errors import ConfigError

from .base import TwoViewDataModule
from .device_views import PerViewColour
from .folder_backends import BACKENDS
from .folder_samples import folder_samples, list_classes, scan_image_folder, unlabelled_message  # noqa: F401
from .images import BadImageError, Deterministic, ImageFileDataset, RandomCrops, SeededPIL, load_image
from .loading import default_workers
from .pil_transforms import lightly_views
from .selection import check_subset_size
from .transforms import (
    Preset,
    ViewSettings,
    eval_transform,
    linear_eval_train_transform,
    linear_eval_views,
    view_settings,
)

__all__ = ["BadImageError", "ImageFolderDataModule", "default_workers", "load_image"]


# --- the datamodule ---------------------------------------------------------------------------------
class ImageFolderDataModule(TwoViewDataModule):
    """An image folder for MoCo pretraining and evaluation (see :mod:`moco_lightning.datamodules.base`).

    Args:
        data_dir: folder holding ``train_dir`` and ``val_dir``.
        train_dir, val_dir: their names inside ``data_dir``. ``val_dir=None`` or a missing folder: no
            validation (``val_dataloader`` is empty, ``eval_val_dataloader`` raises).
        batch_size, seed, pretrain: see :class:`~moco_lightning.datamodules.in_memory.InMemoryDataModule`.
        train_subset, val_subset: N files evenly spaced over the sorted list (so every class is kept).
        image_size: side of the views and of the evaluation centre crop.
        num_workers: decoding processes (0: in the main process; None: the CPUs this process may use less one for
            the training loop, at most 16: :func:`default_workers`).
        preset, min_scale, jitter_strength, blur: view augmentation (:mod:`~.transforms`).
        local_views, local_size, local_scale: multi-crop (SwAV §3.2: 6 views of 96 px, scale 0.05-0.14, at 224).
        backend: ``"pil"`` (DataLoader workers decode with PIL) or ``"dali"`` (NVIDIA DALI decodes and augments, on
            the GPU when there is one: :mod:`~moco_lightning.datamodules.dali`; ``num_workers`` is then its CPU
            thread count).
        dali_fused_crop: with ``backend="dali"``, each random-resized crop decodes only its window (ROI decoding)
            instead of cropping one whole decode per view: see ``benchmarks/data_throughput.py`` for when it pays.
        augment_on: ``"device"`` (crops in the workers, colour batched on the device), ``"workers"``
            (the whole lightly transform per image in the workers), or ``"auto"``: ``"device"`` when CUDA
            is available, else ``"workers"``. See the module docstring.
        in_channels: 3 (RGB) or 1 (grayscale); every image is converted.
        mean, std: normalisation (default: ImageNet's; for one channel their averages, 0.449 and 0.226).
        eval_resize: shorter side before the evaluation centre crop (default ``image_size / 0.875``).
        skip_bad_images: replace unreadable files by a readable image of the same class, with one warning.
        unlabelled_dirs: more folders of images for pretraining only (relative to ``data_dir`` or absolute; class
            folders in them are ignored): pretraining sees them beside ``train_dir``, while the kNN bank and the
            linear probe use the labelled ``train_dir`` and the queries ``val_dir`` (the usual case: many unlabelled
            images, a few labelled ones).
        holdout: a share (below 1) or a number (1 or more) of the labelled training images, drawn from every class
            alike (seeded by ``seed``), that become the held-out split in place of ``val_dir``: for choosing recipes
            without looking at ``val_dir``, or for a folder without one (None: off).
    """

    def __init__(
        self,
        data_dir: str,
        train_dir: str = "train",
        val_dir: Optional[str] = "val",
        batch_size: int = 256,
        image_size: int = 224,
        num_workers: Optional[int] = None,
        seed: int = 0,
        pretrain: bool = True,
        preset: Preset = "moco_v2",
        min_scale: Optional[float] = None,
        jitter_strength: float = 1.0,
        blur: Optional[bool] = None,
        local_views: int = 0,
        local_size: Optional[int] = None,
        local_scale: Tuple[float, float] = (0.05, 0.14),
        augment_on: Literal["auto", "device", "workers"] = "auto",
        backend: Literal["pil", "dali"] = "pil",
        dali_fused_crop: bool = False,
        in_channels: Literal[1, 3] = 3,
        mean: Optional[Sequence[float]] = None,
        std: Optional[Sequence[float]] = None,
        eval_resize: Optional[int] = None,
        skip_bad_images: bool = False,
        train_subset: Optional[int] = None,
        val_subset: Optional[int] = None,
        unlabelled_dirs: Sequence[str] = (),
        holdout: Optional[float] = None,
    ) -> None:
        if in_channels not in (1, 3):
            raise ConfigError(f"in_channels must be 1 (grayscale) or 3 (RGB), got {in_channels}")
        if augment_on not in ("auto", "device", "workers"):
            raise ConfigError(f"augment_on must be 'auto', 'device' or 'workers', got {augment_on!r}")
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        self.loading = BACKENDS[backend]  # how the files become batches: PIL workers or DALI pipelines
        augment_on = self.loading.augment_on(augment_on, dali_fused_crop)
        self.in_channels = in_channels
        self.mean = tuple(mean) if mean is not None else default_normalisation(in_channels)[0]
        self.std = tuple(std) if std is not None else default_normalisation(in_channels)[1]
        if len(self.mean) != in_channels or len(self.std) != in_channels:
            raise ConfigError(
                f"mean and std need {in_channels} values (in_channels={in_channels}), got {self.mean} and {self.std}"
            )
        settings = view_settings(preset, image_size, min_scale=min_scale, jitter_strength=jitter_strength, blur=blur)
        settings = settings.with_local_views(local_views, local_size, local_scale)
        if augment_on == "device":  # the workers crop; the device flips and colours (or, for evaluation, flips)
            views = (
                PerViewColour(settings, self.mean, self.std)
                if pretrain
                else linear_eval_views(image_size, self.mean, self.std, min_scale=1.0)
            )
        else:  # the views are made in the workers
            views = None
        workers = default_workers() if num_workers is None else num_workers
        super().__init__(batch_size, image_size, workers, seed, pretrain, views)
        self.view_settings: ViewSettings = settings
        self.data_dir, self.train_dir, self.val_dir = data_dir, train_dir, val_dir
        self.preset, self.augment_on, self.eval_resize, self.backend = preset, augment_on, eval_resize, backend
        self.dali_fused_crop = dali_fused_crop
        self.skip_bad_images, self.train_subset, self.val_subset = skip_bad_images, train_subset, val_subset
        self.unlabelled_dirs = list(unlabelled_dirs)
        if holdout is not None and holdout <= 0:
            raise ConfigError(f"holdout={holdout}: give a share of the training images (0-1) or a number of them")
        self.holdout = holdout
        self._classes: Optional[List[str]] = None
        self._splits: dict[str, ImageFileDataset] = {}
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
    def _dataset(
        self,
        samples: Sequence[Tuple[str, int]],
        make: Callable,
        stream: int,
        same_files: Optional[ImageFileDataset] = None,
    ) -> ImageFileDataset:
        bad = same_files.bad if same_files is not None else None  # one registry of unreadable files per file list
        return ImageFileDataset(
            samples, make, self.in_channels, self.seed, stream, self.skip_bad_images, bad, self._warned
        )

    def _train_make(self) -> Callable:
        st = self.view_settings
        if self.pretrain:
            if self.augment_on == "device":
                return RandomCrops(
                    self.image_size, (st.min_scale, 1.0), 2, st.local_views, st.local_size, st.local_scale
                )
            return SeededPIL(lightly_views(st, self.mean, self.std))
        if self.augment_on == "device":
            return RandomCrops(self.image_size, (0.08, 1.0), n_views=1)
        return SeededPIL(linear_eval_train_transform(self.image_size, self.mean, self.std))

    def _eval_make(self) -> Callable:
        return Deterministic(eval_transform(self.image_size, self.mean, self.std, self.eval_resize))

    def setup(self, stage: Optional[str] = None) -> None:
        if "train" in self._splits:
            return
        root = Path(self.data_dir).expanduser()
        train, val, pretrain_on, self._classes = folder_samples(
            self.train_root, self.val_root, pretrain=self.pretrain, holdout=self.holdout, seed=self.seed,
            train_subset=self.train_subset, val_subset=self.val_subset,
            unlabelled_roots=[root / folder for folder in self.unlabelled_dirs],  # an absolute folder stays itself
        )  # fmt: skip
        self._splits["train"] = self._dataset(pretrain_on, self._train_make(), stream=0)
        if val:
            self._splits["val"] = self._dataset(val, self._train_make(), stream=1)
        labelled_files = self._splits["train"] if pretrain_on is train else None  # one registry of bad files per list
        self._eval_splits["train"] = self._dataset(train, self._eval_make(), stream=2, same_files=labelled_files)
        if val:
            self._eval_splits["val"] = self._dataset(val, self._eval_make(), stream=3, same_files=self._splits["val"])
        if self.pretrain and len(pretrain_on) < self.batch_size:
            raise ConfigError(
                f"batch_size={self.batch_size} is larger than the {len(pretrain_on)} training images in "
                f"{self.train_root} (pretraining drops the last partial batch): lower batch_size or add images"
            )

    # --- label subsets (evaluate's label budgets, LinearClassifier's label_fraction) -------------
    def train_targets(self) -> torch.Tensor:
        """The class of every training image (after ``train_subset``), in the order :meth:`select_train` indexes."""
        self.setup()
        return self._splits["train"].targets.clone()

    def select_train(self, indices: Sequence[int]) -> None:
        """Keeps only these training images (positions in :meth:`train_targets`): a labelled subset."""
        self.setup()
        ds = self._splits["train"]
        chosen = torch.as_tensor(indices, dtype=torch.long).tolist()
        check_subset_size(len(chosen), self.batch_size)
        samples = [(ds.paths[i], int(ds.targets[i])) for i in chosen]
        self._splits["train"] = self._dataset(samples, self._train_make(), stream=0)
        self._eval_splits["train"] = self._dataset(
            samples, self._eval_make(), stream=2, same_files=self._splits["train"]
        )

    # --- loaders (the backend's) --------------------------------------------------------------
    def train_dataloader(self) -> Any:
        return self.loading.loader(self, self._splits["train"], "train")

    def val_dataloader(self) -> Union[Any, List]:
        if not self.pretrain:
            return self.eval_val_dataloader()
        if "val" not in self._splits:
            return []  # no val folder: no validation
        return self.loading.loader(self, self._splits["val"], "val")

    def eval_train_dataloader(self) -> Any:
        if not self.labelled:
            raise ConfigError(unlabelled_message(self.train_root, "the evaluation loaders (kNN bank, linear probe)"))
        return self.loading.loader(self, self._eval_splits["train"], "eval")

    def eval_val_dataloader(self) -> Any:
        if not self.labelled:
            raise ConfigError(unlabelled_message(self.train_root, "the evaluation loaders (kNN bank, linear probe)"))
        if "val" not in self._eval_splits:
            missing = f"{Path(self.data_dir).expanduser() / str(self.val_dir)} does not exist"
            where = "val_dir=None" if self.val_dir is None else missing
            raise ConfigError(
                f"no validation images ({where}): put them in <data_dir>/{self.val_dir or 'val'}/<class>/*.jpg"
            )
        return self.loading.loader(self, self._eval_splits["val"], "eval")

    def dali_train_loader(self, device: torch.device) -> Any:
        """The pretraining loader of ``backend="dali"`` with its pipeline on ``device`` (after ``setup``; without a
        trainer the loader would run a CPU pipeline): what a benchmark times outside a fit."""
        return BACKENDS["dali"].loader(self, self._splits["train"], "train", device=device)
