"""Offline linear evaluation: frozen backbone in eval mode through validation cycles, separable data learned,
backbones loaded from MoCo checkpoints, and the command line with configs/linear_eval.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from moco_lightning.linear_eval import LinearClassifier, main

from callback_toys import trainer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "linear_eval.yaml"


class Separable(LightningDataModule):
    """3 classes of 8-d vectors around 3·e_c (noise 0.3): linearly separable. Batches (x, y, index)."""

    num_classes = 3

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        y = torch.arange(240) % 3
        x = 3.0 * nn.functional.one_hot(y, 8).float() + 0.3 * torch.randn(240, 8, generator=g)
        self.train = TensorDataset(x[:180], y[:180], torch.arange(180))
        self.val = TensorDataset(x[180:], y[180:], torch.arange(60))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=20, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=20)


class Recording(LinearClassifier):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.modes: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.modes.append(self.backbone.training or any(m.training for m in self.backbone.modules()))
        return super().training_step(batch, batch_idx)


def frozen_backbone() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    net[1].running_mean.fill_(0.5)  # statistics a train-mode forward would visibly change
    net[1].running_var.fill_(2.0)
    return net


class TrainModeAfterValidation(Callback):
    """What Lightning 1.x did when training resumed after validation (and what a mode restore captured in
    train mode would do): flag every submodule as training, bypassing ``train()``, before the next batch."""

    def __init__(self) -> None:
        self.validated = False

    def on_validation_end(self, trainer, pl_module):
        self.validated = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # runs before the module's hook
        if self.validated:
            self.validated = False
            for m in pl_module.modules():
                m.training = True


def test_frozen_eval_backbone_through_validation_and_separable_accuracy(seeded):
    backbone = frozen_backbone()
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    model = Recording(backbone=backbone, feature_dim=8)  # the protocol's defaults: SGD lr 30, momentum 0.9
    assert model.head is None  # num_classes comes from the datamodule in setup
    # validation twice per epoch, each followed by a blanket switch to train mode: training resumes after each
    t = trainer(max_epochs=4, val_check_interval=0.5, callbacks=[TrainModeAfterValidation()])
    t.fit(model, datamodule=Separable())

    assert len(model.modes) == 4 * 9 and not any(model.modes)  # eval mode on every single training batch
    after = model.backbone.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and BN statistics unchanged
    assert not any(p.requires_grad for p in model.backbone.parameters())
    assert model.head.out_features == 3 and model.hparams.num_classes == 3
    assert float(t.callback_metrics["val/acc1"]) >= 0.99
    assert float(t.callback_metrics["val/acc5"]) == 1.0  # 3 classes: top-5 is everything
    assert float(t.callback_metrics["train/acc1"]) >= 0.95
    assert "val/loss" in t.callback_metrics
    model.train()  # whatever switches the module to train mode, the backbone stays in eval mode
    assert model.training and not model.backbone.training


def test_protocol_schedule():
    model = LinearClassifier(backbone=frozen_backbone(), feature_dim=8, num_classes=3)
    t = trainer(max_epochs=100)
    t.strategy.connect(model)
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert opt.defaults["lr"] == 30.0 and opt.defaults["momentum"] == 0.9 and opt.defaults["weight_decay"] == 0.0
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[59] == 30.0 and lrs[60] == pytest.approx(3.0) and lrs[80] == pytest.approx(0.3)
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.head.parameters())


def _moco_checkpoint(tmp_path: Path, **kwargs) -> tuple[Path, nn.Module]:
    from conftest import cpu_trainer, tiny_data, tiny_moco

    moco = tiny_moco(**kwargs)
    t = cpu_trainer(max_steps=1, limit_val_batches=0)
    t.fit(moco, datamodule=tiny_data(batch_size=8, train_subset=16, val_subset=8))
    path = tmp_path / "moco.ckpt"
    t.save_checkpoint(path)
    return path, moco


def test_backbone_from_a_moco_checkpoint_with_a_module_backbone(seeded, tmp_path):
    from conftest import tiny_backbone

    path, moco = _moco_checkpoint(tmp_path)
    model = LinearClassifier(
        ckpt_path=str(path), backbone=tiny_backbone(), num_classes=10, in_channels=1, image_size=28
    )
    assert model.feature_dim == 16
    trained = moco.backbone.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in model.backbone.state_dict().items())
    assert not model.backbone.training
    with pytest.raises(ValueError, match="backbone"):  # MoCo cannot rebuild a module it did not save
        LinearClassifier(ckpt_path=str(path))
    with pytest.raises(FileNotFoundError, match="ckpt_path"):
        LinearClassifier(ckpt_path=str(tmp_path / "missing.ckpt"))


class GrayImages(LightningDataModule):
    """16 + 8 random 1x28x28 images, 10 classes, batches (image, target, index): a stand-in for Fashion-MNIST."""

    num_classes = 10

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(24, 1, 28, 28, generator=g), torch.arange(24) % 10
        self.batch_size = batch_size
        self.train, self.val = (
            TensorDataset(x[:16], y[:16], torch.arange(16)),
            TensorDataset(x[16:], y[16:], torch.arange(8)),
        )

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)


@pytest.fixture(scope="module")
def resnet_checkpoint(tmp_path_factory) -> Path:
    """A MoCo checkpoint with a named backbone (what configs/linear_eval.yaml expects), untrained (saved
    without fitting: loading is what is under test, and a resnet18 step costs seconds on this CPU)."""
    from lightning.pytorch import seed_everything

    from conftest import cpu_trainer, tiny_moco

    seed_everything(0, verbose=False)
    moco = tiny_moco(backbone="resnet18", cifar_stem=True)
    t = cpu_trainer()
    t.strategy.connect(moco)
    path = tmp_path_factory.mktemp("moco") / "moco.ckpt"
    t.save_checkpoint(path)
    return path


def _cli(path: Path, root: Path, *extra: str) -> None:
    main(
        [
            "fit",
            "--config",
            str(CONFIG),
            f"--model.ckpt_path={path}",
            "--trainer.accelerator=cpu",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={root}",
            *extra,
        ]
    )


def test_command_line_with_the_config(resnet_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["linear_eval"])
    # the config's model and trainer sections, with the data swapped for an in-memory stand-in
    _cli(resnet_checkpoint, tmp_path, "--data=test_linear_eval.GrayImages")
    saved = (tmp_path / "config.yaml").read_text()
    assert "lr: 30.0" in saved and "milestones:" in saved and "GrayImages" in saved


def test_command_line_with_the_config_on_fashion_mnist(resnet_checkpoint, tmp_path, monkeypatch):
    from moco_lightning.datamodules import FashionMNISTDataModule
    from moco_lightning.datamodules.fashion_mnist import DEBIAN_DIR

    assert Path(DEBIAN_DIR).is_dir(), (
        f"Fashion-MNIST is not installed in {DEBIAN_DIR}: apt-get install dataset-fashion-mnist"
    )
    assert FashionMNISTDataModule(pretrain=False).views.n_views == 1
    monkeypatch.setattr("sys.argv", ["linear_eval"])
    _cli(
        resnet_checkpoint,
        tmp_path,
        "--data.init_args.batch_size=8",
        "--data.init_args.train_subset=16",
        "--data.init_args.val_subset=8",
    )
    saved = (tmp_path / "config.yaml").read_text()
    assert "FashionMNISTDataModule" in saved and "pretrain: false" in saved and "lr: 30.0" in saved


def test_exported_narrow_backbone_is_linearly_evaluated_from_its_file(seeded, tmp_path):
    """The quickstart's width-0.5 ResNet-18, exported as a plain state dict, rebuilt by the same backbone arguments."""
    from moco_lightning import MoCo
    from moco_lightning.export import export_backbone

    from conftest import cpu_trainer, tiny_data

    moco = MoCo(backbone="resnet18", width=0.5, in_channels=1, image_size=28, queue_size=16, hidden_dim=32, dim=8)
    t = cpu_trainer(max_steps=1, limit_val_batches=0)
    t.fit(moco, tiny_data())
    t.save_checkpoint(tmp_path / "moco.ckpt")
    exported = export_backbone(tmp_path / "moco.ckpt", tmp_path / "backbone.pt")
    model = LinearClassifier(
        backbone="resnet18", width=0.5, in_channels=1, image_size=28, backbone_state_dict=str(exported), num_classes=10
    )
    assert model.feature_dim == 256
    saved = torch.load(exported)
    assert all(torch.equal(v, saved[k]) for k, v in model.backbone.state_dict().items())
