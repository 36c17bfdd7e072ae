"""MoCo's view augmentation applied to a whole batch of tensors at once.

The MoCo recipes (He et al. 2020, §3.3 "Data augmentation"; Chen et al. 2020, MoCo v2) draw every
augmentation per image: a random resized crop, a horizontal flip, colour jitter, random grayscale,
and (v2) Gaussian blur. torchvision and lightly apply them to one PIL image at a time in worker
processes, which on a small machine competes with the model for the same cores. Here the same
distributions are sampled per image but applied to the whole batch with a handful of tensor ops
(one ``grid_sample`` for crop + flip), on whatever device the batch is on.

Differences from the per-image PIL pipeline, all documented in the README:
- the crop is resampled bilinearly from the full image in one step (torchvision crops integer
  pixels, then resizes with antialiasing);
- the four jitter ops run in a fixed order (brightness, contrast, saturation, hue) rather than a
  random one, and hue is a rotation of the chroma plane in YIQ space;
- on one-channel images saturation, hue and grayscale are no-ops (there is no colour to change).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moco_lightning.errors import ConfigError

_LUMA = (0.299, 0.587, 0.114)


class BatchViews(nn.Module):
    """Draws ``n_views`` independently augmented views of a batch of images.

    Args:
        size: output side in pixels.
        min_scale, max_scale: area fraction of the random resized crop (MoCo: 0.2 to 1).
        hflip_prob: probability of a horizontal flip.
        jitter_prob: probability of colour jitter (v1: 1.0 with strength 0.4; v2: 0.8).
        jitter: (brightness, contrast, saturation, hue) strengths, as torchvision's ``ColorJitter``.
        gray_prob: probability of converting to grayscale.
        blur_prob: probability of Gaussian blur, one value for all views or one per view (v3: 1.0 and 0.1).
        blur_sigma: range of the blur's standard deviation, as a fraction of ``size / 224``
            scaled to pixels the way the paper's 23-px kernel at 224 px is.
        solarize_prob: probability of solarization, one value for all views or one per view (v3: 0.0 and 0.2).
        mean, std: normalisation statistics, one per channel.
        n_views: how many views to return.
        local_views, local_size, local_scale: multi-crop (Caron et al. 2020, SwAV §3.2): this many more views,
            random resized crops of ``local_size`` px from ``local_scale`` of the image's area, returned after the
            ``n_views`` global ones (colour as the global views; blur and solarize with the mean of their
            per-view probabilities).
        translate: random translation by up to this many pixels in x and y (integers, zero-filled: the
            pad-and-crop of supervised CIFAR training), after the crop.
        rotation: random rotation by up to this many degrees either way (zero-filled corners).
        erase_prob: probability of random erasing (Zhong et al. 2020, torchvision's ``RandomErasing`` defaults: one
            rectangle of 2-33 % of the area, aspect 0.3-3.3, filled with the mean, i.e. 0 after normalisation).

    Translation, rotation and erasing keep a small centred image recognisable while making the pretext task
    harder than flips and jitter alone (Fashion-MNIST's views without a crop are solved after a few epochs).
    """

    def __init__(
        self,
        size: int,
        min_scale: float = 0.2,
        max_scale: float = 1.0,
        hflip_prob: float = 0.5,
        jitter_prob: float = 0.8,
        jitter: Tuple[float, float, float, float] = (0.4, 0.4, 0.4, 0.1),
        gray_prob: float = 0.2,
        blur_prob: Sequence[float] | float = 0.0,
        blur_sigma: Tuple[float, float] = (0.1, 2.0),
        solarize_prob: Sequence[float] | float = 0.0,
        mean: Sequence[float] = (0.5,),
        std: Sequence[float] = (0.5,),
        n_views: int = 2,
        local_views: int = 0,
        local_size: int = 0,
        local_scale: Tuple[float, float] = (0.05, 0.14),
        translate: int = 0,
        rotation: float = 0.0,
        erase_prob: float = 0.0,
    ) -> None:
        super().__init__()
        if translate < 0 or rotation < 0 or not 0 <= erase_prob <= 1:
            raise ConfigError(
                f"translate and rotation must be >= 0 and erase_prob in [0, 1]; got translate={translate}, "
                f"rotation={rotation}, erase_prob={erase_prob}"
            )
        self.translate, self.rotation, self.erase_prob = int(translate), float(rotation), float(erase_prob)
        if not 0 < min_scale <= max_scale <= 1:
            raise ConfigError(
                f"min_scale/max_scale must satisfy 0 < min_scale <= max_scale <= 1, got {min_scale}, {max_scale}"
            )
        if local_views < 0 or (local_views and (local_size < 1 or not 0 < local_scale[0] <= local_scale[1] <= 1)):
            raise ConfigError(
                f"local_views={local_views} needs local_size >= 1 and 0 < local_scale[0] <= local_scale[1] "
                f"<= 1; got local_size={local_size}, local_scale={tuple(local_scale)}"
            )
        if len(mean) != len(std):
            raise ConfigError(f"mean and std need one value per channel, got {len(mean)} and {len(std)}")
        self.size = size
        self.scale = (min_scale, max_scale)
        self.hflip_prob = hflip_prob
        self.jitter_prob = jitter_prob
        self.jitter = jitter
        self.gray_prob = gray_prob
        self.blur_prob = _per_view(blur_prob, n_views, "blur_prob")
        self.blur_sigma = blur_sigma
        self.solarize_prob = _per_view(solarize_prob, n_views, "solarize_prob")
        self.n_views = n_views
        self.local_views, self.local_size, self.local_scale = local_views, local_size, tuple(local_scale)
        if local_views:  # the local views' blur / solarize: the mean of the global views' probabilities
            self.blur_prob += (sum(self.blur_prob) / n_views,)
            self.solarize_prob += (sum(self.solarize_prob) / n_views,)
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)
        # The datamodule that owns this module is not an nn.Module and is never moved: the statistics follow the
        # batch's device instead, copied there once and cached (a GPU batch and CPU buffers cannot be mixed).
        self._stats_on: dict[torch.device, Tuple[Tensor, Tensor]] = {}

    @torch.no_grad()
    def forward(self, images: Tensor, generator: Optional[torch.Generator] = None) -> list[Tensor]:
        """``images``: (N, C, H, W) uint8 in [0, 255] or float in [0, 1]. Returns ``n_views`` normalised tensors."""
        x = images.float().div_(255) if images.dtype == torch.uint8 else images.float()
        views = [self._view(x, v, generator, self.size, self.scale) for v in range(self.n_views)]
        return views + [
            self._view(x, self.n_views, generator, self.local_size, self.local_scale) for _ in range(self.local_views)
        ]

    def _rand(self, n: int, x: Tensor, g: Optional[torch.Generator], *shape: int) -> Tensor:
        return torch.rand(n, *shape, device=x.device, generator=g)

    def _view(self, x: Tensor, v: int, g: Optional[torch.Generator], size: int, scale: Tuple[float, float]) -> Tensor:
        n, c, h, w = x.shape
        out = self._crop_flip(x, g, size, scale)
        if self.jitter_prob > 0 and any(self.jitter):
            out = self._jitter(out, g)
        if c == 3 and self.gray_prob > 0:
            gray = _gray(out).expand_as(out)
            out = torch.where(self._rand(n, x, g, 1, 1, 1) < self.gray_prob, gray, out)
        if self.blur_prob[v] > 0:
            out = self._blur(out, self.blur_prob[v], g, size)
        if self.solarize_prob[v] > 0:
            sol = self._rand(n, x, g, 1, 1, 1) < self.solarize_prob[v]
            out = torch.where(sol & (out >= 0.5), 1.0 - out, out)
        mean, std = self._stats(out.device)
        if self.erase_prob > 0:
            out = self._erase(out, mean, g)
        return (out - mean) / std

    def _erase(self, x: Tensor, fill: Tensor, g: Optional[torch.Generator]) -> Tensor:
        """One random rectangle per image (with ``erase_prob``) set to ``fill``: torchvision's RandomErasing
        sampling (area 0.02-0.33, log-uniform aspect 0.3-3.3), clipped to the image instead of retried."""
        n, c, h, w = x.shape
        area = (0.02 + 0.31 * self._rand(n, x, g)) * h * w
        ratio = (math.log(0.3) + (math.log(3.3) - math.log(0.3)) * self._rand(n, x, g)).exp()
        eh = (area * ratio).sqrt().round().clamp(1, h)
        ew = (area / ratio).sqrt().round().clamp(1, w)
        top = ((h - eh + 1) * self._rand(n, x, g)).floor()
        left = ((w - ew + 1) * self._rand(n, x, g)).floor()
        rows = torch.arange(h, device=x.device, dtype=x.dtype).view(1, h, 1)
        cols = torch.arange(w, device=x.device, dtype=x.dtype).view(1, 1, w)
        inside = (rows >= top.view(n, 1, 1)) & (rows < (top + eh).view(n, 1, 1))
        inside = inside & (cols >= left.view(n, 1, 1)) & (cols < (left + ew).view(n, 1, 1))
        erase = inside.unsqueeze(1) & (self._rand(n, x, g, 1, 1, 1) < self.erase_prob)
        return torch.where(erase, fill.to(x.dtype).expand(n, c, 1, 1), x)

    def _stats(self, device: torch.device) -> Tuple[Tensor, Tensor]:
        if self.mean.device == device:
            return self.mean, self.std
        if device not in self._stats_on:
            self._stats_on[device] = (self.mean.to(device), self.std.to(device))
        return self._stats_on[device]

    def _crop_flip(self, x: Tensor, g: Optional[torch.Generator], size: int, scale: Tuple[float, float]) -> Tensor:
        """torchvision's RandomResizedCrop sampling (10 tries, then the whole image) + flip, as one warp."""
        n, c, h, w = x.shape
        moves = self.translate > 0 or self.rotation > 0
        if scale == (1.0, 1.0) and h == w == size and not moves:  # cropped beforehand: the flip alone, no resample
            return torch.where(self._rand(n, x, g, 1, 1, 1) < self.hflip_prob, x.flip(-1), x)
        tries = 10
        area = scale[0] + (scale[1] - scale[0]) * self._rand(n, x, g, tries)
        log_ratio = math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * self._rand(n, x, g, tries)
        ratio = log_ratio.exp()
        cw = (area * ratio * h / w).sqrt()  # crop width as a fraction of the image width
        ch = (area / ratio * w / h).sqrt()
        ok = (cw <= 1) & (ch <= 1)
        first = ok.float().argmax(1, keepdim=True)  # first valid try per image
        cw = torch.where(ok.any(1, keepdim=True), cw.gather(1, first), torch.ones_like(first, dtype=x.dtype)).squeeze(1)
        ch = torch.where(ok.any(1, keepdim=True), ch.gather(1, first), torch.ones_like(first, dtype=x.dtype)).squeeze(1)
        cx = (self._rand(n, x, g) * 2 - 1) * (1 - cw)  # crop centre in [-1, 1] coordinates
        cy = (self._rand(n, x, g) * 2 - 1) * (1 - ch)
        flip = torch.where(self._rand(n, x, g) < self.hflip_prob, -1.0, 1.0)
        zero = torch.zeros_like(cw)
        if not moves:
            theta = torch.stack([torch.stack([cw * flip, zero, cx], 1), torch.stack([zero, ch, cy], 1)], 1)
            grid = F.affine_grid(theta, [n, c, size, size], align_corners=False)
            return F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
        # input = centre + shift + diag(cw·flip, ch) · R(angle) · output: crop, rotate about the crop's centre, shift
        angle = (2 * self._rand(n, x, g) - 1) * math.radians(self.rotation)
        cos, sin = angle.cos(), angle.sin()
        t = self.translate
        shift_x = ((self._rand(n, x, g) * (2 * t + 1)).floor() - t) * 2 / w  # whole pixels in [-t, t]
        shift_y = ((self._rand(n, x, g) * (2 * t + 1)).floor() - t) * 2 / h
        row_x = torch.stack([cw * flip * cos, -cw * flip * sin, cx + shift_x], 1)
        row_y = torch.stack([ch * sin, ch * cos, cy + shift_y], 1)
        grid = F.affine_grid(torch.stack([row_x, row_y], 1), [n, c, size, size], align_corners=False)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)

    def _jitter(self, x: Tensor, g: Optional[torch.Generator]) -> Tensor:
        n, c = x.shape[:2]
        b, co, s, hue = self.jitter
        apply = self._rand(n, x, g, 1, 1, 1) < self.jitter_prob

        def factor(strength: float) -> Tensor:
            return (1 + strength * (2 * self._rand(n, x, g, 1, 1, 1) - 1)).clamp_(min=0)

        y = x
        if b > 0:
            y = (y * factor(b)).clamp_(0, 1)
        if co > 0:
            m = _gray(y).mean((1, 2, 3), keepdim=True)
            y = ((y - m) * factor(co) + m).clamp_(0, 1)
        if c == 3 and s > 0:
            gray = _gray(y)
            y = ((y - gray) * factor(s) + gray).clamp_(0, 1)
        if c == 3 and hue > 0:
            y = _rotate_hue(y, hue * (2 * self._rand(n, x, g) - 1) * 2 * math.pi).clamp_(0, 1)
        return torch.where(apply, y, x)

    def _blur(self, x: Tensor, prob: float, g: Optional[torch.Generator], size: int) -> Tensor:
        n, c, h, w = x.shape
        # MoCo v2: kernel 10 % of the side (23 px at 224), sigma in [0.1, 2.0] at 224 px.
        lo, hi = self.blur_sigma
        # ... and at least ±2 sigma wide (small images with a strong blur_sigma: 5 px for sigma 1 px)
        k = max(3, int(0.1 * size) // 2 * 2 + 1, 2 * math.ceil(2 * hi * size / 224) + 1)
        sigma = (lo + (hi - lo) * self._rand(n, x, g)) * size / 224
        r = torch.arange(k, device=x.device, dtype=x.dtype) - k // 2
        kern = torch.exp(-(r[None] ** 2) / (2 * sigma[:, None] ** 2))
        kern = (kern / kern.sum(1, keepdim=True)).repeat_interleave(c, 0)  # (n*c, k)
        y = x.reshape(1, n * c, h, w)
        y = F.pad(y, (k // 2, k // 2, 0, 0), mode="reflect")
        y = F.conv2d(y, kern[:, None, None, :], groups=n * c)
        y = F.pad(y, (0, 0, k // 2, k // 2), mode="reflect")
        y = F.conv2d(y, kern[:, None, :, None], groups=n * c).reshape(n, c, h, w)
        return torch.where(self._rand(n, x, g, 1, 1, 1) < prob, y, x)


def _per_view(p: Sequence[float] | float, n_views: int, name: str) -> Tuple[float, ...]:
    p = (float(p),) * n_views if isinstance(p, (int, float)) else tuple(float(v) for v in p)
    if len(p) != n_views or not all(0 <= v <= 1 for v in p):
        raise ConfigError(f"{name} needs one probability in [0, 1] per view ({n_views} views), got {p}")
    return p


def _gray(x: Tensor) -> Tensor:
    if x.shape[1] == 1:
        return x
    r, g, b = _LUMA
    return r * x[:, 0:1] + g * x[:, 1:2] + b * x[:, 2:3]


_TO_YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]], dtype=torch.float64)
_FROM_YIQ = torch.linalg.inv(_TO_YIQ)  # once, on the CPU: torch.linalg.inv on a GPU synchronises with the host
_YIQ_ON: dict = {}


def _yiq_matrices(device: torch.device, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    key = (device, dtype)
    if key not in _YIQ_ON:
        _YIQ_ON[key] = (_TO_YIQ.to(device, dtype), _FROM_YIQ.to(device, dtype))
    return _YIQ_ON[key]


def _rotate_hue(x: Tensor, angle: Tensor) -> Tensor:
    """Rotate the chroma of RGB images by ``angle`` radians (one per image) in YIQ space."""
    to_yiq, from_yiq = _yiq_matrices(x.device, x.dtype)
    yiq = torch.einsum("ij,njhw->nihw", to_yiq, x)
    cos, sin = angle.cos().view(-1, 1, 1), angle.sin().view(-1, 1, 1)
    i, q = yiq[:, 1], yiq[:, 2]
    yiq = torch.stack([yiq[:, 0], cos * i - sin * q, sin * i + cos * q], 1)
    return torch.einsum("ij,njhw->nihw", from_yiq, yiq)
