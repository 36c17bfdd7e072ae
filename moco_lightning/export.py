"""Hand-off: the pretrained backbone as a plain state dict, for torchvision and any downstream code.

    moco-lightning export --ckpt runs/quickstart/version_0/checkpoints/last.ckpt --out backbone.pt

    model = torchvision.models.resnet18()
    model.fc = torch.nn.Identity()                            # MoCo's backbone has no classifier
    model.load_state_dict(torch.load("backbone.pt"))         # strict: every key matches

(A backbone trained with ``cifar_stem``/``in_channels`` needs the same stem: build it with
``moco_lightning.backbones.build_backbone("resnet18", cifar_stem=True, in_channels=1)[0]``.)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch

from .errors import ConfigError, DataNotFoundError

PREFIX = {"query": "backbone.", "key": "key_backbone."}


def backbone_state_dict(ckpt_path: str | Path, encoder: Literal["query", "key"] = "query") -> dict[str, torch.Tensor]:
    """The query (default) or key encoder's backbone weights from a MoCo checkpoint, keys as in torchvision."""
    path = Path(ckpt_path)
    if not path.is_file():
        raise DataNotFoundError(f"checkpoint {path} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # not a torch file at all: UnpicklingError, RuntimeError (zip), EOFError (truncated)...
        raise ConfigError(
            f"{path} is not a checkpoint: torch.load cannot read it ({type(e).__name__}: {e}). Pass "
            "a .ckpt file written by `moco-lightning fit` (under <run>/checkpoints/)"
        ) from None
    if not isinstance(checkpoint, dict) or "moco_lightning" not in checkpoint or "state_dict" not in checkpoint:
        raise ConfigError(f"{path} is not a moco-lightning MoCo checkpoint (no 'moco_lightning' / 'state_dict' entry)")
    prefix = PREFIX[encoder]
    state = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    if not state:
        raise ConfigError(f"{path}: no '{prefix}*' weights in the checkpoint's state_dict")
    return state


def export_backbone(ckpt_path: str | Path, out_path: str | Path, encoder: Literal["query", "key"] = "query") -> Path:
    """Writes :func:`backbone_state_dict` to ``out_path`` with ``torch.save``; returns the path."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(backbone_state_dict(ckpt_path, encoder), out)
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="moco-lightning export", description="Write a MoCo checkpoint's backbone as a plain state dict."
    )
    parser.add_argument("--ckpt", required=True, help="MoCo checkpoint (.ckpt)")
    parser.add_argument("--out", required=True, help="where to write the state dict (.pt)")
    parser.add_argument("--encoder", choices=("query", "key"), default="query", help="which encoder (default: query)")
    args = parser.parse_args(argv)
    try:
        out = export_backbone(args.ckpt, args.out, args.encoder)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"moco-lightning export: error: {e}\n")
    print(f"wrote {out} ({len(torch.load(out))} tensors, {args.encoder} encoder backbone)")
