"""What pretrained encoders save in labels, side by side: ``moco-lightning evaluate`` on several checkpoints.

    python -m benchmarks.low_label --ckpt A.ckpt B.ckpt --names demo long --fractions 0.01 0.1
    python -m benchmarks.low_label --ckpt X.ckpt --fractions 0.01 --steps 5 --train-subset 6400 --eval-subset 500

Each encoder is measured by :func:`moco_lightning.downstream.evaluate.evaluate` (kNN at k 20 and 200, linear on all
labels, and
per label fraction linear on frozen features, fine-tuned and from scratch, beside the raw pixels) on Fashion-MNIST's
test split (``--split val``: the held-out end of the training split); this prints the tables one after the other.
"""

from __future__ import annotations

import time

from benchmarks._common import footer, header, parser, quiet


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--ckpt", nargs="+", required=True, help="checkpoints of pretraining (any method) or exports")
    p.add_argument("--names", nargs="+", default=None, help="a name per checkpoint for the tables")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.1])
    p.add_argument(
        "--steps", type=int, default=None, help="fine-tune steps (default: max(30 epochs, min(600, 200 epochs)))"
    )
    p.add_argument("--split", choices=("test", "val"), default="test")
    p.add_argument("--eval-subset", type=int, default=None, help="smoke runs: the first N evaluation images")
    p.add_argument("--train-subset", type=int, default=None, help="smoke runs: the labels drawn from the first N")
    args = p.parse_args(argv)
    names = args.names or [str(c) for c in args.ckpt]
    if len(names) != len(args.ckpt):
        p.error("--names needs one name per --ckpt")
    quiet()
    t0 = time.perf_counter()
    header("Low-label evaluation: moco-lightning evaluate, encoder by encoder", args)
    from moco_lightning.datamodules import FashionMNISTDataModule
    from moco_lightning.downstream.evaluate import HOLDOUT, evaluate
    from moco_lightning.downstream.report import markdown

    for name, ckpt in zip(names, args.ckpt):
        data = FashionMNISTDataModule(
            pretrain=False,
            supervised_min_scale=1.0,
            train_subset=args.train_subset,
            val_subset=args.eval_subset,
            holdout=HOLDOUT if args.split == "val" else None,
            seed=args.seed,
        )
        result = evaluate(ckpt, data, args.fractions, steps=args.steps, seed=args.seed)
        print(f"### {name}\n\n{markdown(result)}\n", flush=True)
    footer(t0)


if __name__ == "__main__":
    main()
