"""The momentum (exponential moving average) copy of an encoder: MoCo's key encoder and BYOL's target network.

MoCo (He et al. 2020, §3.2, eq. 2): "θ_k ← m·θ_k + (1 − m)·θ_q ... only the parameters θ_q are updated by
back-propagation"; BYOL (Grill et al. 2020, §3.1) moves its target the same way with τ. One piece serves both:

- the copy: each named child of the module (``backbone``, ``projection_head``) gets a frozen twin under
  ``<prefix><name>`` (``key_backbone``, ``target_projection_head``: the state-dict names of every checkpoint);
- m(j): constant, or MoCo v3's / BYOL's cosine from m₀ to 1 over the planned optimizer steps
  (:func:`moco_lightning.modules.optim.momentum_at`: the update that follows the j-th step uses m(j));
- the gate: the update runs once after each real optimizer step, never after a gradient-accumulation micro-batch;
- the refusal of half-precision weights, where the update's step (1 − m)·(θ_q − θ_k) is below the format's
  resolution and the copy stops moving;
- the logged momentum, ``train/momentum``: m of the update that follows this step.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from moco_lightning.errors import ConfigError
from moco_lightning.modules.optim import momentum_at, momentum_update


class MomentumCopy:
    """Frozen momentum copies of ``owner``'s children ``names`` under ``prefix + name``, and their update.

    ``owner`` is a :class:`~moco_lightning.methods.base.Pretraining` module (its ``optimizer_stepped()`` gates the
    update and its step plan drives the schedule); the copies are its own child modules, so they are saved, moved and
    compiled with it. ``what``: the copy's name in errors ("the key encoder")."""

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
        """m(j) of the update that follows the j-th optimizer step."""
        return momentum_at(*owner.planned_step(step), self.momentum, self.schedule)

    def after_step(self, owner: Any) -> None:
        """θ_copy ← m·θ_copy + (1 − m)·θ_source, once after each optimizer step (not after an accumulation
        micro-batch), with m(j) of that step."""
        if owner.optimizer_stepped():
            self.update(owner, self.at(owner, owner.global_step))

    def update(self, owner: Any, m: float) -> None:
        momentum_update([getattr(owner, c) for c in self.pairs.values()], [getattr(owner, n) for n in self.pairs], m)

    def scalars(self, owner: Any) -> dict[str, float]:
        """What a training step logs: the m of the update that will follow it."""
        return {"train/momentum": self.at(owner, owner.global_step + 1)}

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
