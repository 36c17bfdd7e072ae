"""A stand-in for weights a user already has: a supervised encoder trained on every training label, written as a
plain torchvision state dict (no moco-lightning description in it), for ``moco-lightning evaluate --baseline``.

    python -m benchmarks.supervised_baseline --config quickstart --epochs 2 --out runs/supervised_r18.pt
    moco-lightning evaluate --ckpt X.ckpt --baseline runs/supervised_r18.pt --baseline_arch resnet18,stem=cifar_stride2

The architecture is the config's model (the pretrained encoder's own); the recipe is ``evaluate``'s training from
scratch (SGD lr 0.05, momentum 0.9, weight decay 5e-4, cosine, batches of 64 with flips) on Fashion-MNIST's training
split (``--train-subset``: its first N images), for ``--epochs`` epochs; its test accuracy is printed.
"""

from __future__ import annotations

import time

import torch
import yaml

from benchmarks._common import config_path, footer, header, parser, quiet


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--config", default="quickstart", help="the config whose model's architecture is trained")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--train-subset", type=int, default=None, help="smoke runs: the first N training images")
    p.add_argument("--test-subset", type=int, default=None, help="smoke runs: the first N test images")
    p.add_argument("--out", required=True, help="the state dict to write (.pt)")
    args = p.parse_args(argv)
    quiet()
    t0 = time.perf_counter()
    header("A supervised stand-in for the weights a user has", args)
    from lightning.pytorch import Trainer, seed_everything

    from moco_lightning.datamodules import FashionMNISTDataModule
    from moco_lightning.downstream.evaluate import FINETUNE
    from moco_lightning.downstream.linear_eval import LinearClassifier

    seed_everything(args.seed, verbose=False)
    model = yaml.safe_load(config_path(args.config).read_text())["model"]
    model = model.get("init_args", model)
    architecture = {k: model[k] for k in ("backbone", "width", "stem", "in_channels", "image_size") if k in model}
    data = FashionMNISTDataModule(pretrain=False, supervised_min_scale=1.0, batch_size=64, seed=args.seed,
                                  train_subset=args.train_subset, val_subset=args.test_subset)  # fmt: skip
    classifier = LinearClassifier(**architecture, from_scratch=True, **dict(FINETUNE, backbone_lr=None))
    trainer = Trainer(accelerator="cpu", max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      check_val_every_n_epoch=10**6)  # fmt: skip
    trainer.fit(classifier, datamodule=data)
    top1 = trainer.validate(classifier, datamodule=data, verbose=False)[0]["val/acc1"]
    torch.save(dict(classifier.backbone.state_dict()), args.out)  # a plain dict: what a download would be
    print(f"{architecture}: {trainer.global_step} steps, test top-1 {100 * top1:.2f} %; wrote {args.out}")
    footer(t0)


if __name__ == "__main__":
    main()
