"""Optimizers and schedules of the MoCo recipes.

:class:`LARS` (You, Gitman, Ginsburg 2017, https://arxiv.org/abs/1708.03888; MoCo v3 trains ResNets with it) is
lightly's ``lightly.utils.lars.LARS`` update, written without host-device synchronisation: lightly tests
``if p_norm != 0 and g_norm != 0`` for every parameter, two reads of GPU values per parameter and step (about
120 for a v3 ResNet-50); here the same decision is a ``torch.where`` on the device, and the norms of all
parameters are computed with one foreach kernel.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.optim.optimizer import Optimizer
from .errors import ConfigError


class LARS(Optimizer):
    """SGD with momentum and layer-wise adaptive rate scaling, step for step lightly's ``LARS``.

    For every parameter of a group with ``weight_decay != 0``::

        trust = trust_coefficient · ‖p‖ / (‖g‖ + ‖p‖ · weight_decay + eps)   if ‖p‖ > 0 and ‖g‖ > 0
        d     = trust · (g + weight_decay · p)                               (else d = g)

    then ``buf = momentum · buf + (1 − dampening) · d`` (``buf = d`` on the first step), ``p -= lr · buf``.
    Groups with ``weight_decay == 0`` (norms and biases, as SimCLR, BYOL and MoCo v3) are plain SGD.
    """

    def __init__(self, params: Any, lr: float, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ConfigError(f"LARS needs lr, momentum, weight_decay >= 0; got {lr}, {momentum}, {weight_decay}")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps)
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
            if wd != 0:
                p_norms = torch._foreach_norm(params)
                g_norms = torch._foreach_norm(grads)
                updates = []
                for p, g, pn, gn in zip(params, grads, p_norms, g_norms):
                    trust = group["trust_coefficient"] * pn / (gn + pn * wd + group["eps"])
                    trust = torch.where((pn > 0) & (gn > 0), trust, torch.ones_like(trust))
                    decayed = g.add(p, alpha=wd).mul_(trust)
                    updates.append(torch.where((pn > 0) & (gn > 0), decayed, g))
            else:
                updates = grads
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
