"""The momentum (exponential moving average) copy of an encoder: MoCo's key encoder and BYOL's target network.

MoCo (He et al. 2020, §3.2, eq. 2): "θ_k ← m·θ_k + (1 − m)·θ_q ... only the parameters θ_q are updated by
back-propagation"; BYOL (Grill et al. 2020, §3.1) moves its target the same way with τ. One piece serves both:

- the copy: each named child of the module (``backbone``, ``projection_head``) gets a frozen twin under
  ``<prefix><name>`` (``key_backbone``, ``target_projection_head``: the state-dict names of every checkpoint);
- m(j) (:meth:`MomentumCopy.at`): constant, or MoCo v3's / BYOL's cosine from m₀ to 1 over the planned optimizer
  steps, ``1 − (1 − m₀)(1 + cos(π j/J))/2``. One convention for every momentum method: the update that follows the
  j-th optimizer step uses m(j), j = 1, 2, ..., as the official v3 code, whose iteration j blends the weights after j
  steps with m(j) before its forward;
- the update (:meth:`MomentumCopy.update`), one foreach kernel, once after each real optimizer step (the module's
  ``finish_step`` gates it: never after a gradient-accumulation micro-batch);
- the refusal of half-precision weights, where the update's step (1 − m)·(θ_q − θ_k) is below the format's
  resolution and the copy stops moving;
- the logged momentum, ``train/momentum``: m of the update that follows this step.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import torch

from moco_lightning.errors import ConfigError


class MomentumCopy:
    """Frozen momentum copies of ``owner``'s children ``names`` under ``prefix + name``, and their update.

    ``owner`` is a :class:`~moco_lightning.methods.base.Pretraining` module (its ``finish_step`` calls the update
    after each optimizer step; its step plan drives the schedule); the copies are its own child modules, so they are
    saved, moved and compiled with it. ``what``: the copy's name in errors ("the key encoder")."""

    def __init__(
        self, owner: Any, prefix: str, names: Sequence[str], momentum: float, schedule: str, what: str
    ) -> None:
        self.pairs = {name: prefix + name for name in names}  # source child -> its copy
        self.momentum, self.schedule, self.what = momentum, schedule, what
        for name, copy_name in self.pairs.items():
            owner.add_module(copy_name, copy.deepcopy(getattr(owner, name)).requires_grad_(False))

    def reset(self, owner: Any) -> None:
        """Each copy equal to its source again (after the sources were re-initialised)."""
        for name, copy_name in self.pairs.items():
            getattr(owner, copy_name).load_state_dict(getattr(owner, name).state_dict())

    def at(self, owner: Any, step: int) -> float:
        """m(j) of the update that follows the j-th optimizer step, ``j = step`` (the ``global_step`` once that step is
        done), on the owner's step plan (a resumed run of another length follows its new plan): m(0) = m₀, m(J) = 1."""
        if self.schedule == "constant":
            return self.momentum
        plan = owner.step_plan
        j, total = (plan.position(step), plan.planned) if plan else (step, owner.trainer.estimated_stepping_batches)
        if not math.isfinite(total):
            raise ConfigError(
                "momentum_schedule='cosine' needs a finite run: set trainer.max_epochs or trainer.max_steps"
            )
        return 1 - (1 - self.momentum) * (1 + math.cos(math.pi * min(j, total) / max(total, 1))) / 2

    @torch.no_grad()
    def update(self, owner: Any, m: float) -> None:
        """θ_copy ← m·θ_copy + (1 − m)·θ_source over every copied child's parameters, with one foreach kernel."""
        copies = [p for name in self.pairs.values() for p in getattr(owner, name).parameters()]
        sources = [p for name in self.pairs for p in getattr(owner, name).parameters()]
        torch._foreach_lerp_(copies, sources, 1.0 - m)  # θ_c + (1 − m)(θ_s − θ_c)

    def refuse_half_precision(self, owner: Any) -> None:
        if str(owner.trainer.precision) in ("bf16-true", "16-true"):
            queue = owner.dictionary_buffers()  # a queue of keys has the same half-precision fate
            raise ConfigError(
                f"{type(owner).__name__}: precision={owner.trainer.precision!r} stores {self.what}"
                + (" and the queue" if queue else "")
                + " in half precision, where the momentum update's step (1 - m) * (θ_q - θ_k), 0.001 of the difference "
                "at m = 0.999, is below the format's resolution and the momentum copy stops moving: use "
                "precision='bf16-mixed' (the weights" + (", the queue" if queue else "") + " and the logits stay fp32)"
            )
