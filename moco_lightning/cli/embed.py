"""``moco-lightning embed``: the command over :func:`moco_lightning.downstream.embed.embed_folder` (its module
docstring is the command's help)."""

from __future__ import annotations

from typing import Optional, Sequence

from moco_lightning.downstream import embed as computation
from moco_lightning.downstream.embed import embed_folder


def main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse

    from moco_lightning.cli.resume import BEST_LAST, named_checkpoint
    from moco_lightning.datamodules import BadImageError

    doc = (computation.__doc__ or "").split("\n\n")
    p = argparse.ArgumentParser(prog="moco-lightning embed", description=doc[0], epilog="\n\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--ckpt", required=True, help="a checkpoint of any method, an export (.pt), " + BEST_LAST)
    p.add_argument("--config", default=None, help="the run's fit config: where --ckpt best / last are")
    p.add_argument("--data", required=True, help="the folder of images (class folders, or images alone)")
    p.add_argument("--out", required=True, help="the folder for features.npy and index.csv")
    p.add_argument("--mean", type=float, nargs="+", default=None, help="normalisation (default ImageNet's)")
    p.add_argument("--std", type=float, nargs="+", default=None)
    p.add_argument("--resize", type=int, default=None, help="shorter side before the centre crop (size / 0.875)")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--num_workers", type=int, default=None, help="decoding processes (default: CPUs less one)")
    p.add_argument("--neighbours", type=int, default=None, metavar="K",
                   help="also write neighbours.png: a few images beside their K nearest neighbours")  # fmt: skip
    p.add_argument("--projector", action="store_true", help="also write TensorBoard's projector (with image sprites)")
    p.add_argument("--skip_bad_images", action="store_true",
                   help="embed a readable image of the same class in place of an unreadable file")  # fmt: skip
    args = p.parse_args(argv)
    try:
        args.ckpt = named_checkpoint(args.ckpt, args.config)
        features, index = embed_folder(args.ckpt, args.data, args.out, args.mean, args.std, args.resize,
                                       args.batch_size, args.num_workers, args.neighbours, args.projector,
                                       args.skip_bad_images)  # fmt: skip
    except (FileNotFoundError, ValueError) as e:
        p.exit(2, f"moco-lightning embed: error: {e}\n")
    except BadImageError as e:
        p.exit(2, f"moco-lightning embed: error: {e.for_option('--skip_bad_images')}\n")
    import numpy as np

    shape = np.load(features, mmap_mode="r").shape
    extra = (" neighbours.png" if args.neighbours else "") + (" projector/" if args.projector else "")
    print(
        f"wrote {features} ({shape[0]} images x {shape[1]} features, float32), {index}"
        + (f" and{extra}" if extra else "")
    )
