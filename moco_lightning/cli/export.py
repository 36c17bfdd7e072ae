"""``moco-lightning export``: a checkpoint's backbone for torchvision, detection or serving
(:func:`moco_lightning.downstream.export.export_backbone` does the work)."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from moco_lightning.cli.resume import BEST_LAST, named_checkpoint
from moco_lightning.downstream.detection import detection_weights, detectron2_settings
from moco_lightning.downstream.encoder import architecture_in, transform_in
from moco_lightning.downstream.export import FORMATS, backbone_state_dict, export_backbone, stem_note
from moco_lightning.training.checkpoint_io import read_checkpoint


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="moco-lightning export", description="Write a checkpoint's backbone for torchvision, detection or serving."
    )
    parser.add_argument("--ckpt", required=True, help="checkpoint of any pretraining method (.ckpt), " + BEST_LAST)
    parser.add_argument("--config", default=None, help="the run's fit config: where --ckpt best / last are")
    parser.add_argument("--out", required=True, help="the file to write (.pt, .pkl for detectron2, .onnx, .pt2)")
    parser.add_argument(
        "--encoder", choices=("query", "key"), default="query", help="query encoder (default) or its momentum copy"
    )
    parser.add_argument("--format", choices=FORMATS, default="torchvision",
                        help="torchvision (a state dict, default), detectron2 (MODEL.WEIGHTS), torchvision-detection "
                             "(a ResNet-FPN body), onnx, pt2 (torch.export), torchscript")  # fmt: skip
    parser.add_argument("--matching_heuristics", action=argparse.BooleanOptionalAction, default=True,
                        help="detectron2's flag in the file (the official converter sets it)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        args.ckpt = named_checkpoint(args.ckpt, args.config)
        out = export_backbone(args.ckpt, args.out, args.encoder, args.format, args.matching_heuristics)
        # what was written, read back: a state dict as an export, a program through the checkpoint it came from
        state = (read_checkpoint(out, expect="export") if args.format in ("torchvision", "torchvision-detection")
                 else backbone_state_dict(args.ckpt, args.encoder))  # fmt: skip
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"moco-lightning export: error: {e}\n")
    arch = architecture_in(state) or {}
    what = ", ".join(f"{k} {v}" for k, v in arch.items()) or "architecture not recorded: a backbone module of your own"
    count = f"{len(detection_weights(state))} tensors, " if args.format == "detectron2" else ""
    count = f"{len(state)} tensors, " if args.format in ("torchvision", "torchvision-detection") else count
    print(f"wrote {out} ({args.format}: {count}{args.encoder} encoder backbone; {what})")
    if args.format == "detectron2":
        transform = transform_in(state)
        print("detectron2 settings for this backbone:\n  " + "\n  ".join(detectron2_settings(arch, transform)))
    elif args.format == "torchvision" and arch and stem_note(arch):
        print(stem_note(arch))
