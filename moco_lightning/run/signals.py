"""A run asked to stop (SIGTERM, SIGINT, SLURM's requeue) saves a resumable checkpoint at a step boundary
(:mod:`moco_lightning.training.preemption`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from moco_lightning.modules.distributed import world_size
from moco_lightning.training.preemption import Preemption


class SaveOnSignal(Callback):
    """``on_train_start``: the handlers (the module's ``preemption``, a :class:`Preemption`, notes the signal);
    ``on_train_batch_end``: after the step the signal arrived in (one process) or the step all ranks agreed on it
    (several: the NaN guard's all-reduce carries it, or, for a module without one, an all-reduce at each logging
    step), the checkpoint is saved and the run exits."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if getattr(pl_module, "preemption", None) is None:
            pl_module.preemption = Preemption()
        pl_module.preemption.install(trainer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        state: Preemption = pl_module.preemption
        state.after_step(pl_module, self.agreed(trainer, pl_module, state))

    @staticmethod
    def agreed(trainer: Any, pl_module: Any, state: Preemption) -> int:
        """The signal every rank agreed on at the last check (0: none yet)."""
        if world_size() == 1:
            return state.signum
        guard = getattr(pl_module, "nan_guard", None)
        if guard is not None and guard.watching:
            return guard.agreed
        if trainer.global_step % max(1, trainer.log_every_n_steps):
            return 0
        flag = torch.tensor([state.signum], device=pl_module.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
