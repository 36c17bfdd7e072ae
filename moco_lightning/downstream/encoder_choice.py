"""The encoder a classifier trains on (:class:`~moco_lightning.downstream.linear_eval.LinearClassifier`): the
file's own (:class:`~moco_lightning.downstream.encoder.Encoder`), or a backbone the user names or passes with the
file's weights loaded into it, checked to compute the features those weights were pretrained to compute."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from moco_lightning.downstream.encoder import architecture_in, architecture_of, encoder_from, read_encoder
from moco_lightning.errors import ConfigError
from moco_lightning.modules.backbones import build_backbone
from moco_lightning.training.checkpoint_io import read_checkpoint
from moco_lightning.training.compat import warn_cifar_stem


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
    module, or a name built with ``architecture``: :func:`moco_lightning.modules.backbones.build_backbone`'s
    arguments) with the weights of ``source`` when given and ``weights``; without ``backbone``, the encoder of
    ``source`` (a file, or an :class:`~moco_lightning.downstream.encoder.Encoder` read already) as the file records
    it; ``architecture`` is then not used."""
    if backbone is None:
        if source is None:
            raise ConfigError(
                "LinearClassifier needs a backbone: set model.ckpt_path (a checkpoint of pretraining) or "
                "model.backbone_state_dict (a file `moco-lightning export` wrote), or model.backbone"
            )
        encoder = read_encoder(source, arg)
        return (*encoder.build(weights), encoder.record)
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
