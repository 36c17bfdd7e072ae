"""Hand-off: the pretrained backbone as a plain state dict, for torchvision and any downstream code.

    moco-lightning export --ckpt runs/quickstart/version_0/checkpoints/last.ckpt --out backbone.pt

    backbone = moco_lightning.load_backbone("backbone.pt")   # rebuilt from the file's own description

The file is a torchvision-style state dict (``torch.load`` it and ``load_state_dict`` it strictly into the same
architecture) that also says what it holds: the backbone's name, ``width``, ``in_channels``, ``stem`` and
``image_size`` ride in the state dict's ``_metadata`` (where ``state_dict()`` keeps its version numbers, ignored by
``load_state_dict``), so :func:`load_backbone` rebuilds the architecture without the settings it was trained with.
Any method's checkpoint (MoCo, MoCo v3, SimCLR, BYOL, SwAV) exports its ``backbone``; ``--encoder key``: MoCo's key
encoder or BYOL's target.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch
from torch import nn

from .checkpoint_io import read_checkpoint
from .encoder import architecture_in, checkpoint_backbone, load_encoder
from .errors import ConfigError


def backbone_state_dict(ckpt_path: str | Path, encoder: Literal["query", "key"] = "query") -> dict[str, torch.Tensor]:
    """The query (default) or key encoder's backbone weights from a checkpoint, keys as in torchvision."""
    return checkpoint_backbone(read_checkpoint(ckpt_path, arg="--ckpt"), ckpt_path, encoder)


def load_backbone(path: str | Path) -> nn.Module:
    """The backbone exported to ``path`` (``moco-lightning export``), rebuilt from the file's own description and
    loaded strictly; in train mode, as a freshly built module (call ``.eval()`` to extract features)."""
    return load_encoder(path, expect="export", arg="")[0]


def export_backbone(ckpt_path: str | Path, out_path: str | Path, encoder: Literal["query", "key"] = "query") -> Path:
    """Writes :func:`backbone_state_dict` to ``out_path`` with ``torch.save``; returns the path."""
    out = Path(out_path)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory: give a file name, e.g. {out / 'backbone.pt'}")
    if out.exists() and not out.is_file():
        raise ConfigError(f"--out {out} is not a regular file (a device or a pipe): give a file name")
    state = backbone_state_dict(ckpt_path, encoder)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, out)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e}): choose a writable path") from None
    except RuntimeError as e:  # torch's zip writer reports an unwritable path as a RuntimeError
        raise ConfigError(f"--out {out}: cannot write there ({str(e).split(':')[-1].strip()})") from None
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="moco-lightning export", description="Write a checkpoint's backbone as a plain state dict."
    )
    parser.add_argument("--ckpt", required=True, help="checkpoint of any pretraining method (.ckpt)")
    parser.add_argument("--out", required=True, help="where to write the state dict (.pt)")
    parser.add_argument(
        "--encoder", choices=("query", "key"), default="query", help="query encoder (default) or its momentum copy"
    )
    args = parser.parse_args(argv)
    try:
        out = export_backbone(args.ckpt, args.out, args.encoder)
        written = read_checkpoint(out, expect="export")  # the file reads back as an export
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"moco-lightning export: error: {e}\n")
    arch = architecture_in(written) or {}
    what = ", ".join(f"{k} {v}" for k, v in arch.items()) or "architecture not recorded: a backbone module of your own"
    print(f"wrote {out} ({len(written)} tensors, {args.encoder} encoder backbone; {what})")
