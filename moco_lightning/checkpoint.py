"""What a moco-lightning checkpoint holds besides the weights, and the checks made when one is loaded.

- ``checkpoint["moco_lightning"]``: the checkpoint format version, the library version that wrote it, and the
  global RNG states (torch, numpy, Python, CUDA) of **every** rank, so that a resumed run continues each rank's
  own random stream. Only rank 0 writes the file, so the states are gathered from all ranks while saving
  (Lightning saves on every rank: ``Trainer.save_checkpoint`` must be called on all of them).
- Format 1 (moco-lightning 0.1.0) held rank 0's states only; it is still read.
"""

from __future__ import annotations

import random
import warnings
from typing import Any, Iterable, Mapping, Optional

import numpy as np
import torch

from . import __version__
from .distributed import gather_objects, rank, world_size
from .errors import ConfigError

FORMAT_VERSION = 2  # bumped when the layout of the saved state changes


def rng_states() -> dict:
    """This process's global RNG states, as CPU tensors and plain types (``torch.load(weights_only=True)`` reads
    them)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        states["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return states


def set_rng_states(states: Mapping) -> None:
    """Restores :func:`rng_states`; tensors may have been mapped to another device on load (``map_location``)."""
    torch.set_rng_state(states["torch"].cpu().to(torch.uint8))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(_as_python_state(states["python"]))
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu().to(torch.uint8) for s in cuda])


def _as_python_state(state: Any) -> tuple:
    version, internal, gauss = state  # a round trip through some loaders turns the tuples into lists
    return version, tuple(internal), gauss


def metadata() -> dict:
    """``checkpoint["moco_lightning"]``; a collective under DDP (every rank's RNG states are gathered)."""
    return {"format_version": FORMAT_VERSION, "version": __version__, "rng_states": gather_objects(rng_states())}


def check_format(meta: Optional[Mapping], who: str) -> None:
    if meta is None:
        raise ConfigError(f"{who}: this checkpoint was not written by moco-lightning (no 'moco_lightning' entry)")
    if meta["format_version"] > FORMAT_VERSION:
        raise ConfigError(
            f"{who}: checkpoint format {meta['format_version']} (moco-lightning {meta['version']}) is newer than "
            f"this moco-lightning {__version__} reads (format {FORMAT_VERSION}): upgrade moco-lightning"
        )


def this_ranks_rng_states(meta: Mapping) -> Optional[dict]:
    """The saved RNG states of this rank (format 1: rank 0's, the only ones saved)."""
    saved = meta.get("rng_states")
    if saved is None:
        return None
    if isinstance(saved, Mapping):  # format 1
        saved = [saved]
    if len(saved) != world_size():
        warnings.warn(
            f"the checkpoint holds the RNG states of {len(saved)} process(es) and this run has {world_size()}: "
            "ranks without saved states start new random streams",
            stacklevel=2,
        )
        return saved[rank()] if rank() < len(saved) else None
    return saved[rank()]


def load_pending_loader_states(trainer: Any) -> None:
    """Hands the training loaders the states Lightning read from the checkpoint (their mid-epoch position), if it
    has not: call at ``on_train_start``.

    Lightning loads them while it sets up the training data at the start of ``fit``, but only if that set-up has not
    happened yet; ``configure_optimizers`` asking for ``trainer.estimated_stepping_batches`` (the schedules here)
    sets up the data earlier, before the checkpoint is restored, and the states are then never loaded: the resumed
    epoch restarted from its first batch (lightning 2.6). The loader's iterator is made lazily (a generator), so at
    ``on_train_start`` it has not drawn a batch yet."""
    fit_loop = getattr(trainer, "fit_loop", None)
    if fit_loop is not None and getattr(fit_loop, "_combined_loader_states_to_load", None):
        fit_loop._load_combined_loader_states()


def check_structure(saved: Mapping, current: Mapping, fields: Iterable[str], who: str) -> None:
    """One error naming every structural hyper-parameter in which a checkpoint and a model differ."""
    differ = [
        f"{k}: checkpoint {saved[k]!r}, model {current[k]!r}"
        for k in fields
        if k in saved and k in current and saved[k] != current[k]
    ]
    if differ:
        raise ConfigError(
            f"{who}: the checkpoint does not fit this model (" + "; ".join(differ) + "). Build the model with the "
            "checkpoint's settings (load_from_checkpoint does) or start a new run."
        )
