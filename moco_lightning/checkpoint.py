"""Reading checkpoints safely, what a moco-lightning checkpoint holds besides the weights, and resuming from one.

- :func:`read_checkpoint` is the one place where the library reads a checkpoint or an exported backbone from a file:
  ``torch.load(weights_only=True)``, which refuses any file that would import and call code while it is unpickled
  (a downloaded checkpoint can carry such a payload). A file that needs pickle is refused with one line naming the
  global it asks for; for a source you trust, ``MOCO_LIGHTNING_ALLOW_PICKLE=1`` lifts the restriction.
- ``checkpoint["moco_lightning"]``: the format version, the library version that wrote it, the step plan of the
  schedules, the momentum copies (``{"backbone": "key_backbone", ...}``), and the global RNG states (torch, numpy,
  Python, CUDA) of **every** rank, so that a resumed run continues each rank's own random stream (only rank 0
  writes the file: the states are gathered from all ranks while saving).
- Format 1 held rank 0's RNG states only; format 2 recorded the fixed values that MoCo v3, EndToEnd and
  MemoryBankMoCo passed to MoCo's constructor (``queue_size=0``...) as hyper-parameters, and an empty queue:
  :func:`upgrade` drops them, so those checkpoints still load.
"""

from __future__ import annotations

import inspect
import os
import random
import re
import warnings
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

import numpy as np
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from .distributed import gather_objects, rank, world_size
from .errors import ConfigError, DataNotFoundError
from .version import __version__

FORMAT_VERSION = 3  # bumped when the layout of the saved state changes
ALLOW_PICKLE = "MOCO_LIGHTNING_ALLOW_PICKLE"  # "1": load checkpoints with full pickle (trusted sources only)


def pickle_allowed() -> bool:
    """Whether the user opted in to full-pickle loading (``MOCO_LIGHTNING_ALLOW_PICKLE=1``); off by default."""
    return os.environ.get(ALLOW_PICKLE, "").strip().lower() in ("1", "true", "yes")


def safe_load(source: Any, map_location: Any = "cpu") -> Any:
    """``torch.load`` with ``weights_only=True`` unless the user opted in to pickle (:data:`ALLOW_PICKLE`)."""
    return torch.load(source, map_location=map_location, weights_only=not pickle_allowed())


_KEPT: dict = {}  # one checkpoint already read (a candidate of `--ckpt_path last`), handed to the next read of it


def read_checkpoint(
    path: Any,
    expect: Literal["checkpoint", "export", "either"] = "checkpoint",
    arg: str = "",
    map_location: Any = "cpu",
    keep: bool = False,
) -> Any:
    """The checkpoint (a Lightning checkpoint dict), the export (a backbone state dict) or either at ``path``, or a
    one-line :class:`ConfigError` naming the file (and ``arg``, the setting that gave it): missing, a directory,
    empty or torn, a file that needs pickle (the global it names), or not what ``expect`` asks for.

    ``keep``: hold the result for the next read of the same unchanged file (the CLI reads ``last.ckpt`` to check it
    and again to restore it)."""
    where = f"{arg} {path}" if arg else str(path)
    p = Path(path)
    if not p.exists():
        raise DataNotFoundError(f"{where}: no such file; give a .ckpt written by `moco-lightning fit` (or an export)")
    if p.is_dir():
        raise ConfigError(f"{where} is a directory: give the checkpoint file inside it (e.g. {p / 'last.ckpt'})")
    key = (str(p.resolve()), p.stat().st_mtime_ns, p.stat().st_size)
    loaded = _KEPT.pop(key, None)
    _KEPT.clear()
    if loaded is None:
        try:
            loaded = safe_load(p, map_location)
        except Exception as e:  # noqa: BLE001 - torch.load's errors: UnpicklingError, EOFError, RuntimeError...
            raise ConfigError(_unreadable(where, p, e)) from None
    if keep:
        _KEPT[key] = loaded
    is_checkpoint = isinstance(loaded, dict) and "state_dict" in loaded
    is_export = (
        isinstance(loaded, dict) and not is_checkpoint and all(isinstance(v, torch.Tensor) for v in loaded.values())
    )
    if expect == "checkpoint" and not is_checkpoint:
        raise ConfigError(
            f"{where}: not a Lightning checkpoint (no state_dict)"
            + (": an exported backbone? use it with load_backbone or model.backbone_state_dict" if is_export else "")
        )
    if expect == "export" and not is_export:
        raise ConfigError(
            f"{where}: not an exported backbone (a state dict of tensors)"
            + (": a training checkpoint? export it first: moco-lightning export --ckpt ..." if is_checkpoint else "")
        )
    if expect == "either" and not (is_checkpoint or is_export):
        raise ConfigError(f"{where}: neither a checkpoint nor an exported backbone ({type(loaded).__name__})")
    return loaded


def _unreadable(where: str, path: Path, error: Exception) -> str:
    text = str(error)
    needs = re.search(r"GLOBAL ([\w.]+)", text)  # torch names the global a weights-only load refused to import
    if needs:
        return (
            f"{where}: refused: loading it needs pickle to import {needs.group(1)}, which could run code on this "
            "machine (moco-lightning loads checkpoints with weights_only=True); if you trust where the file comes "
            f"from, set {ALLOW_PICKLE}=1 to load it with full pickle"
        )
    size, first = path.stat().st_size, text.splitlines()[0][:80] if text else "truncated"
    with open(path, "rb") as f:
        head = f.read(4)
    if size and not head.startswith((b"PK\x03\x04", b"\x80")):  # neither torch.save's zip nor a pickle
        kind = "text" if all(32 <= b < 127 or b in b"\t\r\n" for b in head) else "data"
        return (
            f"{where}: not a checkpoint: a {size}-byte {kind} file, neither a torch.save archive nor a pickle; give "
            "the .ckpt written by `moco-lightning fit` (a run's checkpoints/ folder) or an export of one"
        )
    return (
        f"{where}: not a readable checkpoint ({size} bytes; {type(error).__name__}: {first}): a save interrupted by "
        "a kill or a full disk leaves such a file; use an earlier checkpoint of the run"
    )


# --- what the library writes ------------------------------------------------------------------
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
    version, internal, gauss = states["python"]  # a round trip through some loaders turns the tuples into lists
    random.setstate((version, tuple(internal), gauss))
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu().to(torch.uint8) for s in cuda])


def metadata(**extra: Any) -> dict:
    """``checkpoint["moco_lightning"]``; a collective under DDP (every rank's RNG states are gathered)."""
    meta = {"format_version": FORMAT_VERSION, "version": __version__, "rng_states": gather_objects(rng_states())}
    meta.update({k: v for k, v in extra.items() if v is not None})
    return meta


# --- what the library reads back --------------------------------------------------------------
def check_format(meta: Optional[Mapping], who: str) -> None:
    if meta is None:
        raise ConfigError(f"{who}: this checkpoint was not written by moco-lightning (no 'moco_lightning' entry)")
    if meta["format_version"] > FORMAT_VERSION:
        raise ConfigError(
            f"{who}: checkpoint format {meta['format_version']} (moco-lightning {meta['version']}) is newer than "
            f"this moco-lightning {__version__} reads (format {FORMAT_VERSION}): upgrade moco-lightning"
        )


def constructor_arguments(cls: type) -> set[str]:
    """The arguments ``cls(...)`` accepts: its ``__init__``'s and, through ``**kwargs``, its bases' (to Lightning's)."""
    from lightning.pytorch import LightningModule

    names: set[str] = set()
    for c in cls.__mro__:
        if c is LightningModule or not issubclass(c, LightningModule):
            break
        if "__init__" in vars(c):
            params = inspect.signature(c.__init__).parameters.values()
            names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    return names


def upgrade(checkpoint: dict, cls: type) -> None:
    """A format-1/2 checkpoint of ``cls`` in today's layout (in place; nothing to do for format 3).

    Format 2 recorded as hyper-parameters the values that MoCo v3, EndToEnd and MemoryBankMoCo passed to MoCo's
    constructor (``queue_size=0``, ``momentum=0.0``, ``head='mlp'``...) and kept an empty queue in their state: these
    classes no longer take or have them. Dropped settings that were the user's (EndToEnd's ``shuffle_bn``) are
    named in a warning."""
    meta = checkpoint.get("moco_lightning") or {}
    if meta.get("format_version", FORMAT_VERSION) >= 3:
        return
    hparams = checkpoint.get("hyper_parameters") or {}
    accepted = constructor_arguments(cls)
    dropped = {k: hparams.pop(k) for k in list(hparams) if not k.startswith("_") and k not in accepted}
    fixed = {"queue_size": 0, "momentum": 0.0, "momentum_schedule": "constant", "head": "mlp", "symmetric": True}
    own = {k: v for k, v in dropped.items() if k not in fixed or fixed[k] != v}
    if own:
        warnings.warn(
            f"{cls.__name__} no longer takes {', '.join(sorted(own))} (a format-{meta.get('format_version')} "
            "checkpoint): ignored",
            stacklevel=3,
        )
    state = checkpoint.get("state_dict") or {}
    if "queue.keys" in state and state["queue.keys"].numel() == 0:  # the empty queue of a queue-free dictionary
        for name in ("queue.keys", "queue.ptr", "queue.enqueued_at"):
            state.pop(name, None)


def saved_class(checkpoint: Mapping) -> Optional[str]:
    """The class path of the module that wrote ``checkpoint`` (recorded since format 3; the CLI's ``_class_path``
    before), or None."""
    meta = checkpoint.get("moco_lightning") or {}
    return meta.get("module") or (checkpoint.get("hyper_parameters") or {}).get("_class_path")


def check_class(checkpoint: Mapping, cls: type) -> None:
    """A checkpoint of another method (a SimCLR run restored into MoCo) is one line naming both classes, before its
    weights meet the module (torch's error lists every missing and unexpected key)."""
    saved = saved_class(checkpoint)
    if saved and saved.rsplit(".", 1)[-1] != cls.__name__ and not _is_subclass_path(saved, cls):
        raise ConfigError(
            f"{cls.__name__}: the checkpoint is a {saved} run, not a {cls.__module__}.{cls.__qualname__} one: resume "
            f"it with {saved.rsplit('.', 1)[-1]} (or its own config), or start a new run without ckpt_path"
        )


def check_structure(saved: Mapping, current: Mapping, fields: tuple, who: str) -> None:
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


def check_world_size(checkpoint: dict, meta: Mapping, who: str) -> None:
    """A checkpoint written inside an epoch resumes with the processes that wrote it: the rest of that epoch is this
    many ranks' shards of the sampler's order, which another number of processes would split otherwise (images
    trained twice or never). At an epoch's end any number goes on (the queue is every rank's, the lr and the
    schedules follow the new global batch)."""
    from ._lightning import close_finished_epoch, saved_mid_epoch

    saved = meta.get("rng_states")
    then = len(saved) if isinstance(saved, (list, tuple)) else None
    if then is None or then == world_size():
        return
    close_finished_epoch(checkpoint)  # written at an epoch's last batch: that epoch is over, whatever its new length
    done = saved_mid_epoch(checkpoint)
    if done:
        raise ConfigError(
            f"{who}: the checkpoint was written {done} batches into an epoch by {then} process(es), and this run has "
            f"{world_size()}: the rest of that epoch is split among {then} ranks and cannot be continued by "
            f"{world_size()}; resume it with {then} (trainer.devices x num_nodes), or from a checkpoint written at an "
            "epoch's end (any number of processes)"
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


def save_state(module: Any, checkpoint: dict) -> None:
    """``on_save_checkpoint`` of the pretraining modules: no checkpoint of bad weights; the step being finished (a
    callback's save at step N runs before the module's ``on_train_batch_end``: the checkpoint then holds N momentum
    updates and N steps' keys); the metadata."""
    module.nan_guard.raise_if_pending()
    bad = [name for name, p in module.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise FloatingPointError(
            f"{type(module).__name__}: refusing to write a checkpoint with non-finite weights in {bad[:5]}"
        )
    if module._trainer is not None and module.trainer.training:
        module.finish_step()
        saved = checkpoint["state_dict"]
        saved.update({k: v for k, v in module.state_dict().items() if k in saved})
    plan = module.step_plan.state_dict() if module.step_plan is not None else None
    cls = type(module)
    checkpoint["moco_lightning"] = metadata(
        step_plan=plan, momentum_copies=module.momentum_copies(), module=f"{cls.__module__}.{cls.__qualname__}"
    )


def restore_state(module: Any, checkpoint: dict) -> dict:
    """``on_load_checkpoint`` of the pretraining modules: an older format upgraded, the format and the structure
    checked, an epoch a ``max_steps`` stop cut short re-opened; returns what the run resumes (RNG states, step plan)."""
    from ._lightning import reopen_cut_epoch
    from .log_history import keep_history

    who = type(module).__name__
    upgrade(checkpoint, type(module))
    meta = checkpoint.get("moco_lightning")
    check_format(meta, who)
    check_class(checkpoint, type(module))
    check_structure(checkpoint.get("hyper_parameters", {}), module.hparams, module.STRUCTURAL, who)
    reopen_cut_epoch(checkpoint)
    if module._trainer is not None and module.trainer.state.fn == "fit":  # resuming (not loading the weights)
        check_world_size(checkpoint, meta, who)
    if module._trainer is not None:
        keep_history(module.trainer, module._csv_history, checkpoint.get("global_step", 0))
    module._csv_history = []
    return {"rng": this_ranks_rng_states(meta), "plan": meta.get("step_plan")}


def continue_run(module: Any, resume: dict) -> None:
    """At ``on_train_start`` of a resumed run: this rank's global RNGs continue where they were saved, the training
    loader at its next batch, the schedules as planned (stretched to another length, rescaled for another batch)."""
    from . import _lightning, plan

    if resume.get("rng") is not None:
        set_rng_states(resume["rng"])
    _lightning.load_pending_loader_states(module.trainer)
    if resume.get("plan") and module.trainer.ckpt_path:
        plan.continue_plan(module, module.step_plan)


def load_module(
    cls: type, checkpoint_path: Any, map_location: Any = None, strict: Optional[bool] = None, **kwargs: Any
):
    """``cls.load_from_checkpoint``: the file read by :func:`read_checkpoint` (weights only), a checkpoint of another
    class refused naming both, older formats upgraded, then Lightning builds the module and loads the weights."""
    from ._lightning import module_from_checkpoint

    checkpoint = read_checkpoint(checkpoint_path, map_location=map_location or "cpu")
    saved = saved_class(checkpoint)
    if saved and saved.rsplit(".", 1)[-1] != cls.__name__ and not _is_subclass_path(saved, cls):
        raise ConfigError(
            f"{checkpoint_path}: a checkpoint of {saved}, not of {cls.__module__}.{cls.__qualname__}: load it with "
            f"{saved.rsplit('.', 1)[-1]}.load_from_checkpoint"
        )
    upgrade(checkpoint, cls)
    # built by cls(**hyper-parameters) itself: a backbone the CLI built from a class_path is recorded as that spec,
    # which build_backbone rebuilds (Lightning's CLI instantiator would hand over a module and lose the spec)
    for private in ("_class_path", "_instantiator"):
        (checkpoint.get("hyper_parameters") or {}).pop(private, None)
    return module_from_checkpoint(cls, checkpoint, strict, **kwargs)


class SafeLoading:
    """``load_from_checkpoint`` through :func:`read_checkpoint` (mixed in before ``LightningModule``)."""

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: Any,
        map_location: Any = None,
        strict: Optional[bool] = None,
        weights_only: Optional[bool] = None,
        **kwargs: Any,
    ) -> Any:
        """The module of a checkpoint, read with ``weights_only=True`` (:func:`read_checkpoint`); ``kwargs`` replace
        saved arguments (``backbone=`` the module of a run that passed one). ``weights_only`` is accepted for
        Lightning's signature and ignored: a file that needs pickle loads only with ``MOCO_LIGHTNING_ALLOW_PICKLE=1``.
        """
        return load_module(cls, checkpoint_path, map_location, strict, **kwargs)


def _is_subclass_path(path: str, cls: type) -> bool:
    """``path`` names an already imported subclass of ``cls`` (nothing is imported for a checkpoint's say-so)."""
    import sys

    module, _, name = path.rpartition(".")
    found = getattr(sys.modules.get(module), name, None)
    return isinstance(found, type) and issubclass(found, cls)


def load_checkpoints_safely(trainer: Any) -> None:
    """Makes the Trainer read ``ckpt_path`` (fit, validate, test, predict) through :func:`read_checkpoint`: weights
    only, whatever ``weights_only`` its caller passed (Lightning's default is full pickle). Called from the
    modules' ``setup``, which runs before the Trainer restores a checkpoint; a checkpoint IO of the user's own
    (not Lightning's default) is left alone."""
    strategy = trainer.strategy
    if type(getattr(strategy, "checkpoint_io", None)) is TorchCheckpointIO:
        strategy.checkpoint_io = SafeCheckpointIO()


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, reading through :func:`read_checkpoint` (``weights_only=True``)."""

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> dict:
        return read_checkpoint(path, arg="ckpt_path", map_location=map_location or "cpu")
