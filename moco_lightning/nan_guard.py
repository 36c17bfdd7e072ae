"""The guard against non-finite losses: decided by all ranks together, read one step late.

A per-rank check stops one rank, and the others wait in the next collective until a timeout; reading the flag at
once would stall the GPU once per step. So a "not finite" flag is all-reduced (max), copied to the host
asynchronously, and read at the start of the next step, before a checkpoint is saved, or at the end of training:
every rank stops at the same step, before a checkpoint holds the bad weights. ``on_nan="skip"`` (one process only)
skips the batch with a warning instead. The flag also says whether the batch's images held non-finite values (NaN or
inf pixels), so that the error blames the data, not the lr, when that is the cause; and it carries a number of the
caller's, agreed (the maximum) across ranks by the same collective: the signal of a preempted run
(:mod:`moco_lightning.preemption`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .distributed import world_size
from .errors import ConfigError


class NanGuard:
    """``on_nan``: ``"raise"`` or ``"skip"``; ``owner``: the module's name for the messages."""

    def __init__(self, on_nan: str, owner: str) -> None:
        self.on_nan, self.owner = on_nan, owner
        self._pending: Optional[tuple] = None  # (flag, event, loss, where) of the last step
        self.agreed = 0  # the largest ``extra`` any rank passed with the last checked step

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

    def usable(
        self, loss: Tensor, where: str, hints: Callable[[], str], inputs: Sequence[Tensor] = (), extra: int = 0
    ) -> bool:
        """False: skip this batch (``on_nan="skip"``). Otherwise the deferred, collective check (see the module);
        ``inputs``: the batch's images; ``extra``: a number agreed across ranks with the flag (:attr:`agreed`)."""
        self.raise_if_pending()
        bad_input = torch.stack([~torch.isfinite(x).all() for x in inputs]).any() if inputs else None
        if self.on_nan == "skip":  # reading the loss synchronises with the device
            if torch.isfinite(loss):
                return True
            what = " (the batch holds non-finite pixels)" if bad_input is not None and bool(bad_input) else ""
            warnings.warn(
                f"{self.owner}: loss is {loss.item()} {where}{what}; batch skipped (on_nan='skip')", stacklevel=3
            )
            return False
        flag = (~torch.isfinite(loss.detach())).to(torch.int32).reshape(1)
        if bad_input is not None:  # 3: the loss and the images; 1: the loss alone (MAX across ranks keeps the worst)
            flag = flag + 2 * (bad_input.to(torch.int32) & flag)
        flag = torch.cat([flag, torch.full((1,), extra, dtype=torch.int32, device=flag.device)])  # a fill, no copy
        if world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        event = None
        if flag.is_cuda:
            host = torch.empty_like(flag, device="cpu").pin_memory()
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flag = host
        self._pending = (flag, event, loss.detach(), where, hints)
        return True

    def raise_if_pending(self) -> None:
        """Raises if the last checked loss (of any rank) was not finite."""
        if self._pending is None:
            return
        flags, event, loss, where, hints = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        flag, self.agreed = int(flags[0]), int(flags[1])
        if flag == 3:
            raise FloatingPointError(
                f"{self.owner}: the training batch {where} holds non-finite values (NaN or inf pixels"
                + ("" if not torch.isfinite(loss) else ", on another rank")
                + "), so the loss is not finite: check the images and their normalisation (the datamodule's mean and "
                "std). Every rank stopped; no checkpoint was written with the weights of that step."
            )
        if flag:
            whose = "loss" if not torch.isfinite(loss) else "this rank's loss"
            raise FloatingPointError(
                f"{self.owner}: {whose} is {loss.item()} {where}"
                + (" (a non-finite loss on another rank)" if torch.isfinite(loss) else "")
                + f". Likely causes: {hints()}. Every rank stopped; no checkpoint was written with the weights of that "
                "step: resume from the last good checkpoint with a lower lr, or set on_nan='skip' (one process only)."
            )
