"""The pretrained encoder of a file, for everything downstream: linear evaluation, ``moco-lightning evaluate``,
``moco-lightning export`` and :func:`moco_lightning.load_backbone` read it here.

A source is a checkpoint of any pretraining method (its backbone's architecture from the hyper-parameters, its
weights from ``backbone.*``, or from the momentum copy's) or a file ``moco-lightning export`` wrote (a
torchvision-style state dict whose ``_metadata`` names its architecture: the backbone's name, ``width``,
``in_channels``, ``stem``, ``image_size``; ``load_state_dict`` ignores it).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from torch import nn
from torchvision.transforms import Compose

from moco_lightning.constants import IMAGENET_MEAN, IMAGENET_STD, default_normalisation  # noqa: F401
from moco_lightning.errors import ConfigError
from moco_lightning.modules.backbones import build_backbone, is_backbone_spec
from moco_lightning.training.checkpoint_io import read_checkpoint
from moco_lightning.training.compat import format2_momentum_copy, warn_cifar_stem

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
    copies = (checkpoint.get("moco_lightning") or {}).get("momentum_copies")
    if copies is not None:
        return copies.get("backbone")
    return format2_momentum_copy(checkpoint["state_dict"])


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
    evaluation: the
    pretrained encoder, frozen; a fine-tuning: the encoder it trained), with the architecture and evaluation
    transform it recorded (``checkpoint["encoder"]``)."""
    if encoder != "query":
        raise ConfigError(
            f"{path} is a linear-evaluation / fine-tuning checkpoint: it holds one encoder, not a momentum copy; use "
            "--encoder query (its backbone)"
        )
    state, recorded = submodule_state(checkpoint["state_dict"], "backbone"), checkpoint[ENCODER_KEY]
    if not state or not recorded.get("architecture"):
        raise ConfigError(f"{path}: a linear-evaluation checkpoint without backbone.* weights or their architecture")
    return described(state, recorded["architecture"], recorded.get("transform"))


def encoder_of(
    source: str | Path, expect: Literal["export", "either"] = "either", arg: str = "model.ckpt_path"
) -> tuple[OrderedDict, dict]:
    """``(backbone state dict, architecture)`` of ``source``, a checkpoint of any pretraining method or an export
    (``expect``: exports only); one-line errors naming the file and ``arg``, the setting that gave it."""
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
            f"{source}: the file does not name its backbone (pretrained with a backbone module of your own, or not a "
            "file of this library): pass that module as `backbone` and the file as its weights"
        )
    return state, architecture


def load_encoder(
    source: str | Path,
    weights: bool = True,
    expect: Literal["export", "either"] = "either",
    arg: str = "model.ckpt_path",
) -> tuple[nn.Module, int]:
    """``(backbone, feature_dim)`` of ``source`` (:func:`encoder_of`); ``weights=False``: the same architecture,
    randomly initialised (a from-scratch baseline)."""
    return encoder_from(*encoder_of(source, expect, arg), weights)


def encoder_from(state: Any, architecture: dict, weights: bool = True) -> tuple[nn.Module, int]:
    """``(backbone, feature_dim)`` of a file's backbone state and architecture (:func:`encoder_of`) read already."""
    backbone, dim = build_backbone(**architecture)
    if weights:
        backbone.load_state_dict(state, strict=True)
    return backbone, dim


def load_transform(source: str | Path, arg: str = "--ckpt") -> Callable:
    """The evaluation transform of ``source``'s encoder (a checkpoint or an export): any PIL image to the tensor the
    encoder takes (its channels, resize and centre crop, normalisation), as recorded at pretraining; for a file
    that records none (moco-lightning before 0.3, a datamodule of your own), ImageNet's mean and std (or their
    averages for one channel) at the encoder's size, with a warning."""
    return transform_of(*encoder_of(source, arg=arg), source)


def transform_of(state: Any, architecture: dict, source: Any) -> Callable:
    """:func:`load_transform` of a file's backbone state and architecture (:func:`encoder_of`) read already."""
    from moco_lightning.datamodules.images import to_mode
    from moco_lightning.datamodules.transforms import eval_transform

    recorded = transform_in(state)
    if recorded is None:
        warnings.warn(
            f"{source} does not record its evaluation transform: ImageNet's mean and std assumed at "
            f"{architecture.get('image_size', 224)} px; if the encoder was trained on other statistics, give them",
            stacklevel=3,
        )
        channels = architecture.get("in_channels", 3)
        mean, std = default_normalisation(channels)
        recorded = dict(image_size=architecture.get("image_size", 224), in_channels=channels, resize=None, mean=mean,
                        std=std)  # fmt: skip
    size, channels = recorded["image_size"], recorded["in_channels"]
    steps = eval_transform(size, recorded["mean"], recorded["std"], recorded.get("resize"))
    return Compose([partial(to_mode, channels=channels), steps])


def load_weights(backbone: nn.Module, source: str | Path, arg: str = "model.ckpt_path") -> None:
    """Loads into ``backbone`` (a module of the user's own) the weights of ``source``: a checkpoint of pretraining
    (its ``backbone.*`` entries), or a plain state dict of the backbone (keys with or without ``backbone.``). When the
    file names the architecture it was pretrained as, ``backbone`` must compute its features
    (:func:`check_same_features`): weights that load strictly into another stem compute other features."""
    obj = read_checkpoint(source, expect="either", arg=arg)
    state = obj.get("state_dict", obj)
    prefixed = {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.")}
    backbone.load_state_dict(prefixed if prefixed else state, strict=True)
    architecture = architecture_in(obj) or (architecture_of(obj.get("hyper_parameters") or {}) if prefixed else None)
    if architecture is not None:
        check_same_features(backbone, encoder_from(backbone.state_dict(), architecture)[0], architecture, source, arg)


def check_same_features(module: nn.Module, reference: nn.Module, architecture: dict, source: Any, arg: str) -> None:
    """Refuses, in one line, a ``module`` that computes other features than ``reference`` (the architecture the
    weights were pretrained as, holding the same weights) on two random images of the recorded size, in eval mode."""
    size, channels = architecture.get("image_size", 224), architecture.get("in_channels", 3)
    x = torch.randn(2, channels, size, size, generator=torch.Generator().manual_seed(0))
    modes = [m.training for m in module.modules()]
    try:
        with torch.no_grad():
            expected = reference.eval()(x).flatten(1)
            got = module.eval()(x.to(next(module.parameters(), x).device)).flatten(1).to(expected.device)
        cosine = float(nn.functional.cosine_similarity(got, expected).min()) if got.shape == expected.shape else None
        reason = f"features of shape {tuple(got.shape[1:])}" if cosine is None else ""
    except RuntimeError as e:
        cosine, reason = None, (str(e).strip().splitlines() or ["it cannot run"])[0][:200]
    finally:
        for m, mode in zip(module.modules(), modes):
            m.training = mode
    if cosine is None or cosine < 0.999:
        differs = f"cosine {cosine:.2f} to" if cosine is not None else f"{reason}: no features comparable with"
        trained = ", ".join(f"{k} {v}" for k, v in architecture.items())
        raise ConfigError(
            f"{arg} {source}: your backbone module loads these weights but computes other features ({differs} those "
            f"of the architecture they were pretrained as: {trained}); build it with moco_lightning.load_backbone or "
            "moco_lightning.modules.backbones.build_backbone(**that architecture)"
        )


def choose_encoder(
    backbone: Any, source: Optional[str], arg: str, weights: bool, feature_dim: Optional[int], **architecture: Any
) -> tuple[nn.Module, int, dict]:
    """The encoder an evaluation trains on, its feature size and its record (``{"architecture": what it was built
    as, empty for a module; "transform": the evaluation transform its file recorded}``): ``backbone`` (a
    module, or a name built with ``architecture``: :func:`moco_lightning.modules.backbones.build_backbone`'s arguments)
    with
    the weights of ``source`` when given and ``weights``; without ``backbone``, the encoder of ``source`` as the file
    records it (:func:`encoder_of`; ``architecture`` is then not used)."""
    if backbone is None:
        if source is None:
            raise ConfigError(
                "LinearClassifier needs a backbone: set model.ckpt_path (a checkpoint of pretraining) or "
                "model.backbone_state_dict (a file `moco-lightning export` wrote), or model.backbone"
            )
        state, recorded = encoder_of(source, arg=arg)
        return (*encoder_from(state, recorded, weights), dict(architecture=recorded, transform=transform_in(state)))
    if isinstance(backbone, nn.Module) and feature_dim is not None:
        module, dim = backbone, feature_dim
    else:
        warn_cifar_stem(architecture.get("cifar_stem", False), "LinearClassifier")
        module, dim = build_backbone(backbone, **architecture)
    if source is not None and weights:
        load_weights(module, source, arg)
    built = {"backbone": backbone, **architecture} if isinstance(backbone, str) else {}
    return module, dim, dict(architecture=built, transform=None)


def contradictions(given: dict, defaults: dict, recorded: dict) -> list[str]:
    """The architecture settings in ``given`` that were set (differ from ``defaults``) to other values than the
    encoder's ``recorded`` architecture: ``["width=2.0 (the encoder's: 0.5)", ...]``. The stem is compared as built
    (``cifar_stem=True`` is the ``"cifar"`` stem)."""

    def stem(a: dict) -> str:
        return a.get("stem") or ("cifar" if a.get("cifar_stem") else "imagenet")

    out = [f"{k}={given[k]} (the encoder's: {recorded[k]})" for k in ("in_channels", "image_size", "width")
           if k in recorded and given[k] != defaults[k] and given[k] != recorded[k]]  # fmt: skip
    set_stem = given.get("stem") is not None or given.get("cifar_stem")
    if set_stem and stem(given) != stem(recorded):
        out.append(f"stem={stem(given)} (the encoder's: {stem(recorded)})")
    return out
