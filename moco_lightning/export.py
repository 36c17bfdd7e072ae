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
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import torch
from torch import nn

from .backbones import is_backbone_spec
from .checkpoint_io import read_checkpoint
from .compat import format2_momentum_copy
from .errors import ConfigError

ARCHITECTURE = ("backbone", "cifar_stem", "in_channels", "image_size", "width", "stem")  # build_backbone's arguments


def backbone_state_dict(ckpt_path: str | Path, encoder: Literal["query", "key"] = "query") -> dict[str, torch.Tensor]:
    """The query (default) or key encoder's backbone weights from a checkpoint, keys as in torchvision."""
    return checkpoint_backbone(read_checkpoint(ckpt_path, arg="--ckpt"), ckpt_path, encoder)


def momentum_backbone(checkpoint: dict) -> Optional[str]:
    """The state-dict name of the backbone's momentum copy (MoCo's key encoder, BYOL's target), or None."""
    copies = (checkpoint.get("moco_lightning") or {}).get("momentum_copies")
    if copies is not None:
        return copies.get("backbone")
    return format2_momentum_copy(checkpoint["state_dict"])


def checkpoint_backbone(
    checkpoint: Any, path: str | Path, encoder: Literal["query", "key"] = "query"
) -> dict[str, torch.Tensor]:
    """:func:`backbone_state_dict` of a checkpoint already read from ``path`` (named in the errors)."""
    if not isinstance(checkpoint, dict) or "moco_lightning" not in checkpoint or "state_dict" not in checkpoint:
        raise ConfigError(
            f"{path} is not a checkpoint of moco-lightning pretraining (no 'moco_lightning' / 'state_dict' entry)"
        )
    name = "backbone" if encoder == "query" else momentum_backbone(checkpoint)
    if name is None:
        raise ConfigError(
            f"{path}: this method has no momentum encoder (no key encoder or target network): export the query "
            "encoder (--encoder query)"
        )
    prefix = name + "."
    state = OrderedDict((k[len(prefix) :], v) for k, v in checkpoint["state_dict"].items() if k.startswith(prefix))
    if not state:
        raise ConfigError(f"{path}: no {prefix}* weights in its state_dict")
    architecture = describe(checkpoint.get("hyper_parameters") or {})
    if architecture is not None:
        state._metadata = OrderedDict({DESCRIPTION: architecture})  # type: ignore[attr-defined]
    return state


DESCRIPTION = "moco_lightning"  # the key of the architecture in an export's _metadata


def describe(hparams: dict) -> Optional[dict]:
    """The architecture a checkpoint's hyper-parameters name: a backbone name, or the ``{class_path, init_args}``
    spec of a module the CLI built (None for a backbone module of the user's own)."""
    backbone = hparams.get("backbone")
    if not isinstance(backbone, str) and not is_backbone_spec(backbone):
        return None
    return {k: hparams[k] for k in ARCHITECTURE if k in hparams}


def description(state: Any) -> Optional[dict]:
    """The architecture an exported state dict describes, or None."""
    return (getattr(state, "_metadata", None) or {}).get(DESCRIPTION)


def load_backbone(path: str | Path) -> nn.Module:
    """The backbone exported to ``path`` (``moco-lightning export``), rebuilt from the file's own description and
    loaded strictly; in train mode, as a freshly built module (call ``.eval()`` to extract features)."""
    return load_export(path)[0]


def load_export(path: str | Path) -> tuple[nn.Module, int]:
    """``(backbone, feature_dim)`` of an exported file; one-line errors naming the file."""
    return rebuild_export(read_checkpoint(path, expect="export"), path)


def rebuild_export(state: Any, path: str | Path) -> tuple[nn.Module, int]:
    """``(backbone, feature_dim)`` of an exported state dict already read from ``path`` (named in the errors)."""
    from .backbones import build_backbone

    architecture = description(state) if isinstance(state, dict) else None
    if architecture is None:
        raise ConfigError(
            f"{path} does not say which backbone it holds (exported by an older moco-lightning, or not by its export):"
            " build the architecture yourself and load_state_dict this file into it, or export again"
        )
    model, dim = build_backbone(**architecture)
    model.load_state_dict(state, strict=True)
    return model, dim


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
    arch = description(written) or {}
    what = ", ".join(f"{k} {v}" for k, v in arch.items()) or "architecture not recorded: a backbone module of your own"
    print(f"wrote {out} ({len(written)} tensors, {args.encoder} encoder backbone; {what})")
