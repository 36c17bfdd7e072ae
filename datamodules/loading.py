"""Resumable, seeded loading shared by every datamodule: the seeded sampler, the loader that resumes mid-epoch at
the batch it stopped at, and the collate that passes pre-stacked batches through."""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Iterator, Optional, Tuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Sampler

from moco_lightning.errors import ConfigError


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
        try:
            for batch in batches:
                self._yielded += 1
                yield batch
        finally:  # an error (a worker's too) or a loop stopped early: the workers go now, not when collected
            shut_down_workers(batches)

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


def shut_down_workers(iterator: Any) -> None:
    """Stops the worker processes of a ``DataLoader`` iterator now (a no-op for other iterators, an ended one and
    persistent workers, which the loader reuses).

    Called on the way out of a loop over a loader, error or not. After a worker's error the iterator sits in the cycle
    of the exception's traceback, and left to the garbage collector torch's shutdown met its queues already closed
    and waited 5 s (``MP_STATUS_CHECK_INTERVAL``) for each worker before killing it: an error came 5 s late.
    ``_shutdown_workers`` is torch's own shutdown (an iterator has no public ``close``)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None and not getattr(iterator, "_persistent_workers", False):
        shutdown()


class Batch(tuple):
    """``(images, targets, index)`` already stacked: what :meth:`ImageTensorDataset.__getitems__` returns."""


def collate(items: Any) -> Tuple[Tensor, Tensor, Tensor]:
    """The default collate, passing a :class:`Batch` through as a plain tuple."""
    return tuple(items) if isinstance(items, Batch) else torch.utils.data.default_collate(items)


def default_workers() -> int:
    """Decoding processes for this machine: the CPUs this process may use, less one for the training loop (at least
    1, at most 16)."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(16, max(1, cpus - 1))
