"""How the benchmarks time things, in one place: a call's seconds, cases timed in turn and their paired ratio, the
Trainer's seconds per step (:class:`StepClock`, :func:`seconds_per_step`) and the budget planners (how many steps a
budget affords: before a run from a timed ratio, :func:`steps_in_budget`; inside a run from its own clock,
:func:`steps_affordable`)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Sequence


def time_per_call(fn: Callable[[], object], n: int, warmup: int = 1) -> float:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then the mean of ``n`` timed calls."""
    for _ in range(warmup):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def interleaved(cases: Dict[str, Callable[[], float]], repeats: int) -> Dict[str, List[float]]:
    """Runs every case once per repeat (order reversed every other repeat); each call returns one measurement."""
    names = list(cases)
    out: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(cases[name]())
    return out


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median over repeats of a[r] / b[r] (both measured in the same repeat, so slow drift cancels)."""
    return statistics.median(x / y for x, y in zip(a, b))


def spread(v: Sequence[float], scale: float = 1e3, fmt: str = "{:.0f}") -> str:
    """'median [min-max]' of a list of seconds, in ms by default."""
    return f"{fmt.format(statistics.median(v) * scale)} [{fmt.format(min(v) * scale)}-{fmt.format(max(v) * scale)}]"


class StepClock:
    """A Lightning callback recording ``perf_counter`` at every ``on_train_batch_end``: the interval between two is
    one whole loop iteration (the end-of-step hooks, fetching + augmenting the next batch, the next step)."""

    def __new__(cls, *a, **k):  # the Callback subclass is built lazily so that importing this file stays cheap
        from lightning.pytorch import Callback

        class _StepClock(Callback):
            def __init__(self) -> None:
                self.ends: List[float] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                self.ends.append(time.perf_counter())

            def seconds(self, warmup: int, steps: int) -> float:
                """Wall time of iterations warmup+1 ... warmup+steps (1-based)."""
                return self.ends[warmup + steps - 1] - self.ends[warmup - 1]

        return _StepClock(*a, **k)


def seconds_per_step(fit: Callable[[int, list], Any], warmup: int, steps: int) -> float:
    """Wall time per step of ``fit(total_steps, callbacks)`` (a throwaway run): ``steps`` timed after ``warmup``."""
    clock = StepClock()
    fit(warmup + steps, [clock])
    return clock.seconds(warmup, steps) / steps


def steps_in_budget(budget_units: float, unit_steps: int, ratio: float) -> int:
    """The steps ``budget_units`` units afford (a unit: ``unit_steps`` steps of the reference) to a run whose step
    costs ``ratio`` reference steps."""
    return max(1, round(budget_units * unit_steps / ratio))


def steps_affordable(budget_s: float, step: int, train_s: float) -> int:
    """Inside a run at optimizer ``step`` after ``train_s`` seconds of training: the steps ``budget_s`` affords."""
    return max(step + 1, int(budget_s * step / train_s))
