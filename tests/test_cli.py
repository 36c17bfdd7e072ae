import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(args, cwd, timeout=240):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_quickstart_config_runs_offline_through_the_cli(tmp_path):
    exe = Path(sys.executable).with_name("moco-lightning")
    result = run([
        str(exe), "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.fast_dev_run=2",
        "--data.init_args.batch_size=32", "--data.init_args.train_subset=256", "--data.init_args.val_subset=64",
    ], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in result.stderr + result.stdout


def test_python_dash_m_entry_point_and_bad_argument(tmp_path):
    result = run([sys.executable, "-m", "moco_lightning", "fit", "--print_config",
                  "--config", str(ROOT / "configs" / "quickstart.yaml")], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "queue_size: 4096" in result.stdout and "FashionMNISTDataModule" in result.stdout
    bad = run([sys.executable, "-m", "moco_lightning", "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
               "--model.temperature=-1", "--trainer.fast_dev_run=true"], cwd=tmp_path)
    assert bad.returncode != 0
    assert "temperature=-1.0 is not allowed; temperature must be a number > 0" in bad.stderr


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_config_parses(config, tmp_path):
    result = run([sys.executable, "-m", "moco_lightning.cli" if config != "linear_eval.yaml" else "moco_lightning.linear_eval",
                  "fit", "--print_config", "--config", str(ROOT / "configs" / config)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("override", [
    ["--config", str(ROOT / "configs" / "moco_v3_vit_small.yaml"), "--model.backbone.init_args.num_layers=2",
     "--model.hidden_dim=64", "--model.predictor_hidden_dim=64"],
    ["--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.dictionary=batch", "--model.queue_size=0"],
    ["--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.dictionary=memory_bank",
     "--model.memory_bank_size=256", "--model.queue_size=64", "--model.momentum=0.5"],
], ids=["v3_vit_small", "batch", "memory_bank"])
def test_v3_and_each_dictionary_train_through_the_cli(override, tmp_path):
    exe = Path(sys.executable).with_name("moco-lightning")
    result = run([str(exe), "fit", *override, "--trainer.fast_dev_run=2", "--trainer.callbacks=[]",
                  "--data.init_args.batch_size=32", "--data.init_args.train_subset=256",
                  "--data.init_args.val_subset=64"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in result.stderr + result.stdout
