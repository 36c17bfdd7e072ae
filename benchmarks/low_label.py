"""What a pretrained encoder saves in labels: 1 % and 10 % of Fashion-MNIST's labels, four ways, one command.

    python benchmarks/low_label.py --ckpt runs/quickstart/version_0/checkpoints/last.ckpt
    python benchmarks/low_label.py --ckpt A.ckpt B.ckpt --names demo long --fractions 0.01 0.1   # several encoders
    python benchmarks/low_label.py --ckpt X.ckpt --fractions 0.01 --steps 5 --train-subset 6400 --eval-subset 500

For each label fraction (a seeded, class-stratified subset of the 60k training images: the library's
``balanced_subset``, the semi-supervised protocol of SimCLR §B.5), on the official 10k test split:

- **linear, frozen**: a linear classifier on the encoder's frozen, standardised features of the labelled images
  (``_common.low_label_probe``: Adam, at least 500 steps and 20 epochs), and the same on the **raw pixels**;
  ``--fractions 1.0`` adds the full-label linear probe (fine-tuning is then skipped);
- **fine-tuned**: ``configs/low_label.yaml`` through the library's ``LinearClassifier(finetune=True)``: the
  pretrained backbone at ``backbone_lr`` 0.01, the head at 0.05, SGD momentum 0.9, wd 5e-4, cosine per step, batches
  of 64 with flips, BatchNorm in train mode;
- **from scratch**: the same architecture (rebuilt from the checkpoint's hyper-parameters), randomly initialised,
  the same recipe at lr 0.05 everywhere (``from_scratch=True``) for the same number of steps: the same wall time.

Steps: ``max(600, 30 epochs of the labelled images)``: 600 at 1 % (64 epochs of 600 images), 2812 at 10 %.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CONFIGS, fashion_mnist, features, footer, header, low_label_probe, print_table, quiet  # noqa: E402


def steps_for(n_labelled: int, batch_size: int = 64) -> int:
    return max(600, round(30 * n_labelled / batch_size))


def classifier_from_config(*overrides: str):
    """(LinearClassifier, datamodule, trainer) of ``configs/low_label.yaml`` with overrides, built by the CLI."""
    from lightning.pytorch.cli import LightningCLI

    from moco_lightning._lightning import own_hyperparameters
    from moco_lightning.linear_eval import LinearClassifier

    args = [
        "--config",
        str(CONFIGS / "low_label.yaml"),
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.accelerator=cpu",
        *overrides,
    ]
    with own_hyperparameters():
        cli = LightningCLI(LinearClassifier, subclass_mode_data=True, run=False, args=args, save_config_callback=None)
    return cli.model, cli.datamodule, cli.trainer


def tune(ckpt: str, fraction: float, steps: int, scratch: bool, args) -> tuple[float, float]:
    """Test top-1 and training seconds of a fine-tune (or from-scratch) run."""
    overrides = [
        f"--model.ckpt_path={ckpt}",
        f"--model.label_fraction={fraction}",
        f"--model.label_seed={args.seed}",
        f"--trainer.max_steps={steps}",
        "--trainer.check_val_every_n_epoch=100000",
        f"--seed_everything={args.seed}",
    ]
    if scratch:
        overrides += ["--model.from_scratch=true", "--model.backbone_lr=null"]
    if args.eval_subset:
        overrides.append(f"--data.init_args.val_subset={args.eval_subset}")
    if args.train_subset:
        overrides.append(f"--data.init_args.train_subset={args.train_subset}")
    model, dm, trainer = classifier_from_config(*overrides)
    t = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    seconds = time.perf_counter() - t
    acc = trainer.validate(model, datamodule=dm, verbose=False)[0]["val/acc1"]
    return float(acc), seconds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--ckpt", nargs="+", required=True, help="pretraining checkpoints (MoCo, named backbone)")
    p.add_argument("--names", nargs="+", default=None, help="a name per checkpoint for the table")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.1])
    p.add_argument("--steps", type=int, default=None, help="fine-tune steps (default: max(600, 30 epochs))")
    p.add_argument("--eval-subset", type=int, default=None, help="smoke runs: the first N test images")
    p.add_argument("--train-subset", type=int, default=None, help="smoke runs: the labels drawn from the first N")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    names = args.names or [Path(c).stem for c in args.ckpt]
    if len(names) != len(args.ckpt):
        p.error("--names needs one name per --ckpt")
    quiet()
    t0 = time.perf_counter()
    header("Low-label evaluation: linear (frozen), fine-tuned, from scratch, raw pixels", args)
    from moco_lightning.linear_eval import LinearClassifier, balanced_subset

    train, test = fashion_mnist("train"), fashion_mnist("test")
    if args.eval_subset:
        test = tuple(t[: args.eval_subset] for t in test)
    if args.train_subset:
        train = tuple(t[: args.train_subset] for t in train)
    pixels = (features(nn.Flatten(), *train), features(nn.Flatten(), *test))
    encoders = {}
    for name, ckpt in zip(names, args.ckpt):
        backbone = LinearClassifier(ckpt_path=ckpt, num_classes=10).backbone.eval()
        encoders[name] = (features(backbone, *train), features(backbone, *test))
    rows, scratch_done = [], {}
    for fraction in args.fractions:
        n = len(balanced_subset(train[1], fraction=fraction, seed=args.seed))
        steps = args.steps or steps_for(n)
        px = low_label_probe(*pixels[0], *pixels[1], fraction=fraction, seed=args.seed)
        for name, ckpt in zip(names, args.ckpt):
            linear = low_label_probe(*encoders[name][0], *encoders[name][1], fraction=fraction, seed=args.seed)
            if fraction >= 1:  # the full-label linear probe only
                rows.append([name, f"100 % ({n})", f"{100 * linear:.2f}", f"{100 * px:.2f}", *["-"] * 5])
                continue
            fine, fine_s = tune(ckpt, fraction, steps, False, args)
            if fraction not in scratch_done:  # one baseline per fraction: the architecture is the checkpoints'
                scratch_done[fraction] = tune(ckpt, fraction, steps, True, args)
            scratch, scratch_s = scratch_done[fraction]
            rows.append(
                [
                    name,
                    f"{100 * fraction:g} % ({n})",
                    f"{100 * linear:.2f}",
                    f"{100 * px:.2f}",
                    f"{100 * fine:.2f} ({fine_s:.0f} s)",
                    f"{100 * scratch:.2f} ({scratch_s:.0f} s)",
                    f"{100 * (fine - scratch):+.2f}",
                    f"{100 * (linear - scratch):+.2f}",
                    str(steps),
                ]
            )
            print(
                f"  {name}, {fraction:g}: linear {linear:.4f}, fine-tuned {fine:.4f}, scratch {scratch:.4f}", flush=True
            )
    print()
    print_table(
        rows,
        [
            "encoder",
            "labels",
            "linear frozen %",
            "linear raw pixels %",
            "fine-tuned %",
            "from scratch %",
            "fine - scratch",
            "linear - scratch",
            "steps",
        ],
    )
    footer(t0)


if __name__ == "__main__":
    main()
