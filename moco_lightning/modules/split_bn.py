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
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from moco_lightning._lightning import uses_sync_batchnorm
from moco_lightning.errors import ConfigError


class SplitBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training-mode statistics are computed over ``num_splits`` contiguous sub-batches.

    Each sub-batch is normalised exactly as if it went through BatchNorm2d on its own; the running
    statistics move by the average of the sub-batches' statistics. In eval mode it is BatchNorm2d.
    On a GPU the number of kernels does not grow with ``num_splits``: :class:`_SplitBatchNorm` computes every
    sub-batch's statistics in one reduction over an ``(s, N/s, C, H, W)`` view and normalises in one fused pass
    (either memory format, no copy of the activations), where a loop over the sub-batches launched ``s`` BatchNorm
    kernels, a concatenation and ``s`` copies of the running statistics per layer (the split then cost 2.5x the
    whole step of plain BN). On a CPU, where a kernel costs no launch, :func:`batch_norm_splits` runs BatchNorm's
    own kernel on each sub-batch (a contiguous slice in either memory format): it accumulates bf16 in fp32 without
    the fp32 copies of the activations that the fused reductions made there (the demo's MoCo step under bf16
    autocast on a 2-core EPYC: 148 ms fused, 126 ms per split, 129 ms with plain BatchNorm).
    """

    def __init__(self, num_features: int, num_splits: int, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        self.num_splits = num_splits

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        s = self.num_splits
        if not self.training or s == 1:
            return super().forward(x)
        if n % s != 0:
            raise ConfigError(f"split BatchNorm: the batch of {n} does not split into bn_splits={s} equal sub-batches")
        y, mean, var = batch_norm_splits(x, self.weight, self.bias, s, self.eps)
        if not self.track_running_stats:
            return y
        # the running statistics move by the average of the sub-batches' (each one's unbiased variance, as
        # BatchNorm2d's), on the device: no host read, also for momentum=None's cumulative average
        self.num_batches_tracked.add_(1)
        count = x.numel() // (s * x.shape[1])
        unbiased = count / max(count - 1, 1)
        with torch.no_grad():
            mean_sum, var_sum = mean.sum(0).view(-1), var.sum(0).view(-1)
            if self.momentum is None:
                weight = 1.0 / self.num_batches_tracked
                self.running_mean.lerp_(mean_sum.div_(s), weight)
                self.running_var.lerp_(var_sum.mul_(unbiased / s), weight)
            else:
                torch._foreach_mul_([self.running_mean, self.running_var], 1.0 - self.momentum)
                self.running_mean.add_(mean_sum, alpha=self.momentum / s)
                self.running_var.add_(var_sum, alpha=self.momentum * unbiased / s)
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_splits={self.num_splits}"


_REDUCED = (1, 3, 4)  # of the (s, N/s, C, H, W) view: per sub-batch and channel


def _moments(xs: Tensor) -> tuple[Tensor, Tensor]:
    """(biased variance, mean) of each sub-batch and channel of the ``(s, N/s, C, H, W)`` view ``xs``, fp32: fp32 in
    one Welford pass (``var_mean``); bf16 / fp16 as fp32 sums of x and x² (two passes, no fp32 copy of the
    activations on a GPU)."""
    if xs.dtype in (torch.float32, torch.float64):
        return torch.var_mean(xs, dim=_REDUCED, correction=0, keepdim=True)
    mean = xs.mean(_REDUCED, keepdim=True, dtype=torch.float32)
    square = torch.linalg.vector_norm(xs, 2, _REDUCED, keepdim=True, dtype=torch.float32).square_()
    square = square.div_(xs.numel() // (xs.shape[0] * xs.shape[2]))
    return torch.addcmul(square, mean, mean, value=-1).clamp_min_(0), mean


def batch_norm_splits(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], s: int, eps: float, fused: Optional[bool] = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Training-mode BatchNorm of each of the ``s`` contiguous sub-batches of ``x``: ``(y, mean, biased variance)``,
    the statistics per sub-batch and channel, fp32, not differentiable.

    ``fused`` (default: on any device but a CPU): :class:`_SplitBatchNorm`, a number of kernels independent of ``s``.
    Otherwise BatchNorm's own training-mode kernel on each sub-batch, concatenated (the CPU's faster way)."""
    if fused or (fused is None and x.device.type != "cpu"):
        return _SplitBatchNorm.apply(x, weight, bias, s, eps)
    outs, means, invstds = zip(
        *(torch.native_batch_norm(part, weight, bias, None, None, True, 0.0, eps) for part in x.chunk(s))
    )
    with torch.no_grad():
        mean, var = torch.stack(means), torch.stack(invstds).pow_(-2).sub_(eps)
    return torch.cat(outs), mean, var


class _SplitBatchNorm(torch.autograd.Function):
    """Training-mode BatchNorm of each of ``s`` contiguous sub-batches, in a number of kernels independent of ``s``.

    Forward: the statistics of the ``(s, N/s, C, H, W)`` view in fp32 (:func:`_moments`), then ``y = x k + shift``
    with per-(sub-batch, channel) ``k = γ / σ`` and ``shift = β - μ k`` in one fused pass, in the input's dtype
    and memory format. Backward: the two sums every BatchNorm backward needs (Σ dy and
    Σ dy x per sub-batch and channel, fp32), then ``dx = k dy - (P x + Q) / m`` in two fused passes. The
    per-channel coefficients are computed in fp32 and applied in the activations' dtype (bf16 passes with fp32
    coefficients ran 7x slower on a CPU). Returns ``(y, mean, biased variance)``, the statistics shaped
    ``(s, 1, C, 1, 1)``, fp32, not differentiable.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], s: int, eps: float):
        n, c, h, w = x.shape
        xs = x.view(s, n // s, c, h, w)  # splitting the batch dimension is a view in every memory format
        var, mean = _moments(xs)
        invstd = (var + eps).rsqrt_()
        k = invstd if weight is None else invstd * weight.view(1, 1, c, 1, 1)
        shift = torch.addcmul(bias.view(1, 1, c, 1, 1), mean, k, value=-1) if bias is not None else -mean * k
        # the coefficients repeated per image, (N, C, 1, 1): y is a new (N, C, H, W) tensor in x's memory format
        # (channels-last stays so for the next convolution; not a view, so a ReLU(inplace=True) may write into it
        # without autograd's copy of the whole gradient that an in-place write into a view costs)
        shift_n, k_n = _per_image(torch.cat([shift, k], 1), n, x.dtype).unbind(1)
        y = torch.addcmul(shift_n, x, k_n)
        ctx.save_for_backward(x, mean, invstd, k)
        ctx.s, ctx.affine = s, weight is not None
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor, _mean: Any, _var: Any):
        x, mean, invstd, k = ctx.saved_tensors
        n, c, h, w = x.shape
        s = ctx.s
        xs, dys = x.view(s, n // s, c, h, w), dy.view(s, n // s, c, h, w)
        count = xs.numel() // (s * c)
        # the per-(sub-batch, channel) sums of dy and of dy (x - μ) = dy x - μ dy
        sum_dy = dys.sum(_REDUCED, keepdim=True, dtype=torch.float32)
        dot = torch.addcmul((dys * xs).sum(_REDUCED, keepdim=True, dtype=torch.float32), mean, sum_dy, value=-1)
        # dx = k (dy - Σdy / m - (x - μ) σ⁻² Σdy (x - μ) / m) = k dy - (P x + Q) / m,
        # P = k σ⁻² Σdy (x - μ), Q = k Σdy - P μ
        p = (k * invstd * invstd * dot).div_(-count)
        q = torch.addcmul(k * sum_dy, p, mean, value=count).div_(-count)
        dx = torch.addcmul(q.to(x.dtype), xs, p.to(x.dtype)).addcmul_(dys, k.to(x.dtype)).reshape(n, c, h, w)
        if not ctx.affine:
            return dx, None, None, None, None
        # dγ = Σ dy x̂ = Σ_splits σ⁻¹ Σdy (x - μ), dβ = Σ dy
        grads = torch.cat([dot * invstd, sum_dy], 1).sum((0, 3, 4))
        return dx, grads[0].view(-1), grads[1].view(-1), None, None


def _per_image(coefficients: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """Per-(sub-batch, channel) coefficients ``(s, K, C, 1, 1)`` repeated for each of the ``n`` images:
    ``(n, K, C, 1, 1)`` in ``dtype`` (a small copy: the full-size pass then runs on (N, C, H, W) tensors in the
    input's layout, and its result is a new tensor, not a view)."""
    s, kinds, c, _, _ = coefficients.shape
    return coefficients.to(dtype).unsqueeze(1).expand(s, n // s, kinds, c, 1, 1).reshape(n, kinds, c, 1, 1)


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


def check_last_batch(bn_splits: int, per_device: int, loader: Any) -> None:
    """A training loader that keeps its partial last batch (``drop_last=False``) must end on a batch that splits too:
    refused at fit start, not after the epoch's other batches have trained."""
    if getattr(loader, "drop_last", True) or getattr(loader, "batch_size", None) is None:
        return
    try:
        n = len(loader.sampler)
    except TypeError:  # an iterable dataset: its length is not known
        return
    last = n % per_device
    if last and (last % bn_splits or last // bn_splits < 2):
        raise ConfigError(
            f"MoCo: the training loader keeps its partial last batch (drop_last=False): {n} images in batches of "
            f"{per_device} end on a batch of {last}, which split BatchNorm (shuffle BN on one device) cannot divide "
            f"into bn_splits={bn_splits} sub-batches of 2 or more; set drop_last=True on the training DataLoader (the "
            "library's datamodules do)"
        )
