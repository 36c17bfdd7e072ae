"""``moco-lightning linear fit --config configs/linear_eval.yaml`` (also ``python -m moco_lightning.cli.linear fit
...``): the library's CLI over :class:`~moco_lightning.downstream.linear_eval.LinearClassifier`."""

from __future__ import annotations

from typing import Optional

from moco_lightning.cli.app import run_cli
from moco_lightning.downstream.linear_eval import LinearClassifier
from moco_lightning.modules.distributed import end_process_group


def main(args: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """Linear evaluation (or low-label fine-tuning) of a pretrained encoder; ``fit`` ends with the final metrics."""
    try:
        run_cli(LinearClassifier, args, prog=prog or "moco-lightning linear")
    finally:
        end_process_group()


if __name__ == "__main__":
    main()
