"""What every datamodule of this library gives, and a base for datasets that fit in memory.

The contract (relied on by :class:`moco_lightning.MoCo` and by the evaluation callbacks):

- ``train_dataloader()``: pretraining batches ``([view_1, view_2], target, index)``, shuffled
  with a seeded sampler, ``drop_last=True``. With ``pretrain=False`` (offline linear evaluation):
  ``(augmented_image, target, index)``.
- ``val_dataloader()``: with ``pretrain=True`` the same two-view batches drawn from the held-out
  split with fixed per-batch seeds (a comparable validation loss); else ``(image, target, index)``
  with the evaluation transform.
- ``eval_train_dataloader()`` / ``eval_val_dataloader()``: the train and held-out splits with the
  evaluation transform (no augmentation), in order, nothing dropped: ``(image, target, index)``.
  The kNN monitor builds its bank from the first and classifies the second.
- attributes ``num_classes``, ``mean``, ``std``, ``image_size``, ``in_channels``.

Any datamodule honouring this contract works with the module and the callbacks; a datamodule of
your own needs only ``train_dataloader`` yielding ``([view_1, view_2], ...)`` to train MoCo.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any, Iterator, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from moco_lightning.errors import ConfigError
from moco_lightning.training.compat import augment_states_per_rank

from .selection import check_subset_size
from .transforms import ViewSettings, linear_eval_views


class SeededRandomSampler(Sampler[int]):
    """A random permutation per epoch, drawn from ``(seed, epoch)`` alone.

    The order does not depend on the global RNG, so a resumed run sees the same batches as an
    uninterrupted one. Lightning calls ``set_epoch`` at the start of every epoch.
    """

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class EpochPosition:
    """A training loader's position inside its epoch, ``(epoch, batches yielded, batch size)``, as Lightning saves
    and restores it (``state_dict`` / ``load_state_dict``), for :class:`ResumableDataLoader` and ``DaliLoader``.

    The position is counted where the training loop takes the batches (not in workers, which prefetch), and every
    rank yields the same number of batches (equal shards, ``drop_last``), so rank 0's state, the one Lightning
    writes, fits every rank. A state saved in another epoch than the one being started (a checkpoint written at the
    end of an epoch) skips nothing.
    """

    _yielded = 0  # batches handed out in the current epoch
    _resume_at: Optional[tuple] = None  # (epoch, batches, batch_size) from a checkpoint, not yet applied

    def current_epoch(self) -> int:
        raise NotImplementedError

    def epoch_samples(self) -> int:
        """The number of samples this loader's epoch orders (a changed training set changes the order)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {
            "epoch": self.current_epoch(),
            "batches": self._yielded,
            "batch_size": self.batch_size,
            "samples": self.epoch_samples(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume_at = (
            int(state_dict["epoch"]),
            int(state_dict["batches"]),
            {k: state_dict.get(k) for k in ("batch_size", "samples")},
        )

    def start_epoch(self) -> int:
        """Called as an epoch's batches start: the batches to skip (a resumed epoch's done ones, else 0)."""
        skip = 0
        if self._resume_at is not None:
            epoch, batches, saved = self._resume_at
            self._resume_at = None
            skip = batches if epoch == self.current_epoch() else 0
            now = {"batch_size": self.batch_size, "samples": self.epoch_samples()}
            changed = [k for k, v in saved.items() if v is not None and v != now[k]]
            if skip and changed:
                what = "; ".join(f"{k} {saved[k]} then, {now[k]} now" for k in changed)
                raise ConfigError(
                    f"the checkpoint was written mid-epoch ({skip} batches into it) and the training data changed "
                    f"({what}; batch_size is data.batch_size, the sample count follows data.train_subset): resuming "
                    "would train on other images than the interrupted epoch's rest; resume with the settings it was "
                    "written with, or from a checkpoint written at an epoch's end"
                )
        self._yielded = skip
        return skip


class ResumableDataLoader(EpochPosition, DataLoader):
    """A DataLoader that resumes mid-epoch (its state: :class:`EpochPosition`).

    Lightning saves the state of a training loader that has ``state_dict`` / ``load_state_dict`` in its checkpoints
    and loads it before the loader is iterated again. A resumed epoch then skips the batches the killed run had
    trained on (their indices only: nothing is loaded or decoded for them) and yields the rest, so with the seeded
    sampler (an order from ``(seed, epoch)``) and the augmentation generators saved with the datamodule, a run
    killed at any step and resumed trains on exactly the batches of the uninterrupted one. Without a state Lightning
    restarts an interrupted epoch from its first batch ("your dataloader is not resumable").
    No ``__init__``: Lightning re-creates loaders from their constructor arguments.
    """

    _skip = 0  # batches the index streams made for this epoch skip

    def current_epoch(self) -> int:
        return int(getattr(self.sampler, "epoch", 0))

    def epoch_samples(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator:  # type: ignore[override]
        # a generator: runs at the first batch, after Lightning's ``set_epoch`` (an iterator made earlier, as
        # Lightning's resume makes one before it sets the epoch, would prefetch the previous epoch's order)
        self._skip = self.start_epoch()
        try:  # the index streams made while the iterator is built skip (a worker iterator makes two)
            batches = super().__iter__()
        finally:
            self._skip = 0
        for batch in batches:
            self._yielded += 1
            yield batch

    @property
    def _index_sampler(self):  # what DataLoader's iterators draw indices from (the batch sampler here)
        return _SkipFirst(super()._index_sampler, self)


class _SkipFirst:
    """An index sampler whose passes skip ``loader._skip`` batches (non-zero only while a resumed epoch's iterator
    is being made).

    It holds the loader weakly: the loader's iterator holds this sampler, and a strong reference back would make a
    cycle that keeps the loader, its iterator and its worker processes alive until the cyclic garbage collector
    runs; worker processes forked meanwhile (the next loader's) inherited them, and printed "AssertionError: can
    only test a child process" when they collected them."""

    def __init__(self, inner: Any, loader: ResumableDataLoader) -> None:
        self.inner, self.loader = inner, weakref.ref(loader)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator:
        loader = self.loader()
        return itertools.islice(iter(self.inner), loader._skip if loader is not None else 0, None)


class ImageTensorDataset(Dataset):
    """uint8 images (N, C, H, W) held in memory, with targets: items ``(image, target, index)``."""

    def __init__(self, images: Tensor, targets: Tensor) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ConfigError(f"images must be a uint8 tensor (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(targets):
            raise ConfigError(f"{len(images)} images but {len(targets)} targets")
        self.images, self.targets = images, targets

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Tuple[Tensor, Tensor, int]:
        return self.images[i], self.targets[i], i

    def __getitems__(self, indices: Sequence[int]) -> "Batch":
        """A whole batch by tensor indexing (the DataLoader's fetcher calls this instead of one item at a time)."""
        index = torch.as_tensor(indices, dtype=torch.long)
        return Batch((self.images[index], self.targets[index], index))


class Batch(tuple):
    """``(images, targets, index)`` already stacked: what :meth:`ImageTensorDataset.__getitems__` returns."""


def collate(items: Any) -> Tuple[Tensor, Tensor, Tensor]:
    """The default collate, passing a :class:`Batch` through as a plain tuple."""
    return tuple(items) if isinstance(items, Batch) else torch.utils.data.default_collate(items)


class NormalizeCollate:
    """Collates uint8 image items into one normalised float batch (the evaluation transform)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], size: Optional[int] = None) -> None:
        self.mean = torch.tensor(mean).view(1, -1, 1, 1)
        self.std = torch.tensor(std).view(1, -1, 1, 1)
        self.size = size

    def __call__(self, items: list) -> Tuple[Tensor, Tensor, Tensor]:
        images, targets, index = collate(items)
        x = images.float().div_(255)
        if self.size is not None and x.shape[-1] != self.size:
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False)
        return (x - self.mean) / self.std, targets, index


class TwoViewDataModule(LightningDataModule):
    """What every datamodule of this library shares: the seeded sampler, the loaders, the views drawn batched on
    the batch's device, and each rank's augmentation generator (saved in checkpoints).

    Subclasses set ``num_classes``, ``mean``, ``std``, ``in_channels``, provide the loaders of the contract above
    and pass ``views``: a :class:`BatchViews` (or another module ``(uint8 batch, generator) -> list of views``)
    that :meth:`on_after_batch_transfer` applies to uint8 training batches; batches that arrive as float views
    (made in the workers) or evaluation batches pass through.
    """

    num_classes: int
    mean: Tuple[float, ...]
    std: Tuple[float, ...]
    in_channels: int

    def __init__(
        self,
        batch_size: int,
        image_size: int,
        num_workers: int,
        seed: int,
        pretrain: bool,
        views: Optional[torch.nn.Module],
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0 (0: load in the training process), got {num_workers}")
        self.batch_size, self.image_size, self.num_workers, self.seed = batch_size, image_size, num_workers, seed
        self.pretrain, self.views = pretrain, views
        self._generator: Optional[torch.Generator] = None
        self._generator_states: Optional[list] = None  # per rank, from a checkpoint

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if trainer is None or not (trainer.training or trainer.validating or trainer.sanity_checking):
            return batch
        images, targets, index = batch
        # raw: a uint8 batch, or the image folder's uint8 (global crops, local crops); else views made in the
        # workers (float) or an evaluation batch: passed through
        first = images[0] if isinstance(images, (list, tuple)) and len(images) == 2 else images
        if not (isinstance(first, Tensor) and first.dtype == torch.uint8) or self.views is None:
            return batch
        if trainer.training:
            views = self.views(images, self._train_generator(first.device))
        else:  # fixed views per batch, so the validation loss is comparable across epochs
            g = torch.Generator(device=first.device).manual_seed(self.seed + 7919 * int(index[0]))
            views = self.views(images, g)
        return (views if self.pretrain else views[0]), targets, index

    def state_dict(self) -> dict:
        """The augmentation generator's state of every rank (gathered: Lightning saves on every rank, rank 0 writes)."""
        from moco_lightning.modules.distributed import gather_objects

        g = self._generator
        mine = g.get_state() if g is not None else self._own_state()
        return {"augment_rng": gather_objects(mine)}

    def load_state_dict(self, state_dict: dict) -> None:
        self._generator_states = augment_states_per_rank(state_dict.get("augment_rng"))
        self._generator = None

    def _rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    def _own_state(self) -> Optional[Tensor]:
        states = self._generator_states
        return states[self._rank()] if states is not None and self._rank() < len(states) else None

    def _train_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            rank = self._rank()  # each rank its own stream
            self._generator = torch.Generator(device=device).manual_seed(self.seed + 1_000_003 * rank)
            state = self._own_state()
            if state is not None:  # resuming: this rank's stream continues where it was saved
                try:
                    self._generator.set_state(state.cpu())
                except RuntimeError:  # e.g. a GPU run resumed on a CPU: the state formats differ
                    warnings.warn(
                        "the checkpoint's augmentation RNG state does not fit this device; views restart from `seed`",
                        stacklevel=2,
                    )
            elif self._generator_states is not None:
                warnings.warn(
                    f"the checkpoint holds no augmentation RNG state for rank {rank} (it was saved by "
                    f"{len(self._generator_states)} process(es)): this rank's views restart from `seed`",
                    stacklevel=2,
                )
        return self._generator

    def _loader(
        self,
        ds: Dataset,
        sampler: Optional[Sampler] = None,
        drop_last: bool = False,
        collate_fn=None,
        persistent: bool = True,
    ) -> DataLoader:
        """``persistent``: keep the worker processes between epochs (the training and validation loaders, which
        Lightning makes once); an evaluation loader is made anew for each evaluation and iterated once."""
        return ResumableDataLoader(
            ds,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=drop_last,
            collate_fn=collate_fn or collate,
            num_workers=self.num_workers,
            persistent_workers=persistent and self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            # the workers' base seed from a generator of the loader's own: a DataLoader draws it from the global
            # RNG each time it starts an epoch, and a resumed epoch starts once more than the uninterrupted one did
            generator=torch.Generator().manual_seed(self.seed),
        )


class InMemoryDataModule(TwoViewDataModule):
    """Base for datasets held in memory as uint8 tensors; augmentation runs batched on the device.

    Subclasses set ``num_classes``, ``mean``, ``std``, ``in_channels``, pass their view ``settings`` (a
    :class:`~moco_lightning.datamodules.transforms.ViewSettings`) and implement :meth:`load_split` returning
    ``(images uint8 (N, C, H, W), targets int64 (N,))``.

    Args:
        batch_size: per device; pretraining drops the last partial batch.
        image_size: side of the views and of the evaluation images.
        num_workers: DataLoader workers (0: batches are cut from memory in the training process).
        seed: the sampler's order (from ``(seed, epoch)``) and the augmentation generator's start.
        pretrain: two-view batches (True) or the linear-evaluation views (random resized crop 0.08-1 + flip).
        local_views, local_size, local_scale: multi-crop (SwAV §3.2): small extra views for the query encoder
            (:class:`BatchViews`); ``local_size`` None: 96/224 of ``image_size``.
        train_subset, val_subset: the first N images of each split (None: all).
        holdout: the last N training images become the held-out split in place of the dataset's own (its test
            split): for selecting recipes and hyper-parameters without looking at the test split (None: off).
        supervised_min_scale: smallest crop area of the supervised training views (``pretrain=False``: linear
            evaluation, fine-tuning, training from scratch): 0.08 is the linear protocol's; 1.0 is flips only.
    """

    def __init__(
        self,
        settings: ViewSettings,
        batch_size: int = 256,
        image_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        pretrain: bool = True,
        local_views: int = 0,
        local_size: Optional[int] = None,
        local_scale: Tuple[float, float] = (0.05, 0.14),
        train_subset: Optional[int] = None,
        val_subset: Optional[int] = None,
        supervised_min_scale: float = 0.08,
        holdout: Optional[int] = None,
    ) -> None:
        for name, value in (("train_subset", train_subset), ("val_subset", val_subset), ("holdout", holdout)):
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be None (the whole split) or >= 1, got {value}")
        settings = settings.with_local_views(local_views, local_size, local_scale)
        views = (
            settings.batch_views(self.mean, self.std)
            if pretrain
            else linear_eval_views(image_size, self.mean, self.std, min_scale=supervised_min_scale)
        )
        super().__init__(batch_size, image_size, num_workers, seed, pretrain, views)
        self.view_settings = settings
        self.train_subset, self.val_subset, self.holdout = train_subset, val_subset, holdout
        self._splits: dict[str, ImageTensorDataset] = {}

    # --- what a subclass provides -----------------------------------------------------------
    def load_split(self, split: str) -> Tuple[Tensor, Tensor]:
        """``split`` is "train" or "val"; returns (uint8 images (N, C, H, W), int64 targets)."""
        raise NotImplementedError

    # --- Lightning hooks --------------------------------------------------------------------
    def setup(self, stage: Optional[str] = None) -> None:
        self._load_splits()
        if self.pretrain and len(self._splits["train"]) < self.batch_size:
            raise ConfigError(
                f"batch_size={self.batch_size} is larger than the {len(self._splits['train'])} training images "
                "(pretraining drops the last partial batch): lower batch_size or raise train_subset"
            )

    def train_dataloader(self) -> DataLoader:
        ds = self._splits["train"]
        return self._loader(ds, sampler=SeededRandomSampler(len(ds), self.seed), drop_last=True)

    def val_dataloader(self) -> DataLoader:
        if self.pretrain:
            return self._loader(self._splits["val"])
        return self.eval_val_dataloader()

    def eval_train_dataloader(self) -> DataLoader:
        return self._loader(self._splits["train"], collate_fn=self._eval_collate(), persistent=False)

    def eval_val_dataloader(self) -> DataLoader:
        return self._loader(self._splits["val"], collate_fn=self._eval_collate(), persistent=False)

    def split_dataset(self, split: str) -> ImageTensorDataset:
        """The ``"train"`` or ``"val"`` split as loaded (images uint8, targets), what the loaders draw from."""
        self._load_splits()
        return self._splits[split]

    # --- low-label training (LinearClassifier's label_fraction / labels_per_class) -------------------
    def train_targets(self) -> Tensor:
        """The targets of the training split (as loaded, after ``train_subset``)."""
        self._load_splits()
        return self._splits["train"].targets

    def select_train(self, indices: Tensor) -> None:
        """Keeps only these images of the training split (a labelled subset; positions in :meth:`train_targets`)."""
        self._load_splits()
        ds = self._splits["train"]
        indices = torch.as_tensor(indices, dtype=torch.long)
        check_subset_size(len(indices), self.batch_size)
        self._splits["train"] = ImageTensorDataset(ds.images[indices], ds.targets[indices])

    # --- helpers ----------------------------------------------------------------------------
    def _load_splits(self) -> None:
        """Loads "train" and "val" once each (cut to train_subset / val_subset) into ``self._splits``; with
        ``holdout`` the held-out split is the end of the training split, never the test split."""
        if self.holdout and not self._splits:
            images, targets = self.load_split("train")
            if self.holdout >= len(targets):
                raise ConfigError(
                    f"holdout={self.holdout} takes every one of the {len(targets)} training images: hold out fewer"
                )
            cut = len(targets) - self.holdout
            self._held_out = {"train": (images[:cut], targets[:cut]), "val": (images[cut:], targets[cut:])}
        for split, limit in (("train", self.train_subset), ("val", self.val_subset)):
            if split not in self._splits:
                images, targets = self._held_out[split] if self.holdout else self.load_split(split)
                if limit is not None:
                    images, targets = images[:limit], targets[:limit]
                self._splits[split] = ImageTensorDataset(images, targets.long())

    def _eval_collate(self) -> NormalizeCollate:
        return NormalizeCollate(self.mean, self.std, self.image_size)
