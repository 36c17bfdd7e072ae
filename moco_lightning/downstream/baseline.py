"""Encoders a user already has, for ``evaluate --baseline``: "did pretraining beat the weights I had?"

A baseline is any file of weights: a checkpoint or an export of this library (another run), or a plain torchvision /
timm state dict (ImageNet weights downloaded elsewhere, a supervised model of your own). A plain state dict names no
architecture: a torchvision ResNet is recognised by its keys (the blocks of each stage, basic or bottleneck, the
width of its first convolution, a 7x7 ImageNet stem); anything else is named with ``arch`` (``--baseline_arch``:
``resnet50``, ``timm:resnet10t``, with ``,stem=cifar`` / ``,width=0.5`` where the weights cannot say). Its classifier
(``fc``, ``head``, ``classifier``) is dropped. It sees the images the evaluated encoder sees (the datamodule's size
and normalisation); where it was trained on another number of channels, its first convolution is adapted exactly:
RGB kernels summed for one-channel images (the same as the gray image repeated in three channels), a one-channel
kernel spread over RGB (the same as the channel mean). What was done is said in the report (``preprocessing``).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch

from moco_lightning.downstream.encoder import ENCODER_KEY, Encoder, architecture_in, described
from moco_lightning.errors import ConfigError
from moco_lightning.modules.backbones import build_backbone
from moco_lightning.training.checkpoint_io import read_checkpoint

#: (bottleneck blocks, blocks per stage) -> torchvision's ResNet depth
RESNETS = {(False, (2, 2, 2, 2)): 18, (False, (3, 4, 6, 3)): 34, (True, (3, 4, 6, 3)): 50, (True, (3, 4, 23, 3)): 101,
           (True, (3, 8, 36, 3)): 152}  # fmt: skip
CLASSIFIERS = ("fc.", "head.", "classifier.", "head_")


def read_baseline(
    source: str | Path, in_channels: int, image_size: int, arch: Optional[str] = None
) -> tuple[Encoder, str]:
    """``(encoder, how it is fed)``: the encoder of ``source`` for images of ``in_channels`` channels and
    ``image_size`` pixels, and what was done to its file (the report's ``preprocessing``); one-line errors naming
    ``--baseline``."""
    obj = read_checkpoint(source, expect="either", arg="--baseline")
    ours = architecture_in(obj) is not None or ("state_dict" in obj and ("moco_lightning" in obj or ENCODER_KEY in obj))
    if ours:
        encoder = Encoder.read(source, arg="--baseline")
        state, architecture, how = encoder.state, dict(encoder.architecture), "a moco-lightning file"
    else:
        state = OrderedDict((k.removeprefix("module."), v) for k, v in (obj.get("state_dict") or obj).items())
        architecture, how = architecture_of_weights(state, arch, source)
        state = backbone_weights(state, architecture, source)
    first = first_conv(state)
    steps = [how, f"the datamodule's images ({image_size} px, {in_channels} channel(s), its mean and std)"]
    trained = int(state[first].shape[1]) if first else in_channels
    if first and trained != in_channels:
        state = OrderedDict(state)
        kernel = state[first]
        if in_channels == 1:
            state[first] = kernel.sum(1, keepdim=True)
            steps.append(f"{first}'s {trained} input kernels summed (= the gray image in {trained} channels)")
        else:
            state[first] = kernel.mean(1, keepdim=True).expand(-1, in_channels, -1, -1).clone() / in_channels
            steps.append(f"{first}'s kernel spread over {in_channels} channels (= their mean as its one channel)")
    architecture.update(in_channels=in_channels, image_size=image_size)
    encoder = Encoder(described(OrderedDict(state), architecture, None), architecture, str(source))
    encoder.build()  # the weights fit the architecture: checked now, before any measurement
    return encoder, "; ".join(steps)


def architecture_of_weights(state: dict, arch: Optional[str], source: str | Path) -> tuple[dict, str]:
    """``(build_backbone's arguments, how they were found)`` of a plain state dict: ``arch`` (``name[,key=value]``)
    where given, else a torchvision ResNet recognised by its keys."""
    settings: dict = {}
    if arch:
        name, *pairs = arch.split(",")
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in ("stem", "width"):
                raise ConfigError(f"--baseline_arch {arch}: {key!r}: only stem=... and width=... follow the name")
            settings[key] = float(value) if key == "width" else value
        how = f"{name} (--baseline_arch)"
    else:
        name, how = recognised_resnet(state), ""
        if name is None:
            raise ConfigError(
                f"--baseline {source}: its architecture cannot be told from its keys (not a torchvision ResNet): name "
                "it with --baseline_arch (a torchvision name such as resnet50 or vit_b_16, or timm:<name>)"
            )
        how = f"{name} (recognised from its keys)"
    kernel = state.get("conv1.weight")
    if name.startswith("resnet") and kernel is not None:
        settings.setdefault("width", kernel.shape[0] / 64)
        if "stem" not in settings:
            if kernel.shape[-1] != 7:
                raise ConfigError(
                    f"--baseline {source}: conv1 is {kernel.shape[-1]}x{kernel.shape[-1]}, a small-image stem whose "
                    f"stride the weights do not say: --baseline_arch {name},stem=cifar (stride 1) or "
                    f"{name},stem=cifar_stride2"
                )
            settings["stem"] = "imagenet"
    return {"backbone": name, **settings}, how


def recognised_resnet(state: dict) -> Optional[str]:
    """``"resnet18"`` ... ``"resnet152"`` for a torchvision ResNet's state dict, else None."""
    if "conv1.weight" not in state or not any(k.startswith("layer4.") for k in state):
        return None
    blocks = tuple(len({k.split(".")[1] for k in state if k.startswith(f"layer{i}.")}) for i in range(1, 5))
    depth = RESNETS.get((any(".conv3." in k for k in state), blocks))
    return f"resnet{depth}" if depth else None


def backbone_weights(state: dict, architecture: dict, source: str | Path) -> OrderedDict:
    """``state`` as the backbone's weights: the classifier's dropped, every backbone weight present."""
    first = first_conv(state)
    backbone, _ = build_backbone(**{**architecture, "in_channels": int(state[first].shape[1]) if first else 3})
    expected = backbone.state_dict().keys()
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected and not k.startswith(CLASSIFIERS)]
    if missing or extra:
        raise ConfigError(
            f"--baseline {source}: its weights do not fit {architecture['backbone']} ("
            + "; ".join(
                f"{what} {', '.join(keys[:4])}" for what, keys in (("missing", missing), ("unexpected", extra)) if keys
            )  # fmt: skip
            + "): check --baseline_arch"
        )
    return OrderedDict((k, state[k]) for k in expected)


def first_conv(state: dict) -> Optional[str]:
    """The name of the first convolution's kernel (the first 4-d tensor): the one that meets the image's channels."""
    return next((k for k, v in state.items() if isinstance(v, torch.Tensor) and v.ndim == 4), None)
