"""Two-process gloo groups on one CPU."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable, Union

import torch.distributed as dist


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
