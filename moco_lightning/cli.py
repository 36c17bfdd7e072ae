"""The ``moco-lightning`` command: Lightning's CLI over :class:`MoCo` and any datamodule.

    moco-lightning fit --config configs/quickstart.yaml
    moco-lightning fit --config configs/moco_v2.yaml --data.init_args.data_dir /data/imagenet
    python -m moco_lightning fit --print_config
    moco-lightning export --ckpt last.ckpt --out backbone.pt
"""

from __future__ import annotations

import sys
from typing import Optional

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from .moco import MoCo


class MoCoCLI(LightningCLI):
    """LightningCLI that ends ``fit`` with a table of the final metrics (used by ``linear_eval`` too)."""

    def after_fit(self) -> None:
        metrics = {k: float(v) for k, v in sorted(self.trainer.callback_metrics.items()) if v.numel() == 1}
        log_dir = self.trainer.log_dir  # a collective under DDP: every rank must ask
        if metrics and self.trainer.is_global_zero:
            width = max(map(len, metrics))
            print("\nFinal metrics:")
            for name, value in metrics.items():
                print(f"  {name:<{width}}  {value:.4g}")
            if log_dir:
                print(f"TensorBoard: tensorboard --logdir {log_dir}")


def main(args: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["export"]:
        from .export import main as export_main

        return export_main(argv[1:])
    run_cli(MoCo, args)


def run_cli(model_class: type, args: Optional[list[str]] = None) -> MoCoCLI:
    """Lightning's CLI over ``model_class`` and any datamodule (``data: class_path: ...``)."""
    return MoCoCLI(model_class, LightningDataModule, subclass_mode_data=True, save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
