"""What ``--ckpt_path last`` resumes: the newest readable checkpoint of the earlier runs, found where the config's
checkpoint callbacks and logger write them; and the refusal of a checkpoint of another method."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

from moco_lightning.errors import ConfigError
from moco_lightning.training.checkpoint_io import read_checkpoint
from moco_lightning.training.run_state import checkpoint_class


def check_checkpoint_class(ckpt: dict, path: str, model_class: type) -> None:
    """A checkpoint of another method (SimCLR into a MoCo run) is an error naming both classes, not a silent switch
    (the configured class or a subclass of it; :func:`~moco_lightning.training.run_state.checkpoint_class`)."""
    checkpoint_class(
        ckpt,
        model_class,
        f"--ckpt_path {path}",
        "resume it with its own config (model.class_path: {path}), or drop --ckpt_path to start a new run",
    )


def resolve_last_checkpoint(config: Any) -> Optional[str]:
    """The checkpoint ``--ckpt_path last`` resumes, or None (with one line saying so): the newest readable
    ``last.ckpt`` of the earlier runs (or a SLURM requeue's ``hpc_ckpt_N.ckpt``); without one, the newest readable
    checkpoint of any name there (Lightning's default ``epoch=E-step=S.ckpt``), saying so.

    Looks in every ModelCheckpoint's fixed ``dirpath``, else in ``<save_dir>/<name>/version_*/checkpoints`` of the
    first logger (Lightning's default: ``<default_root_dir>/lightning_logs``); the logger is pointed at the version
    found, so the resumed run goes on logging into it."""
    trainer = config["trainer"]
    folders, base, first, args, save_dir, name, where = checkpoint_folders(trainer)
    root = trainer.get("default_root_dir") or os.getcwd()
    hpc = list(Path(root).glob("hpc_ckpt_*.ckpt"))  # a SLURM requeue's (Lightning's auto-requeue)
    newest, any_name = None, False
    lasts = [p for d in folders for p in d.glob("last*.ckpt")] + hpc
    if lasts:
        newest = newest_readable(lasts)
    else:
        others = [p for d in folders for p in d.glob("*.ckpt")]
        if others:
            newest, any_name = newest_readable(others), True
    if newest is None:
        what = "no readable checkpoint" if lasts else "no checkpoint"
        print(
            f"moco-lightning: --ckpt_path last: {what} under {where}: starting a new run", file=sys.stderr, flush=True
        )
        return None
    in_logger = newest.parent.name == "checkpoints" and newest.parent.parent.parent == base
    version = newest.parent.parent.name if in_logger else ""
    if version.startswith("version_") and first not in (None, True, False):
        v = version[len("version_") :]
        args["version"] = int(v) if v.isdigit() else version
    elif version.startswith("version_") and first in (None, True):
        from jsonargparse import Namespace

        v = version[len("version_") :]
        trainer["logger"] = Namespace(
            class_path="lightning.pytorch.loggers.TensorBoardLogger",
            init_args=Namespace(save_dir=str(save_dir), name=name, version=int(v) if v.isdigit() else version),
        )
    if any_name:
        print(
            f"moco-lightning: --ckpt_path last: no last.ckpt under {where}: resuming the newest checkpoint, {newest}",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(f"moco-lightning: --ckpt_path last: resuming {newest}", file=sys.stderr, flush=True)
    return str(newest)


def checkpoint_folders(trainer: Any) -> tuple:
    """Where a fit config's runs write their checkpoints: every ModelCheckpoint's fixed ``dirpath``, else
    ``<save_dir>/<name>/version_*/checkpoints`` of the first logger (Lightning's default:
    ``<default_root_dir>/lightning_logs``). Returns ``(folders, base, logger, its init_args, save_dir, name, where)``,
    ``where`` the folders in words."""
    dirpaths = [
        Path(d)
        for cb in (trainer.get("callbacks") or [])
        if str(_get(cb, "class_path") or "").endswith("ModelCheckpoint")
        for d in [_get(_get(cb, "init_args") or {}, "dirpath")]
        if d
    ]
    logger = trainer.get("logger")
    first = logger[0] if isinstance(logger, list) and logger else logger
    root = trainer.get("default_root_dir") or os.getcwd()
    if first in (None, True):
        save_dir, name, args = root, "lightning_logs", None
    elif first is False:
        save_dir, name, args = root, None, None  # no logger: Lightning checkpoints into default_root_dir/checkpoints
    else:
        args = _get(first, "init_args")
        save_dir, name = _get(args, "save_dir") or root, _get(args, "name")
        name = "lightning_logs" if name is None and "TensorBoard" in str(_get(first, "class_path")) else name
    base = Path(save_dir) / name if name else Path(save_dir)
    folders = [*dirpaths, *base.glob("version_*/checkpoints"), base / "checkpoints"]
    where = ", ".join([*(str(d) for d in dirpaths), f"{base} (version_*/checkpoints)"])
    return folders, base, first, args, save_dir, name, where


#: ``--ckpt WORD`` of evaluate, export and embed: the file name each word stands for in a run's checkpoint folder
NAMED = {"last": "last", "best": "best-knn"}
BEST_LAST = "or best / last: the best checkpoint by kNN (best-knn.ckpt) / last.ckpt of the runs of --config"


def named_checkpoint(word: str, config: Optional[str], arg: str = "--ckpt") -> str:
    """``--ckpt best`` (the best checkpoint by kNN, ``best-knn.ckpt``) or ``--ckpt last`` of the runs of the fit
    config ``config``, found as ``--ckpt_path last`` finds it (:func:`checkpoint_folders`): the newest readable such
    file; any other value is returned as it is (a path)."""
    if word not in NAMED:
        return word
    if not config:
        raise ConfigError(
            f"{arg} {word}: give the fit config with --config (its trainer section says where the run's checkpoints "
            f"are), or the checkpoint's path"
        )
    import yaml

    try:
        with open(config) as f:
            trainer = (yaml.safe_load(f) or {}).get("trainer") or {}
    except OSError as e:
        raise ConfigError(f"--config {config}: {e.strerror}") from None
    folders, *_, where = checkpoint_folders(trainer)
    found = sorted((p for d in folders for p in d.glob(f"{NAMED[word]}*.ckpt")), key=lambda p: -p.stat().st_mtime)
    newest = next((p for p in found if _readable(p)), None)
    if newest is None:
        needs = " (a run writes it with a KNNMonitor and ModelCheckpoint(monitor='val/knn_acc1', filename='best-knn'))"
        raise ConfigError(
            f"{arg} {word}: no readable {NAMED[word]}.ckpt under {where}" + (needs if word == "best" else "")
        )
    print(f"moco-lightning: {arg} {word}: {newest}", file=sys.stderr, flush=True)
    return str(newest)


def newest_readable(paths: list) -> Optional[Path]:
    """The newest of ``paths`` that loads, falling back past torn ones (and to the run's other checkpoints) with one
    line naming both; None when none loads."""
    lasts = sorted(paths, key=lambda p: p.stat().st_mtime, reverse=True)
    others = {c for p in paths for c in Path(p).parent.glob("*.ckpt")} - set(lasts)  # top-k and step saves
    ordered = lasts + sorted(others, key=lambda p: p.stat().st_mtime, reverse=True)  # last.ckpt first, then those
    newest, why = lasts[0], ""
    for p in ordered:
        try:
            read_checkpoint(p, keep=True)
        except ConfigError as e:  # torn, empty, or refused (it needs pickle)
            why = why or str(e).split(": ", 1)[-1].split(";")[0].split(" (")[0]
            continue
        if Path(p) != Path(newest):
            print(
                f"moco-lightning: --ckpt_path last: {newest} could not be used ({why}); resuming {p}, the newest "
                "readable checkpoint",
                file=sys.stderr,
                flush=True,
            )
        return Path(p)
    return None


def _readable(path: Path) -> bool:
    try:
        read_checkpoint(path, keep=True)  # kept for the command's own read of it
    except ConfigError:
        return False
    return True


def _get(ns: Any, key: str) -> Any:
    if ns is None:
        return None
    return ns.get(key) if hasattr(ns, "get") else getattr(ns, key, None)
