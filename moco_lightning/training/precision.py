"""The fastest precision this machine runs natively: ``trainer.precision: auto`` (CLI) and :func:`auto_precision`.

bf16 autocast pays only where bf16 is native: on a CUDA GPU with bf16 (Ampere and later) and on a CPU with bf16
instructions, AMX tiles (Intel: measured 2.1x faster for a CIFAR-stem ResNet-18 on 28-px images) or AVX512-BF16
(an AMD EPYC: 1.3x for the ImageNet stem, 1.5x for the stride-2 CIFAR stem, 1.9x for the CIFAR stem,
``benchmarks/results/precision.txt``); elsewhere it is emulated and slower (2.7x slower on an older AMD EPYC).
A fixed ``precision:`` in a config is therefore wrong on one of the machines it meets; ``auto`` picks
``"bf16-mixed"`` where bf16 is native and ``"32-true"`` otherwise, and says which and why in one line. The losses,
logits, queue and weights stay fp32 under ``bf16-mixed``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch import Trainer

AUTO = "auto"


def cpu_bf16() -> Optional[str]:
    """The CPU's native bf16 instructions (Linux's /proc/cpuinfo flags): ``"AMX"``, ``"AVX512-BF16"`` or None."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None
    return "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else None


def cuda_has_bf16() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def auto_precision(accelerator: str = "auto", verbose: bool = True) -> str:
    """``"bf16-mixed"`` where bf16 is native for ``accelerator`` (``"auto"``: a CUDA GPU if there is one, else the
    CPU), else ``"32-true"``; ``verbose``: one line on stderr says what was chosen and why."""
    gpu = accelerator in ("gpu", "cuda") or (accelerator == AUTO and torch.cuda.is_available())
    if gpu:
        native, device = cuda_has_bf16(), f"GPU {torch.cuda.get_device_name() if torch.cuda.is_available() else '?'}"
        why = "native bf16" if native else "no bf16 support"
    else:
        instructions, device = cpu_bf16(), "CPU"
        native = instructions is not None
        why = f"{instructions} bf16 instructions" if native else "no AMX or AVX512-BF16: bf16 would be emulated, slower"
    chosen = "bf16-mixed" if native else "32-true"
    if verbose:
        print(f"moco-lightning: precision auto: {chosen} ({device}, {why})", file=sys.stderr, flush=True)
    return chosen


class AutoPrecisionTrainer(Trainer):
    """Lightning's Trainer that also takes ``precision="auto"`` (:func:`auto_precision`); the CLI's trainer."""

    def __init__(self, *, precision: Optional[Union[Literal["auto"], Any]] = None, **kwargs: Any) -> None:
        if precision == AUTO:
            precision = auto_precision(str(kwargs.get("accelerator", AUTO)))
        super().__init__(precision=precision, **kwargs)
