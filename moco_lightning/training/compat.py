"""What earlier versions of moco-lightning wrote, read in one place; each path is removed in the release named.

- checkpoint formats 1 to 3 (moco-lightning 0.1 and 0.2) and 0.1.0's datamodule state: :func:`upgrade`, the one
  upgrade, run by the one reader (:func:`~moco_lightning.training.checkpoint_io.read_checkpoint`), brings them to
  today's format;
- ``cifar_stem`` (deprecated in 0.3): :func:`warn_cifar_stem` for a new module, :func:`stem_of_cifar_stem` for the
  hyper-parameters of a checkpoint;
- the flat layout of 0.1 to 0.2 (``moco_lightning.moco``, ``moco_lightning.split_bn``, ...) and the modules merged
  in 0.3.0 (``modules.queue``, ``modules.memory_bank``, ``modules.negatives``: ``modules.dictionary``): :data:`MOVED`
  names where each module went; :func:`install_moved_modules` makes ``import moco_lightning.moco`` (a user's import,
  a config's ``class_path: moco_lightning.backbones.ViT``) load the module at its new place with a
  ``DeprecationWarning`` naming it, and
  :func:`current_path` reads a class path a checkpoint recorded in the old layout.
"""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any, Mapping, Optional

from moco_lightning.constants import FORMAT_VERSION as CURRENT_FORMAT  # formats below it are upgraded here

REMOVED_IN = "0.4.0"  # the release that stops reading the formats of 0.1 and 0.2


_PACKAGES = {
    "methods": "base contrastive moco v3 end_to_end memory_bank_moco simclr byol swav",
    "modules": "loss momentum heads split_bn distributed backbones batches optim",
    "training": "plan run_state preemption log_history nan_guard checkpoint checkpoint_io compat precision",
    "downstream": "encoder export detection deployment embed evaluate linear_eval pictures",
}
#: the modules of the flat layout (moco-lightning 0.1 to 0.2) and those merged in 0.3.0 -> where they are now
MOVED = {
    **{
        f"moco_lightning.{name}": f"moco_lightning.{package}.{name}"
        for package, names in _PACKAGES.items()
        for name in names.split()
    },
    **{
        f"moco_lightning.{prefix}{name}": "moco_lightning.modules.dictionary"
        for prefix in ("", "modules.")
        for name in ("queue", "memory_bank", "negatives")
    },
}


def current_path(path: str) -> str:
    """``path`` (``module.Class``) in today's layout: a class path recorded by 0.1-0.3 (``moco_lightning.moco.MoCo``)
    becomes ``moco_lightning.methods.moco.MoCo``; any other path is returned as it is."""
    module, _, name = path.rpartition(".")
    return f"{MOVED[module]}.{name}" if module in MOVED else path


def imported_class(path: str) -> Any:
    """The class ``path`` names (in today's layout or the flat one of 0.1-0.2) if its module is imported already,
    else None (nothing is imported for a checkpoint's say-so)."""
    import sys

    module, _, name = current_path(path).rpartition(".")
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


class _MovedModules:
    """A meta-path finder: importing an old module name gives the module at its new place (the same object, so
    classes compare equal whichever name imported them)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MOVED:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        import importlib

        warnings.warn(
            f"{spec.name} is deprecated: import {MOVED[spec.name]} (the module moved; the old name goes in "
            f"moco-lightning {REMOVED_IN})",
            DeprecationWarning,
            stacklevel=2,  # the import line: the warnings module skips the import system's frames
        )
        module = importlib.import_module(MOVED[spec.name])
        self._spec = module.__spec__  # the import system sets __spec__ on what this returns: restored below
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self._spec


def install_moved_modules() -> None:
    """Old module names import (once per process; ``import moco_lightning`` calls it)."""
    import sys

    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())


def constructor_arguments(cls: type, root: Optional[type] = None) -> set[str]:
    """The arguments ``cls(...)`` accepts: its ``__init__``'s and, through ``**kwargs``, its bases' up to ``root``
    (Lightning's ``LightningModule`` by default; ``LightningDataModule`` for a datamodule)."""
    from lightning.pytorch import LightningModule

    root = root or LightningModule
    names: set[str] = set()
    for c in cls.__mro__:
        if c is root or not issubclass(c, root):
            break
        if "__init__" in vars(c):
            params = inspect.signature(c.__init__).parameters.values()
            names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    return names


def upgrade(checkpoint: dict) -> None:
    """A checkpoint of an earlier format brought to today's, in place: the one upgrade, which
    :func:`~moco_lightning.training.checkpoint_io.read_checkpoint` (every checkpoint's reader) runs on what it read.

    - any format: ``cifar_stem: true`` as ``stem: cifar``;
    - format 3 and older: the dictionary named ``queue`` / ``memory_bank`` in the state dict, now ``dictionary``;
    - format 2 and older: the hyper-parameters that MoCo v3, EndToEnd and MemoryBankMoCo passed to MoCo's constructor
      (``queue_size=0``, ``momentum=0.0``, ``head='mlp'``...) and the empty queue they kept are dropped (settings that
      were the user's, EndToEnd's ``shuffle_bn``, named in a warning; the class is the one the checkpoint records,
      when imported); the momentum copy it did not record is found by its name;
    - format 1: the RNG states of rank 0 alone, as a list of one;
    - 0.1.0's datamodule state: the augmentation generator of rank 0 alone (a tensor), as a list of one.

    The format is then today's (``upgraded_from`` says which it was)."""
    hparams = checkpoint.get("hyper_parameters") or {}
    stem_of_cifar_stem(hparams)
    meta = checkpoint.get("moco_lightning")
    version = (meta or {}).get("format_version", CURRENT_FORMAT)
    if meta is None or version >= CURRENT_FORMAT:
        return
    state = checkpoint.get("state_dict") or {}
    for name in [k for k in state if k.startswith(("queue.", "memory_bank."))]:  # format 3 and older
        state["dictionary." + name.split(".", 1)[1]] = state.pop(name)
    if version <= 2:
        _drop_passed_settings(checkpoint, hparams, version)
        copy = format2_momentum_copy(state)
        if meta.get("momentum_copies") is None and copy is not None:
            meta["momentum_copies"] = {"backbone": copy}
    if isinstance(meta.get("rng_states"), Mapping):  # format 1
        meta["rng_states"] = [meta["rng_states"]]
    for value in checkpoint.values():  # 0.1.0's datamodule state (Lightning saves it under the class's name)
        if isinstance(value, dict) and isinstance(value.get("augment_rng"), _tensor_type()):
            value["augment_rng"] = [value["augment_rng"]]
    meta["format_version"], meta["upgraded_from"] = CURRENT_FORMAT, version


def _drop_passed_settings(checkpoint: dict, hparams: dict, version: int) -> None:
    """Format 2: what a queue-free subclass passed to MoCo's constructor, recorded as its hyper-parameters, dropped."""
    cls = imported_class(checkpoint["moco_lightning"].get("module") or hparams.get("_class_path") or "")
    if cls is None:
        return  # not imported (nothing is imported for a checkpoint's say-so): its settings stay as they are
    accepted = constructor_arguments(cls)
    dropped = {k: hparams.pop(k) for k in list(hparams) if not k.startswith("_") and k not in accepted}
    fixed = {"queue_size": 0, "momentum": 0.0, "momentum_schedule": "constant", "head": "mlp", "symmetric": True}
    own = {k: v for k, v in dropped.items() if k not in fixed or fixed[k] != v}
    if own:
        warnings.warn(
            f"{cls.__name__} no longer takes {', '.join(sorted(own))} (a format-{version} checkpoint): ignored",
            stacklevel=4,
        )
    state = checkpoint.get("state_dict") or {}
    if "dictionary.keys" in state and state["dictionary.keys"].numel() == 0:  # a queue-free dictionary's empty queue
        for key in ("dictionary.keys", "dictionary.ptr", "dictionary.enqueued_at"):
            state.pop(key, None)


def _tensor_type() -> type:
    import torch

    return torch.Tensor


def warn_cifar_stem(cifar_stem: bool, who: str) -> None:
    """``cifar_stem=True``, the older spelling of ``stem="cifar"``: a warning, for the one release it still works."""
    if cifar_stem:
        warnings.warn(
            f"{who}: cifar_stem=True is deprecated and goes in moco-lightning 0.4: use stem='cifar' (the same stem)",
            FutureWarning,
            stacklevel=3,
        )


def stem_of_cifar_stem(hparams: dict) -> None:
    """``cifar_stem: true`` (deprecated in 0.3) read as ``stem: cifar``, so that an older checkpoint reloads and resumes
    without the deprecation warning and agrees with a config that says ``stem: cifar``."""
    if hparams.get("cifar_stem") and hparams.get("stem") in (None, "cifar"):
        hparams["cifar_stem"], hparams["stem"] = False, "cifar"


def format2_momentum_copy(state_dict: Mapping) -> Optional[str]:
    """Format 2 did not record the momentum copies: the one child named ``<prefix>_backbone`` holds the backbone's."""
    names = {m.group(1) for k in state_dict if (m := re.match(r"(\w+_backbone)\.", k))}
    return names.pop() if len(names) == 1 else None
