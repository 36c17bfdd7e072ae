"""Counting what a training step reads back to the host: on a GPU each such read waits for every queued kernel.

On the CPU the reads are still visible: ``aten._local_scalar_dense`` (``.item()``, ``bool()``, ``int()`` and
``float()`` of a tensor) through a dispatch mode, and the calls that copy a tensor to the host without a dispatched
operator (``.tolist()``, ``.numpy()``, ``.cpu()``, ``__array__``) through wrappers. Reads of the optimizer's step
counters are left out: torch keeps them on the host by design (outside ``capturable`` mode), on a GPU too.
"""

from __future__ import annotations

import traceback
from collections import defaultdict
from typing import Any

import torch
from lightning.pytorch import Callback
from torch.utils._python_dispatch import TorchDispatchMode

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default}
COPIES = ("tolist", "numpy", "cpu", "__array__")


class HostReads(Callback, TorchDispatchMode):
    """``with HostReads() as reads: trainer.fit(..., callbacks=[reads])``: ``reads.per_step[i]`` lists where the
    ``i``-th training batch (from its start to the next one's) read a tensor on the host."""

    def __init__(self) -> None:
        Callback.__init__(self)
        TorchDispatchMode.__init__(self)
        self.per_step: dict[int, list[str]] = defaultdict(list)
        self.step = -1
        self.trainer: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.trainer, self.step = trainer, self.step + 1

    def on_train_end(self, trainer, pl_module) -> None:
        self.step = -1

    def _record(self, what: str) -> None:
        if self.step < 0:
            return
        frames = [f for f in traceback.extract_stack()[:-3] if "/torch/" not in f.filename or "optim" in f.filename]
        where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(frames[-3:]))
        self.per_step[self.step].append(f"{what} at {where}")

    def _host_counter(self, tensor: Any) -> bool:
        optimizers = self.trainer.optimizers if self.trainer is not None else []
        return any(tensor is state.get("step") for opt in optimizers for state in opt.state.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS and not self._host_counter(args[0]):
            self._record(func.__name__)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._originals = {name: getattr(torch.Tensor, name) for name in COPIES}
        for name, original in self._originals.items():

            def copy(tensor, *args, _original=original, _name=name, **kwargs):
                self._record(_name)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, copy)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)
