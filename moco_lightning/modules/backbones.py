"""Backbones: any torchvision classification model by name, or any ``nn.Module``, as a feature extractor.

The classifier is removed, so the backbone maps images to features (N, D); D is found by itself.
Small images get the CIFAR-style stem of the official MoCo CIFAR demo (a 3x3 stride-1 first
convolution and no max-pool, for ResNets), and grayscale images a one-channel first convolution.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple, Union

import torch
import torchvision
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from moco_lightning.errors import ConfigError

# Attribute holding the classifier in torchvision's model families.
_HEADS = ("fc", "heads", "classifier", "head")


def torchvision_models() -> list[str]:
    """Names of torchvision's image-classification models (what ``backbone`` accepts as a string)."""
    return sorted(torchvision.models.list_models(module=torchvision.models))


#: where a backbone given as a ``{class_path, init_args}`` spec may come from (a checkpoint names it: nothing else
#: is imported or called for a file's say-so)
SPEC_PACKAGES = ("moco_lightning.", "torchvision.", "timm.")


def is_backbone_spec(value: Any) -> bool:
    """A backbone described as ``{"class_path": ..., "init_args": {...}}`` (how the CLI records a module it built)."""
    return isinstance(value, Mapping) and isinstance(value.get("class_path"), str)


def build_from_spec(spec: Mapping) -> nn.Module:
    """The ``nn.Module`` a spec describes; only classes of :data:`SPEC_PACKAGES` that are ``nn.Module`` subclasses."""
    import importlib

    path = spec["class_path"]
    module_name, _, name = path.rpartition(".")
    found = None
    if path.startswith(SPEC_PACKAGES):
        try:
            found = getattr(importlib.import_module(module_name), name, None)
        except ImportError:
            found = None
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ConfigError(
            f"backbone class_path {path!r}: not an nn.Module class of {', '.join(p[:-1] for p in SPEC_PACKAGES)}; "
            "build that backbone yourself and pass the module (backbone=...)"
        )
    return found(**dict(spec.get("init_args") or {}))


#: the stems of a ResNet (its first convolution and max-pool): what a 28-px image becomes before the first stage
STEMS = {
    "imagenet": "torchvision's 7x7 convolution at stride 2 and a 3x3 max-pool: 7x7 maps at 28 px (1x1 at the end)",
    "cifar": "the official MoCo CIFAR demo's 3x3 convolution at stride 1, no max-pool: 28x28 maps (~16x the compute)",
    "cifar_stride2": "a 3x3 convolution at stride 2, no max-pool: 14x14 maps at 28 px (~4x imagenet's compute)",
}


def resolve_stem(stem: Optional[str], cifar_stem: bool = False) -> str:
    """The stem to build: ``stem`` if given, else ``"cifar"`` for the older ``cifar_stem=True``, else ``"imagenet"``."""
    if stem is None:
        return "cifar" if cifar_stem else "imagenet"
    if stem not in STEMS:
        raise ConfigError(f"stem={stem!r} is not allowed; stem must be one of {', '.join(map(repr, STEMS))}")
    if cifar_stem and stem != "cifar":
        raise ConfigError(f"cifar_stem=True and stem={stem!r} disagree: set stem alone (cifar_stem is its old name)")
    return stem


def build_backbone(
    backbone: Union[str, nn.Module, Mapping],
    cifar_stem: bool = False,
    in_channels: int = 3,
    image_size: int = 224,
    width: float = 1.0,
    stem: Optional[str] = None,
) -> Tuple[nn.Module, int]:
    """Returns ``(feature_extractor, feature_dim)``.

    Args:
        backbone: a torchvision model name (``"resnet18"``, ``"resnet50"``, ``"vit_b_16"``...), built
            with random weights; ``"timm:<name>"`` for a timm model (``"timm:resnet10t"``,
            ``"timm:vit_small_patch16_224"``:
            random weights, no classifier, ``in_chans`` and, for models that take it, ``img_size`` set; extra
            ``[timm]``); or an ``nn.Module`` mapping images to features (N, D), or its ``{class_path, init_args}``
            spec (:func:`build_from_spec`).
        cifar_stem: ResNets only: the ``"cifar"`` stem (its older name; ``stem`` says it now).
        in_channels: input channels; the first convolution is rebuilt when this is not 3.
        image_size: side of the dummy input used to find D when it cannot be read off the model.
        width: ResNets only: every stage's channels times ``width`` (0.5: 32-64-128-256 for ResNet-18),
            for small data and small machines.
        stem: ResNets (torchvision's and timm's): one of :data:`STEMS` (None: ``cifar_stem`` decides).
    """
    stem = resolve_stem(stem, cifar_stem)
    if is_backbone_spec(backbone):
        backbone = build_from_spec(backbone)
    if isinstance(backbone, nn.Module):
        ignored = [f"{k}={v!r}" for k, v in (("width", width), ("stem", stem)) if v not in (1.0, None, "imagenet")]
        if ignored:
            raise ConfigError(
                f"{', '.join(ignored)}: these build torchvision / timm ResNets named by a string, and the backbone "
                f"given is a module ({type(backbone).__name__}), used as it is; drop them (or name the backbone)"
            )
        return backbone, _probe_dim(backbone, in_channels, image_size)
    if isinstance(backbone, str) and backbone.startswith("timm:"):
        model = _timm_model(backbone[len("timm:") :], in_channels, image_size, width)
        if stem != "imagenet":
            _small_stem(model, in_channels, backbone, stride=1 if stem == "cifar" else 2)
        return model, _probe_dim(model, in_channels, image_size)
    names = torchvision_models()
    if backbone not in names:
        raise ConfigError(
            f"backbone={backbone!r} is not a torchvision classification model; use one of {names} or pass an nn.Module"
        )
    if width <= 0:
        raise ConfigError(f"width must be > 0, got {width}")
    kwargs = {"image_size": image_size} if backbone.startswith("vit_") else {}
    if width != 1.0:
        model = _narrow_resnet(backbone, width)
    else:
        model = torchvision.models.get_model(backbone, weights=None, **kwargs)
    if stem != "imagenet":
        _small_stem(model, in_channels, backbone, stride=1 if stem == "cifar" else 2)
    elif in_channels != 3:
        _replace_first_conv(model, in_channels)
    dim = None
    for attr in _HEADS:
        if hasattr(model, attr):
            head = getattr(model, attr)
            dim = head.in_features if isinstance(head, nn.Linear) else None
            setattr(model, attr, nn.Identity())
            break
    else:
        raise ConfigError(
            f"backbone={backbone!r}: no classifier attribute among {_HEADS} to remove; pass an nn.Module instead"
        )
    return model, dim if dim is not None else _probe_dim(model, in_channels, image_size)


def zero_init_residuals(model: nn.Module) -> int:
    """Zeroes the last BatchNorm weight of every torchvision residual block (``bn2`` of a BasicBlock, ``bn3`` of a
    Bottleneck), as torchvision's ``zero_init_residual=True`` (Goyal et al. 2017): each block starts as the identity.
    Returns the number of blocks changed."""
    blocks = 0
    for module in model.modules():
        last = {BasicBlock: "bn2", Bottleneck: "bn3"}.get(type(module))
        bn = getattr(module, last, None) if last else None
        if isinstance(bn, nn.BatchNorm2d) and bn.weight is not None:
            nn.init.zeros_(bn.weight)
            blocks += 1
    return blocks


def _small_stem(model: nn.Module, in_channels: int, name: str, stride: int) -> None:
    """A stem for small images: a 3x3 first convolution at ``stride`` (1: the official CIFAR demo's) and no max-pool.
    A deep stem (timm's ``resnet*d``/``*t``: three 3x3 convolutions) keeps its convolutions, the first at ``stride``."""
    conv1 = getattr(model, "conv1", None)
    first = (
        next((m for m in conv1.modules() if isinstance(m, nn.Conv2d)), None) if isinstance(conv1, nn.Module) else None
    )
    if first is None or not hasattr(model, "maxpool"):
        raise ConfigError(
            f"a small-image stem (stem / cifar_stem) applies to ResNet-style backbones (a conv1 stem + maxpool); "
            f"{name!r} has none"
        )
    if isinstance(conv1, nn.Conv2d):
        model.conv1 = nn.Conv2d(in_channels, conv1.out_channels, 3, stride, 1, bias=False)
    else:
        first.stride = (stride, stride)
    model.maxpool = nn.Identity()


def _timm_model(name: str, in_channels: int, image_size: int, width: float) -> nn.Module:
    """A timm model with random weights and no classifier (``num_classes=0``: pooled features)."""
    try:
        import timm
    except ImportError:
        raise ConfigError(f"backbone='timm:{name}' needs timm: pip install 'moco-lightning[timm]'") from None
    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:10]
        raise ConfigError(
            f"backbone='timm:{name}': timm {timm.__version__} has no model {name!r}"
            + (f"; similar: {close}" if close else "; see timm.list_models()")
        )
    if width != 1.0:
        raise ConfigError(
            f"width={width} applies to torchvision's resnetNN backbones; timm models have their own "
            "width variants (e.g. timm:resnet18d, timm:mobilenetv3_small_050)"
        )
    kwargs = dict(pretrained=False, num_classes=0, in_chans=in_channels)
    try:  # ViTs and other fixed-size models take the image size; most convolutional ones do not
        return timm.create_model(name, img_size=image_size, **kwargs)
    except TypeError:
        return timm.create_model(name, **kwargs)


class ViT(torchvision.models.VisionTransformer):
    """torchvision's VisionTransformer that returns the class token's features (no classifier), any input channels.

    The defaults are ViT-Small (Touvron et al. 2021; MoCo v3, Chen, Xie, He 2021, Table 1: 12 blocks, 6 heads,
    384-d, MLP 1536) with 4x4 patches for 28-32 px images; ``image_size=224, patch_size=16`` is the paper's.
    Use it from a config as ``backbone: {class_path: moco_lightning.modules.backbones.ViT, init_args: {...}}``.
    """

    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 4,
        in_channels: int = 3,
        num_layers: int = 12,
        num_heads: int = 6,
        hidden_dim: int = 384,
        mlp_dim: int = 1536,
    ) -> None:
        if image_size % patch_size:
            raise ConfigError(f"ViT: image_size={image_size} must be a multiple of patch_size={patch_size}")
        super().__init__(image_size, patch_size, num_layers, num_heads, hidden_dim, mlp_dim)
        if in_channels != 3:
            self.conv_proj = nn.Conv2d(in_channels, hidden_dim, patch_size, patch_size)
        self.heads = nn.Identity()


class NarrowResNet(torchvision.models.ResNet):
    """torchvision's ResNet with every stage ``width`` times as wide. At module level: a model is pickled into the
    processes of ``DDPStrategy(start_method="spawn")`` (a class defined in a function cannot be)."""

    def __init__(self, block: type, layers: list, width: float) -> None:
        self.width = width  # read by _make_layer, which ResNet.__init__ calls
        super().__init__(block, layers)

    def _make_layer(self, block, planes, blocks, stride=1, dilate=False):  # noqa: ANN001 - torchvision's signature
        if planes == 64:  # the first stage: its input is the (narrow) stem
            self.inplanes = max(1, round(64 * self.width))
        return super()._make_layer(block, max(1, round(planes * self.width)), blocks, stride, dilate)


def _narrow_resnet(name: str, width: float) -> nn.Module:
    """torchvision's ResNet ``name`` with every stage ``width`` times as wide (same code, same state-dict keys)."""
    if not (name.startswith("resnet") and name[6:].isdigit()):
        raise ConfigError(f"width={width} applies to torchvision's resnetNN backbones, not {name!r}")
    reference = torchvision.models.get_model(name, weights=None)
    block = type(reference.layer1[0])
    layers = [len(getattr(reference, f"layer{i}")) for i in range(1, 5)]

    model = NarrowResNet(block, layers, width)
    stem = max(1, round(64 * width))
    model.conv1 = nn.Conv2d(3, stem, 7, 2, 3, bias=False)
    model.bn1 = nn.BatchNorm2d(stem)
    model.fc = nn.Linear(max(1, round(512 * width)) * block.expansion, 1000)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model


def _replace_first_conv(model: nn.Module, in_channels: int) -> None:
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(
                    parent,
                    name,
                    nn.Conv2d(
                        in_channels,
                        child.out_channels,
                        child.kernel_size,
                        child.stride,
                        child.padding,
                        child.dilation,
                        child.groups,
                        child.bias is not None,
                    ),
                )
                return
    raise ConfigError("in_channels != 3 needs a first nn.Conv2d to rebuild; the backbone has none")


@torch.no_grad()
def _probe_dim(model: nn.Module, in_channels: int, image_size: int) -> int:
    was_training = model.training
    model.eval()
    try:
        out = model(torch.zeros(2, in_channels, image_size, image_size))
    except Exception as e:  # noqa: BLE001 - re-raised with the argument that fixes it
        raise ConfigError(
            f"could not run the backbone on a (2, {in_channels}, {image_size}, {image_size}) input to find its "
            f"feature size ({e}); set in_channels/image_size to what it expects"
        ) from e
    finally:
        model.train(was_training)
    if out.ndim != 2:
        raise ConfigError(f"the backbone must return features of shape (N, D); it returned {tuple(out.shape)}")
    return out.shape[1]
