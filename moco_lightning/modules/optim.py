"""The optimizers of the MoCo recipes: SGD, AdamW and a host-sync-free LARS (the lr schedule is
:func:`moco_lightning.training.plan.lr_factor`, the momentum's :class:`moco_lightning.modules.momentum.MomentumCopy`).

- the official v1/v2 code decays every parameter (``MoCo``'s default ``decay_norm_bias=True``); SimCLR/BYOL/SwAV
  keep norm and bias parameters decay-free; LARS never decays or adapts parameters with ``ndim <= 1``.

:class:`LARS` (You, Gitman, Ginsburg 2017, https://arxiv.org/abs/1708.03888) is MoCo v3's rule, written without
host-device synchronisation: the decision "both norms > 0" is a ``torch.where`` on the device, and the norms of
all parameters are computed with one foreach kernel.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from lightly.models.utils import get_weight_decay_parameters
from torch import nn
from torch.optim.optimizer import Optimizer

from moco_lightning.errors import ConfigError


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
