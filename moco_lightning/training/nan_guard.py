"""The guard against non-finite losses: decided by all ranks together, read only at check steps.

Reading a loss on the host every step would stall an accelerator once per step, and a per-rank check stops one rank
while the others wait in the next collective until a timeout. So each step only records, on the device, a "not
finite" flag (which also says whether the batch's images held NaN or inf pixels, so that the error blames the data,
not the lr, when that is the cause). The flags are read at check steps: every ``log_every_n_steps`` steps (when
Lightning reads its logged metrics anyway; at least every 100), before any checkpoint is written, and at the end
of training. There the
flags since the last check are all-reduced (max) across ranks, with a number of the caller's (the signal of a
preempted run, :mod:`moco_lightning.training.preemption`), and read once: every rank stops at the same step with the
first bad step's message, and no checkpoint holds the bad weights (a non-finite loss makes the weights that follow
non-finite; the steps up to the check are wasted, not saved). ``on_nan="skip"`` (one process only) reads each loss
at once, which it must to skip that batch, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from moco_lightning.errors import ConfigError
from moco_lightning.modules.distributed import world_size


class NanGuard:
    """``on_nan``: ``"raise"`` or ``"skip"``; ``owner``: the module's name for the messages."""

    #: the most steps between two checks, whatever the logging interval (the flags kept unread stay few)
    MAX_UNREAD = 100

    def __init__(self, on_nan: str, owner: str) -> None:
        self.on_nan, self.owner = on_nan, owner
        self._pending: list[tuple] = []  # (flag on the device, loss, where, hints) of each step since the last check
        self.agreed = 0  # the largest ``extra`` any rank passed at the last check
        self.watching = False  # the reader runs (moco_lightning.run.NanStop): it records each step's flag
        self.due = False  # the last step was a check step: the reader reads the flags after it

    def check_trainer(self, trainer: Any) -> None:
        """``on_nan="skip"`` needs one process (DDP ranks must take the same optimizer steps); the losses are fp32
        (a float64 or transformer-engine precision is refused)."""
        if str(trainer.precision) in ("64-true", "64", "transformer-engine"):
            raise ConfigError(
                f"{self.owner}: trainer.precision={trainer.precision!r} is not supported (the similarities, queue and "
                "losses are computed in fp32); use 32-true or bf16-mixed"
            )
        if self.on_nan == "skip" and trainer.world_size > 1:
            raise ConfigError(
                f"{self.owner}: on_nan='skip' cannot be used with {trainer.world_size} processes: every rank must take "
                "the same optimizer steps (Lightning does not support skipping a batch under DDP); use on_nan='raise'"
            )

    def reset(self) -> None:
        self._pending, self.agreed, self.due = [], 0, False

    def usable(self, loss: Tensor, where: str, inputs: Sequence[Tensor] = ()) -> bool:
        """``on_nan="skip"``: False skips this batch, with a warning (the loss read on the host, which it must be)."""
        if torch.isfinite(loss):
            return True
        bad = bool(self.bad_input(inputs)) if inputs else False
        what = " (the batch holds non-finite pixels)" if bad else ""
        warnings.warn(f"{self.owner}: loss is {loss.item()} {where}{what}; batch skipped (on_nan='skip')", stacklevel=3)
        return False

    def record(
        self, loss: Tensor, where: str, hints: Callable[[], str], inputs: Sequence[Tensor] = (), check: bool = False
    ) -> None:
        """``on_nan="raise"`` (:class:`~moco_lightning.run.NanStop`, after each step): the step's flag, on the device
        (``inputs``: the batch's images), and whether the step is a check step (``check``: :attr:`due`)."""
        flag = (~torch.isfinite(loss.detach())).to(torch.int32)
        if inputs:  # 3: the loss and the images; 1: the loss alone (MAX across ranks keeps the worst)
            flag = flag + 2 * (self.bad_input(inputs).to(torch.int32) & flag)
        self._pending.append((flag, loss.detach(), where, hints))
        self.due = check

    @staticmethod
    def bad_input(inputs: Sequence[Tensor]) -> Tensor:
        """On the device: whether any of the images holds a NaN or inf."""
        return torch.stack([~torch.isfinite(x).all() for x in inputs]).any()

    def check(self, extra: int = 0) -> None:
        """Reads the flags of the steps since the last check and ``extra``, each the maximum over the ranks (every rank
        calls it at the same step), ``extra``'s into :attr:`agreed`; raises with the first non-finite step's message,
        before a checkpoint, at the end of training. With nothing recorded since the last check nothing is read."""
        self.due = False
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        flags = torch.stack([flag for flag, *_ in pending])
        flags = torch.cat([flags, torch.full((1,), extra, dtype=torch.int32, device=flags.device)])
        if world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        *steps, self.agreed = flags.tolist()  # the one read on the host
        first = next((i for i, flag in enumerate(steps) if flag), None)
        if first is not None:
            _, loss, where, hints = pending[first]
            raise self.error(steps[first], loss, where, hints)

    def error(self, flag: int, loss: Tensor, where: str, hints: Callable[[], str]) -> FloatingPointError:
        own = not bool(torch.isfinite(loss))
        if flag == 3:
            return FloatingPointError(
                f"{self.owner}: the training batch {where} holds non-finite values (NaN or inf pixels"
                + ("" if own else ", on another rank")
                + "), so the loss is not finite: check the images and their normalisation (the datamodule's mean and "
                "std). Every rank stopped; no checkpoint was written with the weights of that step."
            )
        whose = "loss" if own else "this rank's loss"
        return FloatingPointError(
            f"{self.owner}: {whose} is {loss.item()} {where}"
            + ("" if own else " (a non-finite loss on another rank)")
            + f". Likely causes: {hints()}. Every rank stopped; no checkpoint was written with the weights of that "
            "step or after it: resume from the last good checkpoint with a lower lr, or set on_nan='skip' (one process "
            "only)."
        )


def likely_causes(trainer: Any, lr: float) -> str:
    """The usual causes of a non-finite pretraining loss, for the guard's error (``lr``: the setting, per 256)."""
    now = trainer.optimizers[0].param_groups[0]["lr"]
    precision = str(trainer.precision)
    fp16 = precision.startswith("16")
    overflow = f", or fp16 overflow (precision={precision!r}: try bf16-mixed or 32-true)" if fp16 else ""
    return f"a learning rate too high (lr={lr} per 256 images, now {now:.4g}){overflow}"
