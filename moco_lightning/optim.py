"""Optimizers and schedules of the MoCo recipes: plain functions of the settings, and a host-sync-free LARS.

- lr is given per 256 images and scaled by the global batch (He et al. 2020, §4: "lr 0.03 for batch 256"; Goyal
  et al. 2017's linear scaling rule); warm-up is linear, then cosine (v2, v3), steps of ×0.1 (v1) or constant.
- the momentum of the key encoder is constant (v1/v2) or follows MoCo v3's cosine from m₀ to 1.
- weight decay is off for norm and bias parameters unless asked (``decay_norm_bias``), as BYOL/v3/lightly.

:class:`LARS` (You, Gitman, Ginsburg 2017, https://arxiv.org/abs/1708.03888; MoCo v3 trains ResNets with it) is
lightly's ``lightly.utils.lars.LARS`` update, written without host-device synchronisation: lightly tests
``if p_norm != 0 and g_norm != 0`` for every parameter, two reads of GPU values per parameter and step (about
120 for a v3 ResNet-50); here the same decision is a ``torch.where`` on the device, and the norms of all
parameters are computed with one foreach kernel.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from lightly.models.utils import get_weight_decay_parameters
from torch import nn
from torch.optim.optimizer import Optimizer

from .errors import ConfigError


def cosine(step: float, total: float, start: float, end: float) -> float:
    """Half a cosine from ``start`` (step 0) towards ``end`` (step ``total``)."""
    return end - (end - start) * (1 + math.cos(math.pi * min(step, total) / max(total, 1))) / 2


def momentum_at(step: int, total: float, m0: float, schedule: str) -> float:
    """m of the key encoder for the optimizer step with 0-based index ``step`` (v3: 1 − (1 − m₀)(1 + cos(π t/T))/2)."""
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
            return (step + 1) / warmup
        if schedule == "cosine":
            return cosine(step - warmup, total - warmup, 1.0, 0.0)
        if schedule == "step":
            return 0.1 ** sum(step >= m for m in milestones)
        return 1.0

    return factor


def build_optimizer(
    name: str, modules: Iterable[nn.Module], lr: float, weight_decay: float, sgd_momentum: float, decay_norm_bias: bool
) -> Optimizer:
    """SGD, LARS or AdamW over the trainable parameters of ``modules``, in a decayed and a decay-free group."""
    decay, no_decay = get_weight_decay_parameters(list(modules), decay_norm=decay_norm_bias, decay_bias=decay_norm_bias)
    groups = [
        {"params": [p for p in decay if p.requires_grad], "weight_decay": weight_decay},
        {"params": [p for p in no_decay if p.requires_grad], "weight_decay": 0.0},
    ]
    if name == "lars":  # no adaptation for the decay-free group, as v3
        return LARS(groups, lr=lr, momentum=sgd_momentum)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=sgd_momentum)


class LARS(Optimizer):
    """SGD with momentum and layer-wise adaptive rate scaling, step for step lightly's ``LARS``.

    For every parameter of a group with ``weight_decay != 0``::

        trust = trust_coefficient · ‖p‖ / (‖g‖ + ‖p‖ · weight_decay + eps)   if ‖p‖ > 0 and ‖g‖ > 0
        d     = trust · (g + weight_decay · p)                               (else d = g)

    then ``buf = momentum · buf + (1 − dampening) · d`` (``buf = d`` on the first step), ``p -= lr · buf``.
    Groups with ``weight_decay == 0`` (norms and biases, as SimCLR, BYOL and MoCo v3) are plain SGD.
    """

    def __init__(
        self,
        params: Any,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ConfigError(f"LARS needs lr, momentum, weight_decay >= 0; got {lr}, {momentum}, {weight_decay}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            wd, momentum = group["weight_decay"], group["momentum"]
            updates = grads
            if wd != 0:
                updates = []
                for p, g, pn, gn in zip(params, grads, torch._foreach_norm(params), torch._foreach_norm(grads)):
                    adapt = (pn > 0) & (gn > 0)
                    trust = torch.where(adapt, group["trust_coefficient"] * pn / (gn + pn * wd + group["eps"]), 1.0)
                    updates.append(torch.where(adapt, g.add(p, alpha=wd).mul_(trust), g))
            if momentum != 0:
                bufs = []
                for p, d in zip(params, updates):
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.clone(d).detach()
                    else:
                        state["momentum_buffer"].mul_(momentum).add_(d, alpha=1 - group["dampening"])
                    bufs.append(state["momentum_buffer"])
                updates = bufs
            torch._foreach_add_(params, updates, alpha=-group["lr"])
        return loss
