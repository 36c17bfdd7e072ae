"""A pretrained encoder as a self-contained program, for serving without this library (``moco-lightning export
--format ...``): images ``(N, C, H, W)`` in, features ``(N, D)`` out, any batch size N, in eval mode (BatchNorm's
running statistics).

- ``onnx``: torch's ``torch.export``-based ONNX exporter (extra ``[onnx]``: onnx, onnxscript, and onnxruntime to run
  it); input ``images``, output ``features``; ``onnxruntime.InferenceSession(path).run(None, {"images": x})``.
- ``pt2``: ``torch.export``'s program (``torch.export.load(path).module()(x)``), the successor of TorchScript.
- ``torchscript``: ``torch.jit.trace``'s module (``torch.jit.load(path)(x)``), for libtorch; PyTorch deprecates
  TorchScript since 2.10 and warns so.

Each carries the architecture and the evaluation transform as JSON
(:data:`moco_lightning.downstream.encoder.ARCHITECTURE_KEY`,
:data:`~moco_lightning.downstream.encoder.TRANSFORM_KEY`): ONNX in the model's ``metadata_props``, ``pt2`` and
``torchscript`` as the extra files ``moco_lightning.json`` and ``moco_lightning_transform.json``, so the image size,
channels, mean and std travel with the program.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from moco_lightning.downstream.encoder import ARCHITECTURE_KEY, TRANSFORM_KEY
from moco_lightning.errors import ConfigError

FORMATS = ("onnx", "pt2", "torchscript")


def example_images(architecture: dict, batch: int = 2) -> torch.Tensor:
    """A batch of images of the encoder's size and channels, to trace it with."""
    size = architecture.get("image_size", 224)
    return torch.randn(
        batch, architecture.get("in_channels", 3), size, size, generator=torch.Generator().manual_seed(0)
    )


def descriptions(architecture: dict, transform: Optional[dict]) -> dict[str, str]:
    """The JSON texts a program carries: its architecture and, when recorded, its evaluation transform."""
    texts = {ARCHITECTURE_KEY: json.dumps(architecture)}
    if transform:
        texts[TRANSFORM_KEY] = json.dumps(transform)
    return texts


def write_program(backbone: nn.Module, architecture: dict, transform: Optional[dict], fmt: str, out: Path) -> None:
    """Writes ``backbone`` (in eval mode) as ``fmt`` (one of :data:`FORMATS`) to ``out``."""
    backbone = backbone.eval()
    x = example_images(architecture)
    texts = descriptions(architecture, transform)
    batch = {0: torch.export.Dim("batch", min=1)}
    if fmt == "onnx":
        try:
            import onnx  # noqa: F401
            import onnxscript  # noqa: F401 - torch's exporter needs it
        except ImportError:
            raise ConfigError("--format onnx needs onnx and onnxscript: pip install 'moco-lightning[onnx]'") from None
        program = torch.onnx.export(backbone, (x,), input_names=["images"], output_names=["features"],
                                    dynamic_shapes=(batch,), dynamo=True, verbose=False)  # fmt: skip
        program.model.metadata_props.update(texts)
        program.save(str(out))
    elif fmt == "pt2":
        program = torch.export.export(backbone, (x,), dynamic_shapes=(batch,))
        torch.export.save(program, str(out), extra_files={f"{k}.json": v for k, v in texts.items()})
    elif fmt == "torchscript":
        with torch.no_grad():
            traced = torch.jit.trace(backbone, x)
        torch.jit.save(traced, str(out), _extra_files={f"{k}.json": v for k, v in texts.items()})
    else:
        raise ConfigError(f"--format {fmt}: not a program format; one of {', '.join(FORMATS)}")
