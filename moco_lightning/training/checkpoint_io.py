"""The one place where the library reads a checkpoint or an exported backbone from a file.

``torch.load(weights_only=True)`` refuses any file that would import and call code while it is unpickled (a
downloaded checkpoint can carry such a payload): such a file is refused with one line naming the global it asks for;
for a source you trust, ``MOCO_LIGHTNING_ALLOW_PICKLE=1`` lifts the restriction. :class:`SafeCheckpointIO` makes the
Trainer's own restore (``ckpt_path``) read the same way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from moco_lightning.errors import ConfigError, DataNotFoundError
from moco_lightning.training.compat import upgrade

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
    if is_checkpoint:
        upgrade(loaded)  # an earlier format brought to today's (idempotent: a kept checkpoint is upgraded already)
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


def load_checkpoints_safely(trainer: Any, check: Optional[Callable[[dict], None]] = None) -> bool:
    """Makes the Trainer read ``ckpt_path`` (fit, validate, test, predict) through :func:`read_checkpoint`: weights
    only, whatever ``weights_only`` its caller passed (Lightning's default is full pickle), then ``check(checkpoint)``
    before Lightning restores anything from it. Called at ``setup``, which runs before the Trainer restores a
    checkpoint; a checkpoint IO of the user's own (not Lightning's default) is left alone: returns False then."""
    strategy = trainer.strategy
    io = getattr(strategy, "checkpoint_io", None)
    if type(io) is not TorchCheckpointIO and not isinstance(io, SafeCheckpointIO):
        return False
    strategy.checkpoint_io = SafeCheckpointIO(check)
    return True


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, reading through :func:`read_checkpoint` (``weights_only=True``) and handing each
    checkpoint read to ``check``."""

    def __init__(self, check: Optional[Callable[[dict], None]] = None) -> None:
        super().__init__()
        self.check = check

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> dict:
        checkpoint = read_checkpoint(path, arg="ckpt_path", map_location=map_location or "cpu")
        if self.check is not None:
            self.check(checkpoint)
        return checkpoint
