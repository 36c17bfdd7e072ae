"""The pretrained encoder of a file, for everything downstream: linear evaluation, ``moco-lightning evaluate``,
``moco-lightning export`` and :func:`moco_lightning.load_backbone` read it here.

A source is a checkpoint of any pretraining method (its backbone's architecture from the hyper-parameters, its
weights from ``backbone.*``, or from the momentum copy's) or a file ``moco-lightning export`` wrote (a
torchvision-style state dict whose ``_metadata`` names its architecture: the backbone's name, ``width``,
``in_channels``, ``stem``, ``image_size``; ``load_state_dict`` ignores it).

The file is read once, into an :class:`Encoder` (weights, architecture, the evaluation transform it recorded, where
it came from: :meth:`Encoder.read`, the one loader), and that object is passed on: ``evaluate`` builds its features
and every label budget's classifier from it (:meth:`LinearClassifier.on_encoder
<moco_lightning.downstream.linear_eval.LinearClassifier.on_encoder>`). The functions below it
(:func:`load_encoder`, :func:`encoder_from`, :func:`load_transform`) are thin aliases kept for their callers.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional, Union

import torch
from torch import nn
from torchvision.transforms import Compose

from moco_lightning.constants import IMAGENET_MEAN, IMAGENET_STD, default_normalisation  # noqa: F401
from moco_lightning.errors import ConfigError
from moco_lightning.modules.backbones import build_backbone, is_backbone_spec
from moco_lightning.training.checkpoint_io import read_checkpoint

ARCHITECTURE = ("backbone", "cifar_stem", "in_channels", "image_size", "width", "stem")  # build_backbone's arguments
ARCHITECTURE_KEY = "moco_lightning"  # the key of the architecture in an export's _metadata
ENCODER_KEY = "encoder"  # a LinearClassifier checkpoint's record of its backbone: architecture, evaluation transform
TRANSFORM_KEY = "moco_lightning_transform"  # and of the evaluation transform (mean, std, size, channels, resize)


def architecture_of(hparams: dict) -> Optional[dict]:
    """The architecture a checkpoint's hyper-parameters name: a backbone name, or the ``{class_path, init_args}``
    spec of a module the CLI built (None for a backbone module of the user's own)."""
    backbone = hparams.get("backbone")
    if not isinstance(backbone, str) and not is_backbone_spec(backbone):
        return None
    return {k: hparams[k] for k in ARCHITECTURE if k in hparams}


def architecture_in(state: Any) -> Optional[dict]:
    """The architecture an exported state dict describes, or None."""
    return (getattr(state, "_metadata", None) or {}).get(ARCHITECTURE_KEY)


def transform_in(state: Any) -> Optional[dict]:
    """The evaluation transform an exported state dict (or a checkpoint's backbone state) records, or None."""
    return (getattr(state, "_metadata", None) or {}).get(TRANSFORM_KEY)


def momentum_backbone(checkpoint: dict) -> Optional[str]:
    """The state-dict name of the backbone's momentum copy (MoCo's key encoder, BYOL's target), or None."""
    copies = (checkpoint.get("moco_lightning") or {}).get("momentum_copies") or {}
    return copies.get("backbone")


def checkpoint_backbone(
    checkpoint: Any, path: str | Path, encoder: Literal["query", "key"] = "query"
) -> OrderedDict[str, torch.Tensor]:
    """The query (default) or key encoder's backbone weights of a checkpoint read from ``path`` (named in the
    errors), keys as in torchvision, the architecture in ``_metadata`` when the hyper-parameters name it."""
    if isinstance(checkpoint, dict) and ENCODER_KEY in checkpoint and "state_dict" in checkpoint:
        return classifier_backbone(checkpoint, path, encoder)
    if not isinstance(checkpoint, dict) or "moco_lightning" not in checkpoint or "state_dict" not in checkpoint:
        raise ConfigError(
            f"{path} is not a checkpoint of moco-lightning pretraining (no 'moco_lightning' / 'state_dict' entry)"
            + (
                ", nor of a linear evaluation or fine-tuning that records its encoder (a LinearClassifier's from an "
                "older moco-lightning?): export the encoder of the pretraining checkpoint instead"
                if isinstance(checkpoint, dict) and "head.weight" in (checkpoint.get("state_dict") or {})
                else ""
            )
        )
    name = "backbone" if encoder == "query" else momentum_backbone(checkpoint)
    if name is None:
        raise ConfigError(
            f"{path}: this method has no momentum encoder (no key encoder or target network): export the query "
            "encoder (--encoder query)"
        )
    state = submodule_state(checkpoint["state_dict"], name)
    if not state:
        raise ConfigError(f"{path}: no {name}.* weights in its state_dict")
    architecture = architecture_of(checkpoint.get("hyper_parameters") or {})
    return described(state, architecture, (checkpoint.get("moco_lightning") or {}).get("eval_transform"))


def submodule_state(state_dict: dict, name: str) -> OrderedDict[str, torch.Tensor]:
    """The entries of ``state_dict`` under ``name.``, keyed without that prefix (as the submodule's own)."""
    prefix = name + "."
    return OrderedDict((k[len(prefix) :], v) for k, v in state_dict.items() if k.startswith(prefix))


def described(
    state: OrderedDict[str, torch.Tensor], architecture: Optional[dict], transform: Optional[dict]
) -> OrderedDict[str, torch.Tensor]:
    """``state`` with its architecture and evaluation transform in ``_metadata`` (as an export carries them), when
    the architecture is known."""
    if architecture is not None:
        metadata = {ARCHITECTURE_KEY: architecture, **({TRANSFORM_KEY: transform} if transform else {})}
        state._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]
    return state


def classifier_backbone(checkpoint: dict, path: str | Path, encoder: str = "query") -> OrderedDict[str, torch.Tensor]:
    """The backbone of a :class:`~moco_lightning.downstream.linear_eval.LinearClassifier` checkpoint (a linear
    evaluation: the pretrained encoder, frozen; a fine-tuning: the encoder it trained), with the architecture and
    evaluation transform it recorded (``checkpoint["encoder"]``)."""
    if encoder != "query":
        raise ConfigError(
            f"{path} is a linear-evaluation / fine-tuning checkpoint: it holds one encoder, not a momentum copy; use "
            "--encoder query (its backbone)"
        )
    state, recorded = submodule_state(checkpoint["state_dict"], "backbone"), checkpoint[ENCODER_KEY]
    if not state or not recorded.get("architecture"):
        raise ConfigError(f"{path}: a linear-evaluation checkpoint without backbone.* weights or their architecture")
    return described(state, recorded["architecture"], recorded.get("transform"))


@dataclass(frozen=True)
class Encoder:
    """A pretrained encoder read from one file: its backbone ``state`` (the weights), its ``architecture``
    (:func:`~moco_lightning.modules.backbones.build_backbone`'s arguments) and its ``source``; the evaluation
    transform it recorded is :attr:`recorded_transform`. Built by :meth:`read`; everything downstream takes one."""

    state: OrderedDict
    architecture: dict
    source: str = ""

    @classmethod
    def read(
        cls, source: str | Path, expect: Literal["export", "either"] = "either", arg: str = "model.ckpt_path"
    ) -> "Encoder":
        """The encoder of ``source``, a checkpoint of any pretraining method or an export (``expect``: exports
        only), read once; one-line errors naming the file and ``arg``, the setting that gave it."""
        obj = read_checkpoint(source, expect=expect, arg=arg)
        state = obj if architecture_in(obj) is not None else None
        if state is None and expect == "export":
            raise ConfigError(
                f"{source} does not say which backbone it holds (exported by an older moco-lightning, or not by its "
                "export): build the architecture yourself and load_state_dict this file into it, or export again"
            )
        if state is None and "state_dict" in obj:
            state = checkpoint_backbone(obj, source)
        architecture = architecture_in(state) if state is not None else None
        if architecture is None:
            raise ConfigError(
                f"{source}: the file does not name its backbone (pretrained with a backbone module of your own, or "
                "not a file of this library): pass that module as `backbone` and the file as its weights"
            )
        return cls(state, architecture, str(source))

    @property
    def recorded_transform(self) -> Optional[dict]:
        """The evaluation transform recorded at pretraining (mean, std, size, channels, resize), or None."""
        return transform_in(self.state)

    @property
    def record(self) -> dict:
        """What a classifier on it records: ``{"architecture": ..., "transform": ...}``."""
        return dict(architecture=self.architecture, transform=self.recorded_transform)

    def build(self, weights: bool = True) -> tuple[nn.Module, int]:
        """``(backbone, feature_dim)``; ``weights=False``: the same architecture randomly initialised."""
        backbone, dim = build_backbone(**self.architecture)
        if weights:
            backbone.load_state_dict(self.state, strict=True)
        return backbone, dim

    def transform(self) -> Callable:
        """Any PIL image to the tensor the encoder takes (its channels, resize and centre crop, normalisation), as
        recorded at pretraining; for a file that records none (before 0.3, a datamodule of your own), ImageNet's
        mean and std (or their averages for one channel) at the encoder's size, with a warning."""
        from moco_lightning.datamodules.images import to_mode
        from moco_lightning.datamodules.transforms import eval_transform

        recorded, architecture = self.recorded_transform, self.architecture
        if recorded is None:
            warnings.warn(
                f"{self.source} does not record its evaluation transform: ImageNet's mean and std assumed at "
                f"{architecture.get('image_size', 224)} px; if the encoder was trained on other statistics, give them",
                stacklevel=3,
            )
            channels = architecture.get("in_channels", 3)
            mean, std = default_normalisation(channels)
            recorded = dict(image_size=architecture.get("image_size", 224), in_channels=channels, resize=None,
                            mean=mean, std=std)  # fmt: skip
        steps = eval_transform(recorded["image_size"], recorded["mean"], recorded["std"], recorded.get("resize"))
        return Compose([partial(to_mode, channels=recorded["in_channels"]), steps])


#: an encoder read already, for the classifier being built (:func:`given_encoder`)
_GIVEN: ContextVar[Optional[Encoder]] = ContextVar("moco_lightning_given_encoder", default=None)


@contextmanager
def given_encoder(encoder: Encoder) -> Iterator[Encoder]:
    """Inside, a classifier given ``ckpt_path=encoder.source`` uses ``encoder`` instead of reading the file again."""
    token = _GIVEN.set(encoder)
    try:
        yield encoder
    finally:
        _GIVEN.reset(token)


def read_encoder(source: Union[str, Path, Encoder], arg: str = "model.ckpt_path") -> Encoder:
    """``source`` as an :class:`Encoder`: itself, the one :func:`given_encoder` holds for that file, or read."""
    if isinstance(source, Encoder):
        return source
    given = _GIVEN.get()
    return given if given is not None and given.source == str(source) else Encoder.read(source, arg=arg)


# --- thin aliases of Encoder, for earlier callers --------------------------------------------------------------
def load_encoder(
    source: str | Path,
    weights: bool = True,
    expect: Literal["export", "either"] = "either",
    arg: str = "model.ckpt_path",
) -> tuple[nn.Module, int]:
    """``(backbone, feature_dim)`` of ``source``: :meth:`Encoder.read` then :meth:`Encoder.build`."""
    return Encoder.read(source, expect, arg).build(weights)


def encoder_from(state: Any, architecture: dict, weights: bool = True) -> tuple[nn.Module, int]:
    """``(backbone, feature_dim)`` of a backbone state and architecture read already: :meth:`Encoder.build`."""
    return Encoder(state, architecture).build(weights)


def load_transform(source: str | Path, arg: str = "--ckpt") -> Callable:
    """The evaluation transform of ``source``'s encoder: :meth:`Encoder.transform`."""
    return Encoder.read(source, arg=arg).transform()
