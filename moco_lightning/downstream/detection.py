"""A pretrained ResNet for object detection, MoCo's headline transfer (He et al. 2020, §4.2: Mask R-CNN and Faster
R-CNN initialised from the MoCo encoder beat their ImageNet-supervised twins).

Two exports of a checkpoint's backbone (``moco-lightning export --format ...``):

- ``detectron2``: the pickle facebookresearch/moco's ``detection/convert-pretrain-to-detectron2.py`` writes, ``{"model":
  {name: numpy array}, "__author__": "MOCO", "matching_heuristics": True}``, its names mapped the same way
  (``conv1``/``bn1`` -> ``stem.conv1``/``stem.conv1.norm``, ``layerN`` -> ``res{N+1}``, ``bnK`` -> ``convK.norm``,
  ``downsample.0/1`` -> ``shortcut``/``shortcut.norm``). ``MODEL.WEIGHTS`` takes the file; the settings it needs
  (depth, stem width, pixel statistics in detectron2's 0-255 RGB) are printed by the export.
- ``torchvision-detection``: a state dict that loads strictly into the ``body`` of torchvision's ResNet-FPN backbone
  (``torchvision.models.detection.backbone_utils.resnet_fpn_backbone(backbone_name=..., weights=None).body``), hence
  into ``fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None).backbone.body`` and its kin.

Both need what detection backbones are: a torchvision ResNet (or ResNeXt / wide ResNet) with the ImageNet stem (7x7
convolution and max-pool) on three channels. A ResNet pretrained with a small-image stem loads its 3x3 weights
nowhere there (or, with the max-pool kept, computes other features), so any other architecture is refused.
``num_batches_tracked`` counters are left out: detection's frozen BatchNorm has none.
"""

from __future__ import annotations

import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from moco_lightning.errors import ConfigError

#: torchvision's ResNet family, the backbones both detection libraries build
RESNETS = re.compile(r"^(resnet(18|34|50|101|152)|resnext\d+_\d+x\d+d|wide_resnet(50|101)_2)$")


def check_detection_backbone(architecture: dict, fmt: str) -> None:
    """Refuses, in one line, an architecture that a detection backbone cannot hold."""
    name, stem = (
        architecture.get("backbone"),
        architecture.get("stem") or ("cifar" if architecture.get("cifar_stem") else "imagenet"),
    )
    problems = []
    if not isinstance(name, str) or not RESNETS.match(name):
        problems.append(f"backbone {name!r} (a torchvision ResNet is needed)")
    if stem != "imagenet":
        problems.append(f"stem {stem!r} (the ImageNet stem, 7x7 and max-pool, is needed)")
    if architecture.get("in_channels", 3) != 3:
        problems.append(f"in_channels {architecture.get('in_channels')} (RGB, 3, is needed)")
    if fmt == "torchvision-detection" and architecture.get("width", 1.0) != 1.0:
        problems.append(f"width {architecture.get('width')} (torchvision builds full-width ResNets; detectron2 "
                        "takes other widths)")  # fmt: skip
    if problems:
        raise ConfigError(
            f"--format {fmt}: this encoder cannot be a detection backbone: {'; '.join(problems)}. Pretrain with "
            "model.backbone resnet50 and model.stem imagenet on 3-channel images (configs/moco_v2.yaml) for detection"
        )


def detectron2_name(name: str) -> str:
    """A torchvision ResNet parameter's name in detectron2's ResNet, as the official MoCo converter maps it."""
    if "layer" not in name:
        name = "stem." + name
    for t in (1, 2, 3, 4):
        name = name.replace(f"layer{t}", f"res{t + 1}")
    for t in (1, 2, 3):
        name = name.replace(f"bn{t}", f"conv{t}.norm")
    return name.replace("downsample.0", "shortcut").replace("downsample.1", "shortcut.norm")


def detection_weights(state: dict) -> OrderedDict[str, torch.Tensor]:
    """The backbone's tensors a frozen-BatchNorm ResNet loads: all but ``num_batches_tracked`` and a classifier."""
    return OrderedDict(
        (k, v) for k, v in state.items() if not k.endswith("num_batches_tracked") and not k.startswith("fc.")
    )


def write_detectron2(state: dict, out: Path, matching_heuristics: bool = True) -> dict[str, Any]:
    """Writes detectron2's pickle of ``state`` (torchvision names) to ``out``; returns what it wrote."""
    model = {detectron2_name(k): v.detach().cpu().numpy() for k, v in detection_weights(state).items()}
    written = {"model": model, "__author__": "MOCO", "matching_heuristics": matching_heuristics}
    with open(out, "wb") as f:
        pickle.dump(written, f)
    return written


def detectron2_settings(architecture: dict, transform: dict | None) -> list[str]:
    """The detectron2 config lines this backbone needs (its depth and widths, the pixel statistics it was trained on
    in detectron2's 0-255 RGB), for the export to print."""
    depth = int(re.findall(r"\d+", architecture["backbone"])[0])
    lines = [f"MODEL.RESNETS.DEPTH: {depth}", "INPUT.FORMAT: RGB", "MODEL.RESNETS.STRIDE_IN_1X1: False"]
    width, name = architecture.get("width", 1.0), architecture["backbone"]
    groups = re.match(r"resnext\d+_(\d+)x(\d+)d", name)
    if groups:  # ResNeXt: cardinality and the width of a group
        lines += [f"MODEL.RESNETS.NUM_GROUPS: {groups[1]}", f"MODEL.RESNETS.WIDTH_PER_GROUP: {groups[2]}"]
    elif name.startswith("wide_"):
        lines.append("MODEL.RESNETS.WIDTH_PER_GROUP: 128")
    elif width != 1.0 and depth >= 50:
        lines.append(f"MODEL.RESNETS.WIDTH_PER_GROUP: {round(64 * width)}")
    if depth < 50 or width != 1.0:
        stem = max(1, round(64 * width))
        res2 = stem * (1 if depth < 50 else 4)
        lines += [f"MODEL.RESNETS.STEM_OUT_CHANNELS: {stem}", f"MODEL.RESNETS.RES2_OUT_CHANNELS: {res2}"]
    if transform:
        lines += [
            f"MODEL.PIXEL_MEAN: {[round(255 * m, 3) for m in transform['mean']]}",
            f"MODEL.PIXEL_STD: {[round(255 * s, 3) for s in transform['std']]}",
        ]
    return lines
