"""Two-process gloo groups on one CPU."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable, Union

import torch.distributed as dist
import torch.multiprocessing as mp

mp.set_forkserver_preload(["torch", "lightning.pytorch", "moco_lightning", "moco_lightning.datamodules"])


def run_ranks(worker: Callable, *args, nprocs: int = 2) -> None:
    """``worker(rank, *args)`` in ``nprocs`` processes; raises if one of them fails.

    The processes are forked from a server process that imported torch, Lightning and moco-lightning once (started at
    the first call in a test process): ~0.3 s a test where spawned interpreters import them again in each rank
    (~5-10 s on 2 cores). Not forked from the test process itself: a rank forked from a pytest worker that had run
    other tests (threads of their own) hung in its first torch operation. ``worker`` builds its tensors itself (the
    arguments are paths and numbers): tensors passed in would be shared memory between the ranks."""
    mp.start_processes(worker, args=args, nprocs=nprocs, join=True, start_method="forkserver")


@contextlib.contextmanager
def gloo_rank(rank: int, port: Union[int, str], world_size: int = 2):
    """This spawned process as ``rank`` of a gloo group, destroyed on the way out; ``port``: a TCP port on localhost,
    or the path of a file store (what :func:`free_port` gives)."""
    init = f"file://{port}" if isinstance(port, str) else f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def free_port() -> str:
    """A rendezvous for a 2-process gloo group: a fresh file store, not a TCP port (a port chosen by binding and
    releasing it can be taken by a parallel test before the group binds it)."""
    return os.path.join(tempfile.mkdtemp(prefix="gloo-"), "store")


class ExitHandlers:
    """Stands in for the ``atexit`` module of :mod:`moco_lightning.modules.distributed`
    (``monkeypatch.setattr(distributed,
    "atexit", ExitHandlers())``): records what would run at exit, once per function, as ``atexit`` keeps it."""

    def __init__(self) -> None:
        self.handlers: list[Callable] = []

    def register(self, function: Callable) -> None:
        self.handlers.append(function)

    def unregister(self, function: Callable) -> None:
        self.handlers = [f for f in self.handlers if f is not function]
