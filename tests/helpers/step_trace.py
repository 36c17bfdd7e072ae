"""Which of the library's functions one training step runs: ``sys.setprofile`` from one ``training_step`` to the next
batch (the optimizer step, its lr schedule and ``on_train_batch_end`` included), split apart into the step itself and
the run's callbacks around it (:mod:`moco_lightning.run` and what they call)."""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.pytorch import Callback

import moco_lightning

ROOT = os.path.dirname(moco_lightning.__file__)
RUN = os.path.join(ROOT, "run") + os.sep
UNNAMED = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>")  # comprehensions are not functions


class StepTrace(Callback):
    """Records the library's named functions called during training batch ``batch`` (0-based): :attr:`step` and
    :attr:`callbacks`, each a set of ``(file relative to moco_lightning/, qualified name)``."""

    def __init__(self, batch: int = 2) -> None:
        self.batch = batch
        self.step: set[tuple[str, str]] = set()
        self.callbacks: set[tuple[str, str]] = set()
        self._in_run = 0

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        path = frame.f_code.co_filename
        if not path.startswith(ROOT):
            return
        if event == "call":
            if path.startswith(RUN):
                self._in_run += 1
            name = frame.f_code.co_qualname
            if not name.endswith(UNNAMED):
                (self.callbacks if self._in_run else self.step).add((os.path.relpath(path, ROOT), name))
        elif event == "return" and path.startswith(RUN):
            self._in_run -= 1

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch + 1:
            sys.setprofile(None)
        elif batch_idx == self.batch:
            sys.setprofile(self._profile)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        sys.setprofile(None)


def by_file(functions: set[tuple[str, str]]) -> dict[str, list[str]]:
    """``{file: [function, ...]}``, sorted."""
    files: dict[str, list[str]] = {}
    for path, name in sorted(functions):
        files.setdefault(path, []).append(name)
    return files
