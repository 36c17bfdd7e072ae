"""Training throughput: moco-lightning vs a reference MoCo written the way lightly's examples write it.

    python benchmarks/peer_throughput.py                         # defaults: 5 warm-up + 30 timed steps, A/B/A/B
    python benchmarks/peer_throughput.py --steps 20 --repeats 3
    python benchmarks/peer_throughput.py --ref-channels-last     # give the reference our memory layout too

Both train the same backbone (the quickstart's: ResNet-18 width 0.5, standard stem, one input channel, 28 px),
with the same MLP head, batch, K, m, T, optimizer and data (the Fashion-MNIST train split, from the same IDX
files), under a plain ``lightning.pytorch`` Trainer (TensorBoard logger every 10 steps, no validation, no
checkpoints, no progress bar):

- ours: ``MoCo(...)`` + ``FashionMNISTDataModule`` (uint8 batches, both views drawn by ``BatchViews`` for the
  whole batch at once after the transfer; num_workers 0). ``shuffle_bn='auto'`` -> split BatchNorm (8 splits)
  and the key-batch shuffle, channels-last.
- reference: a LightningModule as in lightly's ``examples/pytorch_lightning/moco.py``: lightly
  ``MoCoProjectionHead``, ``NTXentLoss(temperature=T, memory_bank_size=(K, dim))``, ``deactivate_requires_grad``
  on the momentum copies, ``update_momentum`` at the start of ``training_step``; lightly ``MoCoV2Transform``
  (input_size 28, blur off, jitter 0.4/0.4/0.4/0.1 p 0.8, crop 0.2-1, flip; Fashion-MNIST mean/std) on PIL images
  of a torchvision-FashionMNIST-like dataset, in DataLoader workers (0 and 2 tried first, the faster is used).
  No shuffle BN (lightly's examples have none) and NCHW layout (lightly's examples do not convert).

Timing: a callback stamps every ``on_train_batch_end``; images/s = steps x batch / (time from the end of the last
warm-up step to the end of the last timed step): each interval is a whole loop iteration (fetching and
augmenting the batch, the step, the end-of-step hooks). The runs alternate ours / reference / ours / reference;
the ratio is the median of the per-pair ratios. Goal: ours / reference >= 1.2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    StepClock, add_model_args, describe_model, fashion_mnist, footer, header, make_reference, moco_kwargs, print_table,
    quiet, reference_loader, trainer_kwargs,
)


def run_ours(args, warmup: int, steps: int) -> float:
    import lightning.pytorch as pl

    from moco_lightning import MoCo
    from moco_lightning.datamodules import FashionMNISTDataModule

    torch.manual_seed(args.seed)
    model = MoCo(**moco_kwargs(args))
    dm = FashionMNISTDataModule(data_dir=args.data_dir, batch_size=args.batch_size, num_workers=0, seed=args.seed)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        pl.Trainer(**trainer_kwargs(warmup + steps, args.logger, tmp, [clock])).fit(model, datamodule=dm)
    return steps * args.batch_size / clock.seconds(warmup, steps)


def run_reference(args, data, workers: int, warmup: int, steps: int) -> float:
    import lightning.pytorch as pl

    torch.manual_seed(args.seed)
    model = make_reference(args, channels_last=args.ref_channels_last)
    loader = reference_loader(*data, args.batch_size, workers, args.seed)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        pl.Trainer(**trainer_kwargs(warmup + steps, args.logger, tmp, [clock])).fit(model, train_dataloaders=loader)
    return steps * args.batch_size / clock.seconds(warmup, steps)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    add_model_args(p)
    p.add_argument("--data-dir", default=None, help="folder of the Fashion-MNIST IDX files (default: Debian's)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of every run")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs (ours, reference), alternating")
    p.add_argument("--ref-workers", type=int, nargs="+", default=[0, 2],
                   help="DataLoader workers to try for the reference; the fastest is used (one value: no trial)")
    p.add_argument("--trial-steps", type=int, default=10, help="timed steps of each worker trial")
    p.add_argument("--ref-channels-last", action="store_true", help="run the reference in channels-last too")
    p.add_argument("--logger", choices=["tensorboard", "csv", "none"], default="tensorboard")
    args = p.parse_args(argv)
    quiet()
    t0 = time.perf_counter()
    header("Training throughput: moco-lightning vs the lightly-examples pattern", args)
    print(f"model (both): {describe_model(args)}")
    print(f"ours: MoCo + FashionMNISTDataModule (batched BatchViews, num_workers 0), shuffle_bn auto -> split (8), "
          f"{'channels_last' if args.channels_last else 'NCHW'}")
    print(f"reference: lightly MoCoProjectionHead + NTXentLoss(memory_bank_size=({args.queue_size}, {args.dim})) + "
          f"update_momentum in training_step, MoCoV2Transform(input_size=28, gaussian_blur=0) on PIL images in "
          f"DataLoader workers, {'channels_last' if args.ref_channels_last else 'NCHW (as lightly examples)'}, no shuffle BN")
    print(f"every run: {args.warmup} warm-up + {args.steps} timed steps, Trainer(logger={args.logger!r}, "
          "log_every_n_steps=10, no validation/checkpoints/progress bar)\n", flush=True)

    data = fashion_mnist("train", args.data_dir)
    workers = args.ref_workers[0]
    if len(args.ref_workers) > 1:
        print(f"reference worker trial ({args.warmup} warm-up + {args.trial_steps} timed steps each):")
        trial = {}
        for w in args.ref_workers:
            trial[w] = run_reference(args, data, w, args.warmup, args.trial_steps)
            print(f"  num_workers={w}: {trial[w]:7.1f} images/s", flush=True)
        workers = max(trial, key=trial.get)
        print(f"  -> the reference uses num_workers={workers}\n", flush=True)

    ours, ref = [], []
    for r in range(args.repeats):
        ours.append(run_ours(args, args.warmup, args.steps))
        print(f"  run {2 * r + 1}: ours      {ours[-1]:7.1f} images/s", flush=True)
        ref.append(run_reference(args, data, workers, args.warmup, args.steps))
        print(f"  run {2 * r + 2}: reference {ref[-1]:7.1f} images/s", flush=True)
    print()
    ratio = statistics.median(o / f for o, f in zip(ours, ref))
    rows = [
        ["moco-lightning (ours)", " ".join(f"{v:.1f}" for v in ours), f"{statistics.median(ours):.1f}",
         f"{args.batch_size / statistics.median(ours):.3f}"],
        [f"reference, lightly pattern (workers={workers})", " ".join(f"{v:.1f}" for v in ref), f"{statistics.median(ref):.1f}",
         f"{args.batch_size / statistics.median(ref):.3f}"],
    ]
    print_table(rows, ["system", "images/s per run", "median images/s", "s/step"])
    print(f"ours / reference = {ratio:.2f}x  (median of the {args.repeats} per-pair ratios; goal >= 1.2: "
          f"{'met' if ratio >= 1.2 else 'NOT met'})")
    footer(t0)


if __name__ == "__main__":
    main()
