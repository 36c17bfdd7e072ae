"""What every datamodule of this library shares: :class:`TwoViewDataModule`, its base.

The contract a datamodule meets is written once, as ``typing.Protocol`` classes, in
:mod:`moco_lightning.data_contract` (training batches of views; evaluation loaders and ``num_classes``; label
budgets; ``mean``, ``std``, ``image_size``, ``in_channels``); every datamodule here meets all of it, and a fit checks
what its callbacks read at its start. Training batches are ``([view_1, view_2, *local_views], target, index)``,
shuffled with a seeded sampler, ``drop_last=True`` (with ``pretrain=False``: ``(augmented_image, target, index)``);
``val_dataloader()`` gives the same views of the held-out split with fixed per-batch seeds (a comparable validation
loss); ``eval_train_dataloader()`` / ``eval_val_dataloader()`` the splits with the evaluation transform, in order,
nothing dropped. A datamodule of your own needs only ``train_dataloader`` yielding ``([view_1, view_2], ...)`` to
train MoCo.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Tuple

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from moco_lightning.errors import ConfigError

from .loading import Batch, EpochPosition, ResumableDataLoader, SeededRandomSampler, collate  # noqa: F401


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

    def predict_dataloader(self) -> Any:
        """``trainer.predict(model, datamodule=dm)``: the evaluation split's images as the encoder sees them in
        evaluation (normalised: features of held-out images, ``eval_val_dataloader``)."""
        return self.eval_val_dataloader()

    def state_dict(self) -> dict:
        """The augmentation generator's state of every rank (gathered: Lightning saves on every rank, rank 0 writes)."""
        from moco_lightning.modules.distributed import gather_objects

        g = self._generator
        mine = g.get_state() if g is not None else self._own_state()
        return {"augment_rng": gather_objects(mine)}

    def load_state_dict(self, state_dict: dict) -> None:
        self._generator_states = state_dict.get("augment_rng")  # one per rank
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
            elif self._generator_states is not None and rank >= len(self._generator_states):
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
