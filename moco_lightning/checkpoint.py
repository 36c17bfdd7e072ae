"""``load_from_checkpoint`` of every module of the library: the file read weights-only
(:mod:`moco_lightning.checkpoint_io`), a checkpoint of another class refused naming both, older formats upgraded
(:mod:`moco_lightning.compat`), then Lightning builds the module and loads the weights. A run's own state in the
checkpoint is :mod:`moco_lightning.run_state`'s."""

from __future__ import annotations

from typing import Any, Optional

from .checkpoint_io import read_checkpoint
from .compat import upgrade
from .errors import ConfigError
from .run_state import imported_class, is_subclass_path, saved_class


def load_module(
    cls: type, checkpoint_path: Any, map_location: Any = None, strict: Optional[bool] = None, **kwargs: Any
):
    """``cls.load_from_checkpoint``: the file read by :func:`read_checkpoint` (weights only), a checkpoint of another
    class refused naming both, older formats upgraded, then Lightning builds the module and loads the weights."""
    from ._lightning import module_from_checkpoint

    checkpoint = read_checkpoint(checkpoint_path, map_location=map_location or "cpu")
    saved = saved_class(checkpoint)
    if saved and saved.rsplit(".", 1)[-1] != cls.__name__:
        if not is_subclass_path(saved, cls):
            raise ConfigError(
                f"{checkpoint_path}: a checkpoint of {saved}, not of {cls.__module__}.{cls.__qualname__}: load it "
                f"with {saved.rsplit('.', 1)[-1]}.load_from_checkpoint"
            )
        # a base class asked (Pretraining.load_from_checkpoint): the subclass that wrote it, already imported
        cls = imported_class(saved)
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
