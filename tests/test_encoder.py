"""One encoder loader for linear evaluation, evaluate and export: a checkpoint and its export give the same weights,
from scratch the same architecture with other weights, and every wrong file is one line naming it."""

from __future__ import annotations

import pytest
import torch
from helpers.data import FIXTURE_CKPT
from helpers.models import tiny_backbone

from moco_lightning.downstream.encoder import load_encoder
from moco_lightning.downstream.encoder_choice import choose_encoder, load_weights
from moco_lightning.downstream.export import export_backbone
from moco_lightning.errors import ConfigError


def test_a_checkpoint_and_its_export_give_the_same_encoder_and_scratch_other_weights(tmp_path):
    from_ckpt, dim = load_encoder(FIXTURE_CKPT)
    export_backbone(FIXTURE_CKPT, tmp_path / "b.pt")
    from_export, dim2 = load_encoder(tmp_path / "b.pt", expect="export")
    saved = torch.load(FIXTURE_CKPT, weights_only=True)["state_dict"]
    assert dim == dim2
    for name, value in from_ckpt.state_dict().items():
        assert torch.equal(value, saved[f"backbone.{name}"]) and torch.equal(value, from_export.state_dict()[name])
    scratch, _ = load_encoder(FIXTURE_CKPT, weights=False)
    assert scratch.state_dict().keys() == from_ckpt.state_dict().keys()
    assert not torch.equal(scratch.state_dict()["conv1.weight"], from_ckpt.state_dict()["conv1.weight"])
    with pytest.raises(ConfigError, match=r"--ckpt .*MoCo.ckpt: not an exported backbone.*export it first"):
        load_encoder(FIXTURE_CKPT, expect="export", arg="--ckpt")


def test_a_module_of_ones_own_takes_the_files_weights_and_a_nameless_checkpoint_says_what_to_do(tmp_path, seeded):
    from helpers.data import tiny_data
    from helpers.models import tiny_moco
    from helpers.trainers import cpu_trainer

    model = tiny_moco()
    trainer = cpu_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(model, tiny_data())
    trainer.save_checkpoint(tmp_path / "own.ckpt")
    with pytest.raises(ConfigError, match="does not name its backbone .* pass that module as `backbone`"):
        load_encoder(tmp_path / "own.ckpt")
    mine = tiny_backbone()
    load_weights(mine, tmp_path / "own.ckpt")
    for name, value in mine.state_dict().items():
        assert torch.equal(value, model.backbone.state_dict()[name])
    chosen, dim, _ = choose_encoder(tiny_backbone(), str(tmp_path / "own.ckpt"), "model.ckpt_path", True, 16)
    assert dim == 16 and torch.equal(chosen.state_dict()["0.weight"], model.backbone.state_dict()["0.weight"])
    with pytest.raises(ConfigError, match="LinearClassifier needs a backbone"):
        choose_encoder(None, None, "model.ckpt_path", True, None)


def test_a_checkpoint_and_its_export_record_the_evaluation_transform(tmp_path, seeded):
    """Features of new images are taken as in training: the datamodule's mean, std, size and channels ride in the
    checkpoint and in the export, and load_transform rebuilds them; an older file says what it assumes."""
    from helpers.data import tiny_data
    from helpers.trainers import cpu_trainer
    from PIL import Image

    from moco_lightning import MoCo, load_transform
    from moco_lightning.datamodules import FashionMNISTDataModule

    model = MoCo(backbone="resnet18", width=0.0625, in_channels=1, image_size=28, stem="cifar", hidden_dim=16, dim=8,
                 queue_size=32, bn_splits=2)  # fmt: skip
    trainer = cpu_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(model, tiny_data())
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    recorded = torch.load(tmp_path / "run.ckpt", weights_only=True)["moco_lightning"]["eval_transform"]
    fm = FashionMNISTDataModule
    assert recorded == dict(mean=list(fm.mean), std=list(fm.std), image_size=28, in_channels=1, resize=28)
    export_backbone(tmp_path / "run.ckpt", tmp_path / "b.pt")
    image = Image.fromarray((torch.rand(40, 30, 3) * 255).byte().numpy())  # an RGB photo of another size
    from_ckpt, from_export = load_transform(tmp_path / "run.ckpt")(image), load_transform(tmp_path / "b.pt")(image)
    assert from_ckpt.shape == (1, 28, 28) and torch.equal(from_ckpt, from_export)
    from torchvision import transforms as T

    # grayscale, the shorter side resized to 28, the centre cropped, normalised with the recorded values
    expected = T.Compose([T.Resize(28), T.CenterCrop(28), T.ToTensor(), T.Normalize(fm.mean, fm.std)])
    assert torch.equal(from_ckpt, expected(image.convert("L")))
    with pytest.warns(UserWarning, match="does not record its evaluation transform: ImageNet's mean and std"):
        assert load_transform(FIXTURE_CKPT)(image).shape == (1, 28, 28)


def test_weights_loaded_into_another_stem_are_refused_and_into_the_same_architecture_accepted(tmp_path, capsys):
    """The issue's case: an export of timm's resnet10t with the cifar_stride2 stem loads strictly into a plain
    timm.create_model (same shapes, its max-pool kept) and computes other features; it is refused in one line, while
    a stock torchvision ResNet (fc removed) takes a stock export without a word."""
    timm = pytest.importorskip("timm")
    from helpers.trainers import cpu_trainer
    from torch import nn
    from torchvision.models import resnet18

    from moco_lightning import MoCo
    from moco_lightning.cli.export import main
    from moco_lightning.modules.backbones import build_backbone

    def export(name, **architecture):
        trainer = cpu_trainer()
        trainer.strategy.connect(MoCo(queue_size=32, dim=8, hidden_dim=16, image_size=32, **architecture))
        trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
        main(["--ckpt", str(tmp_path / f"{name}.ckpt"), "--out", str(tmp_path / f"{name}.pt")])
        return tmp_path / f"{name}.pt"

    small = export("small", backbone="timm:resnet10t", stem="cifar_stride2")
    assert (
        "note: stem 'cifar_stride2' (no max-pool): a plain timm:resnet10t keeps its max-pool" in capsys.readouterr().out
    )
    plain = timm.create_model("resnet10t", pretrained=False, num_classes=0)
    with pytest.raises(ConfigError, match=r"model.backbone_state_dict .*small.pt: your backbone module loads these "
                       r"weights but computes other features \(cosine 0\.\d\d to .*stem cifar_stride2"):  # fmt: skip
        load_weights(plain, small, arg="model.backbone_state_dict")
    same = build_backbone("timm:resnet10t", stem="cifar_stride2", image_size=32)[0].train()
    load_weights(same, small)
    assert same.training and all(m.training for m in same.modules())  # its modes as they were
    stock = export("stock", backbone="resnet18")
    assert "note:" not in capsys.readouterr().out
    mine = resnet18()
    mine.fc = nn.Identity()
    load_weights(mine, stock)
    assert torch.equal(mine.conv1.weight, torch.load(stock)["conv1.weight"])
