"""Optimizers and schedules of the MoCo recipes: plain functions of the settings, and a host-sync-free LARS.

- lr is given per 256 images and scaled by the global batch (He et al. 2020, §4: "lr 0.03 for batch 256"; Goyal
  et al. 2017's linear scaling rule); warm-up is linear from 0 (``step / warmup``, as the official MoCo v3 code),
  then cosine (v2, v3), steps of ×0.1 (v1) or constant.
- the momentum of the key encoder is constant (v1/v2) or follows MoCo v3's cosine from m₀ to 1. One convention for
  every momentum method (MoCo, BYOL): the update that follows the j-th optimizer step uses m(j), j = 1, 2, ...,
  as the official v3 code, whose iteration j blends the weights after j steps with m(j) before its forward.
- the official v1/v2 code decays every parameter (``MoCo``'s default ``decay_norm_bias=True``); SimCLR/BYOL/SwAV
  keep norm and bias parameters decay-free; LARS never decays or adapts parameters with ``ndim <= 1``.

:class:`LARS` (You, Gitman, Ginsburg 2017, https://arxiv.org/abs/1708.03888) is MoCo v3's rule, written without
host-device synchronisation: the decision "both norms > 0" is a ``torch.where`` on the device, and the norms of
all parameters are computed with one foreach kernel.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from lightly.models.utils import get_weight_decay_parameters
from torch import nn
from torch.optim.optimizer import Optimizer

from moco_lightning.errors import ConfigError


def cosine(step: float, total: float, start: float, end: float) -> float:
    """Half a cosine from ``start`` (step 0) towards ``end`` (step ``total``)."""
    return end - (end - start) * (1 + math.cos(math.pi * min(step, total) / max(total, 1))) / 2


def momentum_at(step: int, total: float, m0: float, schedule: str) -> float:
    """m(j) of the momentum update that follows the j-th optimizer step, ``j = step`` (the ``global_step`` once that
    step is done): v3's ``1 − (1 − m₀)(1 + cos(π j/J))/2`` over J = ``total`` steps; m(0) = m₀, m(J) = 1."""
    if schedule == "constant":
        return m0
    if not math.isfinite(total):
        raise ConfigError("momentum_schedule='cosine' needs a finite run: set trainer.max_epochs or trainer.max_steps")
    return cosine(step, total, m0, 1.0)


@torch.no_grad()
def momentum_update(targets: Iterable[nn.Module], sources: Iterable[nn.Module], m: float) -> None:
    """θ_target ← m·θ_target + (1 − m)·θ_source over the parameters of paired modules, with one foreach kernel."""
    theta_t = [p for module in targets for p in module.parameters()]
    theta_s = [p for module in sources for p in module.parameters()]
    torch._foreach_lerp_(theta_t, theta_s, 1.0 - m)  # θ_t + (1 − m)(θ_s − θ_t)


def lr_factor(schedule: str, warmup: int, total: float, milestones: Sequence[int]) -> Callable[[int], float]:
    """The multiplier of the peak lr at each optimizer step (for ``LambdaLR``); ``milestones`` in steps."""
    if schedule == "cosine" and not math.isfinite(total):
        raise ConfigError("lr_schedule='cosine' needs a finite run: set trainer.max_epochs or trainer.max_steps")

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup  # the official v3 code: lr · (epoch + i/iters) / warmup_epochs, 0 at the first step
        if schedule == "cosine":
            return cosine(step - warmup, total - warmup, 1.0, 0.0)
        if schedule == "step":
            return 0.1 ** sum(step >= m for m in milestones)
        return 1.0

    return factor


def build_optimizer(
    name: str, modules: Iterable[nn.Module], lr: float, weight_decay: float, sgd_momentum: float, decay_norm_bias: bool
) -> Optimizer:
    """SGD, LARS or AdamW over the trainable parameters of ``modules``: SGD and AdamW in a decayed and a decay-free
    group (norms and biases, unless ``decay_norm_bias``), LARS in one group (its rule leaves ``ndim <= 1`` alone)."""
    if name == "lars":  # as the official v3 code: all parameters, the optimizer decides by ndim
        params = [p for module in modules for p in module.parameters() if p.requires_grad]
        return LARS([{"params": params, "weight_decay": weight_decay}], lr=lr, momentum=sgd_momentum)
    decay, no_decay = get_weight_decay_parameters(list(modules), decay_norm=decay_norm_bias, decay_bias=decay_norm_bias)
    groups = [
        {"params": [p for p in params if p.requires_grad], "weight_decay": wd}
        for params, wd in ((decay, weight_decay), (no_decay, 0.0))
        if any(p.requires_grad for p in params)
    ]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=sgd_momentum)


class LARS(Optimizer):
    """SGD with momentum and layer-wise adaptive rate scaling, MoCo v3's rule (``facebookresearch/moco-v3``,
    ``moco/optimizer.py``).

    For every parameter with ``ndim > 1`` (weights of convolutions and linear layers)::

        d = g + weight_decay · p
        q = trust_coefficient · ‖p‖ / ‖d‖    if ‖p‖ > 0 and ‖d‖ > 0, else 1
        d = q · d

    parameters with ``ndim <= 1`` (norms and biases) get neither weight decay nor adaptation (``d = g``); then
    ``μ = momentum · μ + d`` (μ starts at 0) and ``p -= lr · μ``. The adaptation does not depend on the weight
    decay: with ``weight_decay=0`` it is ``tc · ‖p‖/‖g‖``, not plain SGD. The rule is decided per parameter on the
    device (``torch.where``), never on the host; norms and updates use foreach kernels.
    """

    def __init__(
        self,
        params: Any,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0 or trust_coefficient <= 0:
            raise ConfigError(
                "LARS needs lr, momentum, weight_decay >= 0 and trust_coefficient > 0; got "
                f"{lr}, {momentum}, {weight_decay}, {trust_coefficient}"
            )
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            adapted = [p for p in params if p.ndim > 1]
            updates = {p: p.grad for p in params}
            if adapted:
                d = torch._foreach_add([p.grad for p in adapted], adapted, alpha=group["weight_decay"])
                for p, dp, pn, dn in zip(adapted, d, torch._foreach_norm(adapted), torch._foreach_norm(d)):
                    ratio = group["trust_coefficient"] * pn / dn
                    updates[p] = dp.mul_(torch.where((pn > 0) & (dn > 0), ratio, torch.ones_like(ratio)))
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                bufs.append(state["momentum_buffer"])
            if bufs:
                torch._foreach_mul_(bufs, group["momentum"])
                torch._foreach_add_(bufs, [updates[p] for p in params])
                torch._foreach_add_(params, bufs, alpha=-group["lr"])
        return loss
