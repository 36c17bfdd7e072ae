"""Split BatchNorm: BatchNorm statistics over N sub-batches of one device's batch.

MoCo's shuffle BN (He et al. 2020, §3.3) needs BatchNorm statistics computed over several
independent sub-batches, so that the key of an image is not normalised with the statistics of the
very sub-batch its query sits in ("the model appears to 'cheat' the pretext task"). Across GPUs each
device's batch is one sub-batch; on a single device the official MoCo CIFAR demo simulates N devices
by splitting the batch (``SplitBatchNorm``, num_splits=8). This version keeps BatchNorm2d's buffers
and parameter shapes, so checkpoints and exported backbones stay plain torchvision state dicts.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._lightning import uses_sync_batchnorm
from .errors import ConfigError


class SplitBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training-mode statistics are computed over ``num_splits`` contiguous sub-batches.

    Each sub-batch is normalised exactly as if it went through BatchNorm2d on its own; the running
    statistics move by the average of the sub-batches' statistics. In eval mode it is BatchNorm2d.
    """

    def __init__(self, num_features: int, num_splits: int, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        self.num_splits = num_splits

    def forward(self, x: Tensor) -> Tensor:
        n, c, h, w = x.shape
        s = self.num_splits
        if not self.training or s == 1:
            return super().forward(x)
        if n % s != 0:
            raise ConfigError(f"split BatchNorm: the batch of {n} does not split into bn_splits={s} equal sub-batches")
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        # Sub-batches are contiguous slices in either memory format: normalising each slice with the fused
        # kernel needs no rearranged copy of the activations (one concatenation, and channels-last stays so).
        stats = (self.running_mean.repeat(s, 1), self.running_var.repeat(s, 1)) if self.track_running_stats else None
        y = torch.cat(
            [
                F.batch_norm(
                    chunk,
                    stats[0][j] if stats else None,
                    stats[1][j] if stats else None,
                    self.weight,
                    self.bias,
                    True,
                    momentum,
                    self.eps,
                )
                for j, chunk in enumerate(x.chunk(s))
            ]
        )
        if stats is not None:  # the running statistics move by the average of the sub-batches' statistics
            with torch.no_grad():
                self.running_mean.copy_(stats[0].mean(0))
                self.running_var.copy_(stats[1].mean(0))
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_splits={self.num_splits}"


def convert_split_bn(module: nn.Module, num_splits: int) -> nn.Module:
    """Replaces every BatchNorm2d in ``module`` by a SplitBatchNorm2d with the same parameters and buffers."""
    if (
        type(module) is not nn.BatchNorm2d
        and isinstance(module, nn.BatchNorm2d)
        and not isinstance(module, SplitBatchNorm2d)
    ):
        raise ConfigError(
            f"split BatchNorm: {type(module).__name__} is a BatchNorm2d subclass with behaviour of its own (timm's "
            "BatchNormAct2d fuses an activation): it cannot be split; use a backbone with plain BatchNorm2d, or "
            "shuffle_bn='off' (no protection against the BatchNorm shortcut) or 'ddp' on several devices"
        )
    if type(module) is nn.BatchNorm2d:
        return _with_state_of(module, SplitBatchNorm2d(module.num_features, num_splits, **_settings(module)))
    for name, child in module.named_children():
        setattr(module, name, convert_split_bn(child, num_splits))
    return module


def revert_split_bn(module: nn.Module) -> nn.Module:
    """The inverse of :func:`convert_split_bn`: every SplitBatchNorm2d back to a BatchNorm2d with the same state."""
    if isinstance(module, SplitBatchNorm2d):
        return _with_state_of(module, nn.BatchNorm2d(module.num_features, **_settings(module)))
    for name, child in module.named_children():
        setattr(module, name, revert_split_bn(child))
    return module


def shuffle_mode(requested: str, backbone: nn.Module, trainer: Any) -> str:
    """The shuffle-BN mode to use: ``"auto"`` is ``"ddp"`` with several processes, ``"split"`` on one, ``"off"``
    for a backbone without BatchNorm."""
    mode = requested
    if mode == "auto":
        has_bn = any(isinstance(m, nn.BatchNorm2d) for m in backbone.modules())
        mode = "off" if not has_bn else "ddp" if trainer.world_size > 1 else "split"
    if mode == "ddp" and trainer.world_size == 1:
        raise ConfigError(
            "MoCo: shuffle_bn='ddp' needs a distributed run (world size > 1); use 'split' or 'auto' on one device"
        )
    if mode != "off" and uses_sync_batchnorm(trainer):
        warnings.warn(
            "MoCo: sync_batchnorm=True computes BN statistics over the global batch, which defeats "
            f"shuffle_bn={mode!r} for MoCo v1/v2; turn one of them off",
            stacklevel=2,
        )
    return mode


def check_bn_splits(bn_splits: int, per_device: int) -> None:
    if per_device % bn_splits:
        raise ConfigError(
            f"MoCo: bn_splits={bn_splits} does not divide the per-device batch of {per_device} images (the training "
            f"loader's batch_size, data.batch_size): split BatchNorm needs equal sub-batches; set model.bn_splits to "
            f"a divisor of {per_device}, or data.batch_size to a multiple of {bn_splits}"
        )
    if per_device // bn_splits < 2:
        raise ConfigError(
            f"MoCo: bn_splits={bn_splits} splits the per-device batch of {per_device} images into sub-batches of "
            f"{per_device // bn_splits}: BatchNorm needs at least 2 images per sub-batch; set model.bn_splits to at "
            f"most {max(1, per_device // 2)} or raise data.batch_size"
        )


def _settings(bn: nn.BatchNorm2d) -> dict:
    return dict(eps=bn.eps, momentum=bn.momentum, affine=bn.affine, track_running_stats=bn.track_running_stats)


def _with_state_of(old: nn.BatchNorm2d, new: nn.BatchNorm2d) -> nn.BatchNorm2d:
    """``new`` with ``old``'s statistics, weights, mode, frozen parameters and device."""
    new.load_state_dict(old.state_dict())
    new.train(old.training)
    if old.affine:
        new.weight.requires_grad_(old.weight.requires_grad)
        new.bias.requires_grad_(old.bias.requires_grad)
    return new.to(old.weight.device if old.affine else next(iter(old.buffers())).device)
