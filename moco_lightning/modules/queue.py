"""MoCo's dictionary: a FIFO queue of the K most recent keys (He et al. 2020, §3.1 "Dictionary as a queue").

"The samples in the dictionary are progressively replaced. The current mini-batch is enqueued to the
dictionary, and the oldest mini-batch in the queue is removed." The queue is a persistent buffer, so
it is saved in checkpoints and moved with the module; enqueuing is pure tensor indexing (no
host-device synchronisation) and accepts any batch size, including batches larger than K.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moco_lightning.modules.negatives import Negatives


class KeyQueue(Negatives):
    """K L2-normalised keys of size ``dim`` (rows of ``keys``), a write pointer, and each slot's write step.

    The initial keys are random unit vectors drawn from the global RNG, so a given seed gives the same
    queue (on every DDP rank).
    """

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        if size < 1:
            raise ValueError(f"KeyQueue: size={size}; a queue holds at least one key (no queue: InBatch)")
        self.size = size
        self.register_buffer("keys", F.normalize(torch.randn(size, dim), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        # global step at which each slot was last written; -1 for the initial random keys
        self.register_buffer("enqueued_at", torch.full((size,), -1, dtype=torch.long))

    def negatives(self) -> Tensor:
        """The K queued keys (the product uses them as they are before this step's enqueue)."""
        return self.keys

    def to_store(self, queries: list[Tensor], keys: list[Tensor], index: Optional[Tensor]) -> tuple[Tensor, ...]:
        """The step's keys (of every global view), detached."""
        return (torch.cat(keys).detach(),)

    def store(self, keys: Tensor, step: int) -> None:  # type: ignore[override]
        self.enqueue(keys, step)

    @torch.no_grad()
    def enqueue(self, keys: Tensor, step: int = -1) -> None:
        """Writes ``keys`` (B, dim) after the newest entries, wrapping around; the oldest are overwritten.

        Equivalent to enqueuing the rows one by one: with B > K only the last K rows survive.
        """
        n = keys.shape[0]
        if n > self.size:
            keys = keys[n - self.size :]
        start = self.ptr + max(n - self.size, 0)
        slots = (start + torch.arange(keys.shape[0], device=keys.device)) % self.size
        # index_copy_ / index_fill_: an indexed assignment of the Python int `step` would copy it to the device
        # from pageable memory, which blocks the host (one sync per step on a GPU)
        self.keys.index_copy_(0, slots, keys.to(self.keys.dtype))
        self.enqueued_at.index_fill_(0, slots, step)
        self.ptr.copy_((self.ptr + n) % self.size)

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.keys.shape[1]}"
