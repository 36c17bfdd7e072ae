"""Every Python block of the README runs as written: extracted and executed in order (as doctests are), with
Lightning's Trainer and the Fashion-MNIST datamodule shrunk to two steps on 64 images, and the exported file the
export section loads written beforehand from the quickstart's own model settings."""

import re
from pathlib import Path

import pytest
import torch
import yaml
from helpers.trainers import CPU_TRAINER, cpu_trainer
from lightning.pytorch import Trainer

import moco_lightning.datamodules as datamodules
from moco_lightning import MoCo
from moco_lightning.export import export_backbone

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


class TinyTrainer(Trainer):
    """The Trainer a README block builds, at two steps on the CPU without logs or checkpoints."""

    def __init__(self, **kwargs):
        super().__init__(**{**kwargs, **CPU_TRAINER, "max_steps": 2, "limit_val_batches": 1})


class TinyFashionMNIST(datamodules.FashionMNISTDataModule):
    def __init__(self, **kwargs):
        kwargs.update(batch_size=32, train_subset=64, val_subset=32)
        super().__init__(**kwargs)


@pytest.fixture
def readme_world(tmp_path, monkeypatch, seeded):
    import lightning.pytorch

    monkeypatch.setattr(lightning.pytorch, "Trainer", TinyTrainer)
    monkeypatch.setattr(datamodules, "FashionMNISTDataModule", TinyFashionMNIST)
    monkeypatch.chdir(tmp_path)
    # backbone.pt, as `moco-lightning export` writes it for the quickstart's model (untrained: loading is tested)
    settings = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())["model"]
    trainer = cpu_trainer()
    trainer.strategy.connect(MoCo(**settings))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    export_backbone(tmp_path / "last.ckpt", tmp_path / "backbone.pt")
    return tmp_path


def test_the_readme_has_the_blocks_this_test_checks():
    assert len(BLOCKS) == 3, [b.splitlines()[0] for b in BLOCKS]


@pytest.mark.parametrize("number", range(len(BLOCKS)))
def test_each_readme_python_block_runs_as_written(readme_world, number):
    names: dict = {}
    exec(compile(BLOCKS[number], f"README.md python block {number + 1}", "exec"), names)
    if "features" in names:  # the drop-in block: features of a batch of evaluation images
        assert names["features"].shape == (32, 512) and torch.isfinite(names["features"]).all()
    if "trainer" in names:  # the callbacks block: both monitors logged
        assert {"val/knn_acc1", "val/probe_acc1"} <= set(names["trainer"].callback_metrics)
    module = names.get("backbone", names.get("model")) if number >= 2 else None
    if module is not None:  # the export blocks: the quickstart's narrow grayscale ResNet-18, its weights
        assert module.conv1.in_channels == 1 and module.layer4[0].conv1.out_channels == 256
        saved = torch.load(readme_world / "backbone.pt")
        assert all(torch.equal(v, saved[k]) for k, v in module.state_dict().items())
