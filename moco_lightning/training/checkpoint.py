"""``load_from_checkpoint`` of every module of the library: the file read weights-only and upgraded from older formats
(:mod:`moco_lightning.training.checkpoint_io`), a checkpoint of another class refused naming both, then Lightning
builds the module and loads the weights. A run's own state in
the checkpoint is :mod:`moco_lightning.training.run_state`'s."""

from __future__ import annotations

from typing import Any, Optional

from moco_lightning.training.checkpoint_io import read_checkpoint
from moco_lightning.training.run_state import check_format, checkpoint_class


def load_module(
    cls: type, checkpoint_path: Any, map_location: Any = None, strict: Optional[bool] = None, **kwargs: Any
):
    """``cls.load_from_checkpoint``: the file read by :func:`read_checkpoint` (weights only), a checkpoint of another
    class refused naming both, then Lightning builds the module and loads the weights."""
    from moco_lightning._lightning import module_from_checkpoint

    checkpoint = read_checkpoint(checkpoint_path, map_location=map_location or "cpu")
    # a base class asked (Pretraining.load_from_checkpoint): the subclass that wrote it, already imported
    cls = checkpoint_class(checkpoint, cls, str(checkpoint_path), "load it with {saved}.load_from_checkpoint")
    if hasattr(cls, "STRUCTURAL"):  # a pretraining module: a newer format refused, a checkpoint without the entry said
        check_format(checkpoint.get("moco_lightning"), cls.__name__)
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
