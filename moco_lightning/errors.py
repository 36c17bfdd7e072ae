"""The library's error types for bad input, and the argument checks that raise them.

A setting or a file that is wrong gets a message saying which and what to do. The command line prints these as
one ``error:`` line (exit code 2) instead of a traceback.
"""

from __future__ import annotations

import typing
from typing import Any, Callable, Literal, Mapping


class ConfigError(ValueError):
    """A constructor argument, a combination of settings or an input that cannot work."""


class DataNotFoundError(ConfigError, FileNotFoundError):
    """A dataset, folder or checkpoint that is not where the settings say."""


class BadInputError(RuntimeError):
    """Input data that cannot be used as it is (an image file that does not decode), found while reading it."""


#: the range rules of :func:`check_arguments`: (test, what the message says is allowed)
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "> 0": (lambda v: v > 0, "a number > 0"),
    ">= 0": (lambda v: v >= 0, "a number >= 0"),
    "[0, 1]": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "[0, 1)": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "(0, 1]": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "int >= 0": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "int >= 1": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "ints >= 0": (lambda v: all(isinstance(m, int) and m >= 0 for m in v), "a list of integers >= 0"),
}


#: the range of every numeric constructor argument of the library's modules, by name: a name means the same thing
#: (and has the same range) wherever it appears
RANGES: dict[str, str] = {
    "in_channels": "int >= 1", "image_size": "int >= 1", "width": "> 0", "lr": "> 0", "weight_decay": ">= 0",
    "sgd_momentum": "[0, 1)", "warmup_epochs": ">= 0", "lr_milestones": "ints >= 0", "queue_size": "int >= 0",
    "momentum": "[0, 1]", "temperature": "> 0", "dim": "int >= 1", "hidden_dim": "int >= 1", "bn_splits": "int >= 1",
    "num_negatives": "int >= 1", "bank_momentum": "[0, 1]", "memory_bank_size": "int >= 1",
    "n_prototypes": "int >= 1", "sinkhorn_iterations": "int >= 1", "sinkhorn_epsilon": "> 0",
    "freeze_prototypes_epochs": ">= 0",
}  # fmt: skip


def check_arguments(owner: str, init: Callable, args: Mapping[str, Any], ranges: Mapping[str, str] = RANGES) -> None:
    """One clear error for the first bad argument, naming it and what is allowed.

    The choices of ``Literal``-typed parameters come from ``init``'s signature (not listed again here); ``ranges``
    maps parameters to a rule of :data:`RULES` (those not in ``args`` are skipped)."""
    hints = typing.get_type_hints(init)
    for name, hint in hints.items():
        if typing.get_origin(hint) is Literal and name in args and args[name] not in typing.get_args(hint):
            choices = ", ".join(repr(c) for c in typing.get_args(hint))
            raise ConfigError(f"{owner}: {name}={args[name]!r} is not allowed; {name} must be one of {choices}")
    for name, rule in ranges.items():
        if name not in args or args[name] is None:  # checked by the class that takes it; None: unset
            continue
        ok, allowed = RULES[rule]
        try:
            valid = ok(args[name])
        except TypeError:
            valid = False
        if not valid:
            raise ConfigError(f"{owner}: {name}={args[name]!r} is not allowed; {name} must be {allowed}")
