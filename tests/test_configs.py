"""Every config in configs/ trains two steps through the real CLI (``fast_dev_run``) on fixture data of its kind."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import in_process
from helpers.files import write_cifar10, write_stl10, write_tree

from moco_lightning import MoCo
from moco_lightning.cli import run_cli
from moco_lightning.downstream.linear_eval import LinearClassifier

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
FAST = (
    "quickstart.yaml",
    "image_folder.yaml",
)  # in the fast loop: the demo's and a user's folder; all in the full suite
SMALL_FMNIST = ["--data.init_args.batch_size=16", "--data.init_args.train_subset=64", "--data.init_args.val_subset=32"]


def fixture_overrides(config: str, tmp: Path) -> list[str]:
    """Data of the config's kind in ``tmp`` and the overrides that make two steps of it take seconds."""
    text = (ROOT / "configs" / config).read_text()
    moco = not any(f"moco_lightning.{m}" in text for m in ("SimCLR", "BYOL", "SwAV"))
    bn_splits = ["--model.bn_splits=2"] if moco else []  # MoCo's split BN needs a batch of 8 divisible by it
    if "ImageFolderDataModule" in text:
        write_tree(tmp / "folder", n_per_class=8)
        return [
            f"--data.init_args.data_dir={tmp / 'folder'}",
            "--data.init_args.batch_size=8",
            "--data.init_args.image_size=32",
            "--data.init_args.num_workers=0",
            "--data.init_args.local_size=16",
            *bn_splits,
        ]
    if "CIFAR10DataModule" in text:
        write_cifar10(tmp / "cifar")
        return [f"--data.init_args.data_dir={tmp / 'cifar'}", "--data.init_args.batch_size=8", *bn_splits]
    if "STL10DataModule" in text:
        write_stl10(tmp / "stl")
        return [
            f"--data.init_args.data_dir={tmp / 'stl'}",
            "--data.init_args.batch_size=8",
            "--data.init_args.image_size=32",
            *bn_splits,
        ]
    extra = (
        ["--model.init_args.backbone.init_args.num_layers=1", "--model.init_args.hidden_dim=32"]
        if "ViT" in text
        else []
    )
    return SMALL_FMNIST + extra


def pretrain_checkpoint(tmp: Path) -> Path:
    """A tiny MoCo checkpoint for configs/linear_eval.yaml."""
    run_cli(
        MoCo,
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "fashion_mnist_moco_v2.yaml"),
            "--model.width=0.125",
            "--trainer.max_steps=1",
            f"--trainer.default_root_dir={tmp}",
            "--trainer.logger=false",
            "--trainer.callbacks=[]",
            *SMALL_FMNIST,
        ],
    )
    return next(tmp.rglob("*.ckpt"))


@pytest.mark.parametrize(
    "config",
    [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CONFIGS],
)
@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_every_config_trains_two_steps_on_fixture_data(config, tmp_path, monkeypatch, one_torch_thread):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["moco-lightning"])
    args = ["fit", "--config", str(ROOT / "configs" / config), "--trainer.fast_dev_run=2", "--trainer.accelerator=cpu"]
    if config in ("linear_eval.yaml", "low_label.yaml"):  # the LinearClassifier's configs, on a tiny checkpoint
        labels = ["--model.label_fraction=0.5"] if config == "low_label.yaml" else []  # 64 images: 32 labelled
        cli = in_process(
            *[*args, f"--model.ckpt_path={pretrain_checkpoint(tmp_path)}", *SMALL_FMNIST, *labels],
            model=LinearClassifier,
        )
    elif "DDPStrategy" in (ROOT / "configs" / config).read_text():  # DDP launches processes: the real command
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        exe = Path(sys.executable).with_name("moco-lightning")
        result = subprocess.run(
            [str(exe), *args, *fixture_overrides(config, tmp_path)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "`Trainer.fit` stopped: `max_steps=2` reached" in result.stderr + result.stdout
        return
    else:
        cli = in_process(*[*args, *fixture_overrides(config, tmp_path)])
    assert cli.trainer.global_step == 2 and cli.trainer.state.finished


@pytest.mark.parametrize("config", ["moco_v1.yaml", "moco_v2.yaml", "moco_v2plus.yaml", "cifar10.yaml"])
def test_v1_v2_configs_decay_every_parameter_as_the_official_code(config):
    """The official main_moco.py (and the CIFAR demo) decay BN and bias parameters too; so does MoCo by default."""
    import inspect

    import yaml

    assert yaml.safe_load((ROOT / "configs" / config).read_text())["model"]["decay_norm_bias"] is True
    from moco_lightning.methods.contrastive import Contrastive  # MoCo's base: the MoCo family decays everything

    assert inspect.signature(Contrastive.__init__).parameters["decay_norm_bias"].default is True


@pytest.mark.parametrize("config", CONFIGS)
def test_every_shipped_config_saves_last_ckpt_every_few_minutes(config):
    """A kill loses at most 5 minutes of training (the README's "kill -9 at any step" holds for the shipped configs,
    not only for configs that add every_n_train_steps), and the run's last step is saved too (the modules' end)."""
    from datetime import timedelta

    import yaml

    callbacks = yaml.safe_load((ROOT / "configs" / config).read_text())["trainer"].get("callbacks") or []
    saving = [c["init_args"] for c in callbacks if c["class_path"].endswith("ModelCheckpoint")]
    last = [args for args in saving if args.get("save_last")]
    assert len(last) == 1, saving  # one last.ckpt (two callbacks saving last would write last-v1.ckpt)
    h, m, s = (int(x) for x in last[0]["train_time_interval"].split(":"))
    assert timedelta(hours=h, minutes=m, seconds=s) <= timedelta(minutes=5)


@pytest.mark.parametrize("config", CONFIGS)
def test_every_config_with_a_knn_monitor_keeps_the_best_checkpoint_by_knn(config):
    """``best-knn.ckpt``: the best ``val/knn_acc1`` (``evaluate / export / embed --ckpt best``) beside last.ckpt."""
    import yaml

    callbacks = yaml.safe_load((ROOT / "configs" / config).read_text())["trainer"].get("callbacks") or []
    if not any(c["class_path"].endswith("KNNMonitor") for c in callbacks):
        return
    best = [c["init_args"] for c in callbacks if (c.get("init_args") or {}).get("filename") == "best-knn"]
    assert best == [dict(monitor="val/knn_acc1", mode="max", filename="best-knn", save_top_k=1)]


@pytest.mark.parametrize("config", ["simclr_fashion_mnist.yaml", "byol_fashion_mnist.yaml", "swav_fashion_mnist.yaml"])
def test_method_configs_share_the_quickstarts_data_backbone_optimizer_and_length(config):
    """The seeds' comparison (benchmarks/methods.py) is fair only if SimCLR, BYOL and SwAV see what MoCo sees: the
    quickstart's data and views, backbone, optimizer settings and length; only the method's own part differs."""
    import yaml

    def read(name: str) -> dict:
        return yaml.safe_load((ROOT / "configs" / name).read_text())

    moco, other = read("quickstart.yaml"), read(config)
    assert other["data"] == moco["data"]
    assert other["trainer"]["max_epochs"] == moco["trainer"]["max_epochs"]
    shared = ("backbone", "width", "stem", "in_channels", "image_size", "channels_last", "optimizer", "lr")
    shared += ("weight_decay", "warmup_epochs", "lr_schedule", "decay_norm_bias")
    from moco_lightning.cli import from_config  # what the CLI builds, each class's defaults filled in

    mine, theirs = (from_config(ROOT / "configs" / name)[0].hparams for name in (config, "quickstart.yaml"))
    assert {k: mine[k] for k in shared} == {k: theirs[k] for k in shared}
