"""Offline linear evaluation: frozen backbone in eval mode through validation cycles, separable data learned,
backbones loaded from MoCo checkpoints, and the command line with configs/linear_eval.yaml."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers.cli import in_process
from helpers.trainers import trainer
from lightning.pytorch import Callback, LightningDataModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from moco_lightning.downstream.linear_eval import LinearClassifier
from moco_lightning.errors import ConfigError

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
    from helpers.data import tiny_data
    from helpers.models import tiny_moco
    from helpers.trainers import cpu_trainer

    moco = tiny_moco(**kwargs)
    t = cpu_trainer(max_steps=1, limit_val_batches=0)
    t.fit(moco, datamodule=tiny_data(batch_size=8, train_subset=16, val_subset=8))
    path = tmp_path / "moco.ckpt"
    t.save_checkpoint(path)
    return path, moco


def test_backbone_from_a_moco_checkpoint_with_a_module_backbone(seeded, tmp_path):
    from helpers.models import tiny_backbone

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
    from helpers.models import tiny_moco
    from helpers.trainers import cpu_trainer
    from lightning.pytorch import seed_everything

    seed_everything(0, verbose=False)
    moco = tiny_moco(backbone="resnet18", cifar_stem=True)
    t = cpu_trainer()
    t.strategy.connect(moco)
    path = tmp_path_factory.mktemp("moco") / "moco.ckpt"
    t.save_checkpoint(path)
    return path


def _cli(path: Path, root: Path, *extra: str) -> None:
    in_process(
        *[
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
            "--trainer.callbacks=[]",  # the config's ModelCheckpoint (last.ckpt every 5 minutes) off too
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={root}",
            *extra,
        ],
        model=LinearClassifier,
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
        "--data.init_args.train_subset=64",  # every class has training images (16 lack 4 of the 10)
        "--data.init_args.val_subset=8",
        "--trainer.limit_train_batches=2",
    )
    saved = (tmp_path / "config.yaml").read_text()
    assert "FashionMNISTDataModule" in saved and "pretrain: false" in saved and "lr: 30.0" in saved


def test_exported_narrow_backbone_is_linearly_evaluated_from_its_file(seeded, tmp_path):
    """The quickstart's width-0.5 ResNet-18, exported as a plain state dict, rebuilt by the same backbone arguments."""
    from helpers.data import tiny_data
    from helpers.trainers import cpu_trainer

    from moco_lightning import MoCo
    from moco_lightning.downstream.export import export_backbone

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

    # the file says what it holds: the export alone rebuilds it (no backbone settings, no ckpt_path null)
    alone = LinearClassifier(backbone_state_dict=str(exported), num_classes=10)
    assert alone.feature_dim == 256 and alone.backbone.layer4[0].conv1.out_channels == 256
    assert all(torch.equal(v, saved[k]) for k, v in alone.backbone.state_dict().items())
    assert LinearClassifier(ckpt_path=str(exported), num_classes=10).feature_dim == 256


@pytest.mark.parametrize("method", ["SimCLR", "MoCoV3"])
def test_a_checkpoint_of_another_method_is_linearly_evaluated(seeded, tmp_path, method):
    """Not only MoCo: any pretraining method's checkpoint gives its backbone (it was a 90-line traceback)."""
    from helpers.data import tiny_data
    from helpers.trainers import cpu_trainer

    import moco_lightning

    cls = getattr(moco_lightning, method)
    pre = cls(backbone="resnet18", width=0.25, in_channels=1, image_size=28, hidden_dim=16, dim=8)
    t = cpu_trainer(max_steps=1, limit_val_batches=0)
    t.fit(pre, tiny_data())
    t.save_checkpoint(tmp_path / "pre.ckpt")
    model = LinearClassifier(ckpt_path=str(tmp_path / "pre.ckpt"), num_classes=10)
    assert model.feature_dim == 128
    assert all(torch.equal(v, pre.backbone.state_dict()[k]) for k, v in model.backbone.state_dict().items())


# --- low labels, fine-tuning, from scratch --------------------------------------------------------------------
def test_balanced_subset_is_class_stratified_seeded_and_checked():
    from moco_lightning.datamodules.selection import balanced_subset

    targets = torch.cat([torch.full((100,), 0), torch.full((50,), 1), torch.full((10,), 2), torch.full((5,), -1)])
    idx = balanced_subset(targets, per_class=4, seed=0)
    assert torch.bincount(targets[idx]).tolist() == [4, 4, 4] and idx.tolist() == sorted(idx.tolist())
    assert torch.equal(idx, balanced_subset(targets, per_class=4, seed=0))
    assert not torch.equal(idx, balanced_subset(targets, per_class=4, seed=1))
    frac = balanced_subset(targets, fraction=0.1, seed=0)  # 10 % of each class, at least one, never an unlabelled -1
    assert torch.bincount(targets[frac]).tolist() == [10, 5, 1] and (targets[frac] >= 0).all()
    with pytest.raises(ValueError, match="class 2 has only 10"):
        balanced_subset(targets, per_class=11)
    with pytest.raises(ValueError, match="label_fraction=1.5"):
        balanced_subset(targets, fraction=1.5)
    with pytest.raises(ValueError, match="exactly one"):
        balanced_subset(targets, fraction=0.1, per_class=3)


def tiny_labelled_data(**kwargs):
    from helpers.data import tiny_data

    return tiny_data(**{"pretrain": False, "batch_size": 8, "train_subset": 200, "val_subset": 40, **kwargs})


def test_label_fraction_trains_on_the_seeded_subset_and_saves_its_indices(seeded, tmp_path):
    from lightning.pytorch import Trainer

    from moco_lightning.datamodules.selection import balanced_subset

    dm = tiny_labelled_data(batch_size=4)  # 20 labelled images: 5 whole batches
    model = LinearClassifier(backbone=frozen_backbone_2d(), feature_dim=16, labels_per_class=2, label_seed=3, lr=0.1)
    seen = []

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch[1].clone())

    t = Trainer(
        accelerator="cpu", max_epochs=1, default_root_dir=tmp_path, callbacks=[Record()], enable_progress_bar=False
    )
    t.fit(model, datamodule=dm)
    full = tiny_labelled_data()
    full.setup("fit")
    expected = balanced_subset(full.train_targets(), per_class=2, seed=3)
    assert torch.equal(model.labelled_indices, expected) and len(expected) == 20
    assert sorted(torch.cat(seen).tolist()) == sorted(full.train_targets()[expected].tolist())  # 2 per class, only
    written = (Path(t.log_dir) / "labelled_indices.txt").read_text().split()
    assert [int(i) for i in written] == expected.tolist()
    t.save_checkpoint(tmp_path / "probe.ckpt")
    assert torch.equal(torch.load(tmp_path / "probe.ckpt", weights_only=True)["labelled_indices"], expected)


def frozen_backbone_2d() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )  # fmt: skip


def test_finetune_trains_the_backbone_in_train_mode_at_its_own_lr(seeded):
    from helpers.trainers import cpu_trainer

    backbone = frozen_backbone_2d()
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    model = Recording(backbone=backbone, feature_dim=16, finetune=True, lr=0.1, backbone_lr=0.01, schedule="cosine")
    t = cpu_trainer(max_steps=6, limit_val_batches=0)
    t.fit(model, datamodule=tiny_labelled_data())
    assert all(model.modes) and len(model.modes) == 6  # BatchNorm in train mode on every batch
    after = model.backbone.state_dict()
    assert not torch.equal(before["0.weight"], after["0.weight"])  # trained
    assert not torch.equal(before["1.running_mean"], after["1.running_mean"])  # BN statistics of the new data
    head, body = t.optimizers[0].param_groups
    assert body["params"] == list(model.backbone.parameters()) and head["params"] == list(model.head.parameters())
    assert head["initial_lr"] == 0.1 and body["initial_lr"] == 0.01
    assert body["lr"] == pytest.approx(0.0, abs=1e-12)  # the per-step cosine over max_steps ends at 0


def test_from_scratch_rebuilds_the_checkpoints_architecture_with_random_weights(seeded, tmp_path):
    from helpers.data import tiny_data
    from helpers.trainers import cpu_trainer

    from moco_lightning import MoCo

    moco = MoCo(backbone="resnet18", width=0.25, in_channels=1, image_size=28, queue_size=16, hidden_dim=16, dim=8)
    t = cpu_trainer(max_steps=1, limit_val_batches=0)
    t.fit(moco, tiny_data())
    t.save_checkpoint(tmp_path / "moco.ckpt")
    pretrained = LinearClassifier(ckpt_path=str(tmp_path / "moco.ckpt"), num_classes=10, finetune=True)
    scratch = LinearClassifier(ckpt_path=str(tmp_path / "moco.ckpt"), num_classes=10, from_scratch=True)
    assert scratch.finetune and scratch.feature_dim == pretrained.feature_dim == 128
    a, b = pretrained.backbone.state_dict(), scratch.backbone.state_dict()
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    assert torch.equal(a["conv1.weight"], moco.backbone.state_dict()["conv1.weight"])
    assert not torch.equal(b["conv1.weight"], a["conv1.weight"])


def test_low_label_options_do_what_they_say_or_say_why_not(seeded):
    """From scratch the whole network trains at lr (backbone_lr is for a pretrained backbone: a warning says it is
    not used), a frozen backbone ignores backbone_lr with a warning, from_scratch with finetune false is refused, and
    hparams record what the run does."""
    from helpers.data import FIXTURE_CKPT
    from helpers.trainers import cpu_trainer

    with pytest.warns(
        UserWarning, match="backbone_lr=0.01 is not used: from scratch the whole network trains at lr=0.05"
    ):
        scratch = LinearClassifier(ckpt_path=FIXTURE_CKPT, num_classes=10, from_scratch=True, lr=0.05, backbone_lr=0.01)
    t = cpu_trainer(max_steps=1, limit_val_batches=0)
    t.fit(scratch, datamodule=tiny_labelled_data())
    head, body = t.optimizers[0].param_groups
    assert head["initial_lr"] == body["initial_lr"] == 0.05 and scratch.hparams.finetune is True
    with pytest.warns(UserWarning, match="backbone_lr=0.01 is not used: finetune is false"):
        frozen = LinearClassifier(ckpt_path=FIXTURE_CKPT, num_classes=10, finetune=False, backbone_lr=0.01)
    assert frozen.hparams.finetune is False and not any(p.requires_grad for p in frozen.backbone.parameters())
    with pytest.raises(ConfigError, match="from_scratch=True trains the whole network .* finetune=False freezes"):
        LinearClassifier(ckpt_path=FIXTURE_CKPT, num_classes=10, from_scratch=True, finetune=False)


@pytest.mark.parametrize("labels", [{}, dict(labels_per_class=1), dict(label_fraction=0.5)])
def test_a_training_split_missing_classes_is_refused_with_or_without_a_label_subset(seeded, labels):
    """A training subset that lacks some classes would train a 10-class head on fewer: one rule, whether all its
    labels are used or a subset of them: refused, naming the missing classes."""
    from helpers.data import FIXTURE_CKPT
    from helpers.trainers import cpu_trainer

    from moco_lightning.datamodules import FashionMNISTDataModule

    data = FashionMNISTDataModule(batch_size=4, train_subset=6, val_subset=8, pretrain=False)
    model = LinearClassifier(ckpt_path=FIXTURE_CKPT, **labels)
    with pytest.raises(ConfigError, match=r"the training split holds \d of the 10 classes \(none of \["):
        cpu_trainer(max_steps=1, limit_val_batches=0).fit(model, datamodule=data)


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_low_label_config_fine_tunes_through_the_command_line(resnet_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["linear_eval"])
    cli = main_cli(
        resnet_checkpoint,
        tmp_path,
        Path(__file__).resolve().parents[1] / "configs" / "low_label.yaml",
        "--trainer.max_steps=3",
        "--model.labels_per_class=2",
        "--model.label_fraction=null",
        "--data.init_args.batch_size=8",
        "--data.init_args.train_subset=200",
        "--data.init_args.val_subset=16",
    )
    indices = (Path(cli.trainer.log_dir) / "labelled_indices.txt").read_text().split()
    assert len(indices) == 20 and cli.trainer.global_step == 3 and cli.model.finetune


def main_cli(path: Path, root: Path, config: Path, *extra: str):
    return in_process(
        *[
            "fit",
            "--config",
            str(config),
            f"--model.ckpt_path={path}",
            "--trainer.accelerator=cpu",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.logger.init_args.save_dir={root}",
            f"--trainer.default_root_dir={root}",
            *extra,
        ],
        model=LinearClassifier,
    )


@pytest.mark.parametrize(
    "content,said",
    [
        (b"", "not a readable checkpoint \\(0 bytes"),
        (b"notes", "not a checkpoint: a 5-byte text file"),
        (b"PK\x03\x04 torn", "not a readable checkpoint \\(9 bytes"),
    ],
)
def test_a_torn_empty_or_text_checkpoint_is_one_error_naming_the_file(tmp_path, content, said):
    from moco_lightning.errors import ConfigError

    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"^model.ckpt_path {re.escape(str(bad))}: {said}"):
        LinearClassifier(ckpt_path=str(bad), num_classes=10)


def test_a_preempted_linear_evaluation_saves_a_resumable_checkpoint_at_a_step_boundary(seeded, tmp_path, capsys):
    """The classifier brings the run callbacks too (``moco_lightning.run.CLASSIFIER``): SIGTERM saves last.ckpt at
    the end of the step it arrived in; with ``run_callbacks=False`` none of them is added."""
    import signal

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from moco_lightning import run

    class Term(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                signal.raise_signal(signal.SIGTERM)

    model = LinearClassifier(backbone=frozen_backbone(), feature_dim=8, num_classes=3)
    t = trainer(max_epochs=4, callbacks=[Term()], default_root_dir=tmp_path)
    with pytest.raises(SIGTERMException):
        t.fit(model, datamodule=Separable())
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 3 and "SIGTERM at step 3" in capsys.readouterr().err
    assert {type(c) for c in t.callbacks} >= set(run.CLASSIFIER)
    plain = trainer(max_steps=1)
    plain.fit(LinearClassifier(backbone=frozen_backbone(), feature_dim=8, num_classes=3, run_callbacks=False),
              datamodule=Separable())  # fmt: skip
    assert not {type(c) for c in plain.callbacks} & set(run.CLASSIFIER)
