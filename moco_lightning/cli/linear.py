"""``python -m moco_lightning.linear_eval fit --config configs/linear_eval.yaml`` (also ``moco-lightning linear fit
...``): the library's CLI over :class:`~moco_lightning.linear_eval.LinearClassifier`."""

from __future__ import annotations

from typing import Optional

from ..distributed import end_process_group
from ..linear_eval import LinearClassifier
from .app import run_cli


def main(args: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """Linear evaluation (or low-label fine-tuning) of a pretrained encoder; ``fit`` ends with the final metrics."""
    try:
        run_cli(LinearClassifier, args, prog=prog)
    finally:
        end_process_group()
