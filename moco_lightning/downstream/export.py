"""Hand-off: the pretrained backbone for torchvision, detection, serving and any downstream code.

    moco-lightning export --ckpt runs/quickstart/version_0/checkpoints/last.ckpt --out backbone.pt

    backbone, transform = moco_lightning.load_backbone("backbone.pt", with_transform=True)

``--format torchvision`` (the default) writes a torchvision-style state dict (``torch.load`` it and ``load_state_dict``
it strictly into the same architecture) that also says what it holds: the backbone's name, ``width``,
``in_channels``, ``stem`` and ``image_size``, and the evaluation transform of pretraining, ride in the state dict's
``_metadata`` (where ``state_dict()`` keeps its version numbers, ignored by ``load_state_dict``), so
:func:`load_backbone` rebuilds the architecture without the settings it was trained with. ``detectron2`` and
``torchvision-detection`` hand a ResNet to detection (:mod:`moco_lightning.downstream.detection`); ``onnx``, ``pt2`` and
``torchscript`` write a program that runs without this library (:mod:`moco_lightning.downstream.deployment`). Any
method's
checkpoint (MoCo, MoCo v3, SimCLR, BYOL, SwAV) exports its ``backbone``; ``--encoder key``: MoCo's key encoder or
BYOL's target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from torch import nn

from moco_lightning.downstream.deployment import FORMATS as PROGRAMS
from moco_lightning.downstream.deployment import write_program
from moco_lightning.downstream.detection import (
    check_detection_backbone,
    detection_weights,
    write_detectron2,
)
from moco_lightning.downstream.encoder import (
    Encoder,
    architecture_in,
    checkpoint_backbone,
    encoder_from,
    transform_in,
)
from moco_lightning.errors import ConfigError
from moco_lightning.training.checkpoint_io import read_checkpoint

FORMATS = ("torchvision", "detectron2", "torchvision-detection", *PROGRAMS)


def backbone_state_dict(ckpt_path: str | Path, encoder: Literal["query", "key"] = "query") -> dict[str, torch.Tensor]:
    """The query (default) or key encoder's backbone weights from a checkpoint, keys as in torchvision."""
    return checkpoint_backbone(read_checkpoint(ckpt_path, arg="--ckpt"), ckpt_path, encoder)


def load_backbone(path: str | Path, with_transform: bool = False) -> nn.Module | tuple[nn.Module, Callable]:
    """The backbone exported to ``path`` (``moco-lightning export``), rebuilt from the file's own description and
    loaded strictly; in train mode, as a freshly built module (call ``.eval()`` to extract features).
    ``with_transform``: ``(backbone, transform)``, the transform from any PIL image to the tensor the backbone takes,
    as recorded at pretraining (:func:`moco_lightning.load_transform`), as torchvision's ``weights.transforms()``."""
    encoder = Encoder.read(path, expect="export", arg="")
    backbone = encoder.build()[0]
    return (backbone, encoder.transform()) if with_transform else backbone


def export_backbone(
    ckpt_path: str | Path,
    out_path: str | Path,
    encoder: Literal["query", "key"] = "query",
    format: str = "torchvision",
    matching_heuristics: bool = True,
) -> Path:
    """Writes the backbone of ``ckpt_path`` to ``out_path`` as ``format`` (one of :data:`FORMATS`); returns the path.
    ``matching_heuristics``: detectron2's flag, as the official converter sets it."""
    out = Path(out_path)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory: give a file name, e.g. {out / 'backbone.pt'}")
    if out.exists() and not out.is_file():
        raise ConfigError(f"--out {out} is not a regular file (a device or a pipe): give a file name")
    if format not in FORMATS:
        raise ConfigError(f"--format {format!r}: one of {', '.join(FORMATS)}")
    state = backbone_state_dict(ckpt_path, encoder)
    architecture = architecture_in(state)
    if format != "torchvision" and architecture is None:
        raise ConfigError(f"--format {format}: {ckpt_path} does not name its backbone (a module of your own); "
                          "only --format torchvision can write it")  # fmt: skip
    if format in ("detectron2", "torchvision-detection"):
        check_detection_backbone(architecture, format)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if format == "torchvision":
            torch.save(state, out)
        elif format == "detectron2":
            write_detectron2(state, out, matching_heuristics)
        elif format == "torchvision-detection":
            body = detection_weights(state)
            body._metadata = state._metadata  # type: ignore[attr-defined]
            torch.save(body, out)
        else:
            write_program_of(state, architecture, format, out)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e}): choose a writable path") from None
    except RuntimeError as e:  # torch's zip writer reports an unwritable path as a RuntimeError
        raise ConfigError(f"--out {out}: cannot write there ({str(e).split(':')[-1].strip()})") from None
    return out


def write_program_of(state: Any, architecture: dict, fmt: str, out: Path) -> None:
    """:func:`~moco_lightning.downstream.deployment.write_program` of a backbone state; a backbone torch cannot trace
    or export is one line naming the format (and no half-written file is left)."""
    backbone = encoder_from(state, architecture)[0]
    try:
        write_program(backbone, architecture, transform_in(state), fmt, out)
    except ConfigError:
        raise
    except Exception as e:  # torch.export / the ONNX exporter / the tracer: many exception types, one meaning
        out.unlink(missing_ok=True)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        others = ", ".join(f for f in PROGRAMS if f != fmt)
        raise ConfigError(f"--format {fmt}: torch could not export {architecture.get('backbone')} ({first}); "
                          f"try --format {others}, or torchvision and your own serving code") from None  # fmt: skip


def stem_note(architecture: dict) -> Optional[str]:
    """A line for an export whose stem differs from the stock model's of the same name, or None."""
    stem = architecture.get("stem") or ("cifar" if architecture.get("cifar_stem") else "imagenet")
    if stem == "imagenet":
        return None
    return (
        f"note: stem {stem!r} (no max-pool): a plain {architecture['backbone']} keeps its max-pool and computes other "
        "features from these weights; rebuild it with moco_lightning.load_backbone(file)"
    )
