"""Programs for serving: the onnx (through onnxruntime), pt2 and torchscript exports give the features of
load_backbone's encoder within 1e-4 at another batch size than they were traced with, and carry the architecture and
the evaluation transform."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from helpers.trainers import cpu_trainer

from moco_lightning import MoCo, load_backbone
from moco_lightning.downstream.encoder import ARCHITECTURE_KEY, TRANSFORM_KEY
from moco_lightning.downstream.export import export_backbone

ARCHITECTURES = {
    "resnet": dict(backbone="resnet18", width=0.5, in_channels=1, stem="cifar_stride2", image_size=28),
    "vit": dict(backbone="timm:vit_tiny_patch16_224", image_size=32),
}


def run_program(fmt: str, path, x: torch.Tensor) -> tuple[np.ndarray, dict]:
    """The features a program computes for ``x``, and the descriptions it carries."""
    if fmt == "onnx":
        import onnx
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
        return session.run(["features"], {"images": x.numpy()})[0], props
    files = {f"{ARCHITECTURE_KEY}.json": "", f"{TRANSFORM_KEY}.json": ""}
    if fmt == "pt2":
        module = torch.export.load(str(path), extra_files=files).module()
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # PyTorch deprecates TorchScript; the format is asked for
            module = torch.jit.load(str(path), _extra_files=files)
    with torch.no_grad():
        return module(x).numpy(), {k[: -len(".json")]: v for k, v in files.items()}


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
@pytest.mark.parametrize("kind", ["resnet", "vit"])
@pytest.mark.parametrize("fmt", ["onnx", "pt2", "torchscript"])
def test_a_program_computes_the_encoders_features_at_any_batch_and_carries_its_description(tmp_path, seeded, fmt, kind):
    if kind == "vit":
        pytest.importorskip("timm")
    architecture = ARCHITECTURES[kind]
    trainer = cpu_trainer()
    trainer.strategy.connect(MoCo(queue_size=32, dim=8, hidden_dim=16, **architecture))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    export_backbone(tmp_path / "m.ckpt", tmp_path / "b.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        export_backbone(tmp_path / "m.ckpt", tmp_path / f"b.{fmt}", format=fmt)
    size, channels = architecture["image_size"], architecture.get("in_channels", 3)
    x = torch.randn(5, channels, size, size)  # traced with 2 images
    features, props = run_program(fmt, tmp_path / f"b.{fmt}", x)
    with torch.no_grad():
        expected = load_backbone(tmp_path / "b.pt").eval()(x).numpy()
    assert features.shape == expected.shape and np.abs(features - expected).max() < 1e-4
    assert json.loads(props[ARCHITECTURE_KEY])["backbone"] == architecture["backbone"]
    assert json.loads(props[ARCHITECTURE_KEY])["image_size"] == size
    if TRANSFORM_KEY in props and props[TRANSFORM_KEY]:  # recorded when the checkpoint saw a datamodule
        assert json.loads(props[TRANSFORM_KEY])["in_channels"] == channels


def test_a_backbone_torch_cannot_export_is_one_line_and_leaves_no_half_written_file(tmp_path, monkeypatch):
    from moco_lightning.errors import ConfigError

    trainer = cpu_trainer()
    trainer.strategy.connect(MoCo(queue_size=32, dim=8, hidden_dim=16, **ARCHITECTURES["resnet"]))
    trainer.save_checkpoint(tmp_path / "m.ckpt")

    def failing_save(program, path, **kwargs):
        open(path, "wb").write(b"half")  # the writer fails after it began the file
        raise RuntimeError("unsupported operator aten::foo\nmore lines")

    monkeypatch.setattr(torch.export, "save", failing_save)
    with pytest.raises(ConfigError, match=r"^--format pt2: torch could not export resnet18 \(unsupported operator "
                       r"aten::foo\); try --format onnx, torchscript"):  # fmt: skip
        export_backbone(tmp_path / "m.ckpt", tmp_path / "b.pt2", format="pt2")
    assert not (tmp_path / "b.pt2").exists()


def test_onnx_without_its_extra_says_what_to_install(tmp_path, monkeypatch):
    import sys

    from moco_lightning.errors import ConfigError

    trainer = cpu_trainer()
    trainer.strategy.connect(MoCo(queue_size=32, dim=8, hidden_dim=16, **ARCHITECTURES["resnet"]))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # not installed
    with pytest.raises(
        ConfigError, match=r"--format onnx needs onnx and onnxscript: pip install 'moco-lightning\[onnx\]'"
    ):
        export_backbone(tmp_path / "m.ckpt", tmp_path / "b.onnx", format="onnx")
    assert not (tmp_path / "b.onnx").exists()
