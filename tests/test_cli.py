import os
import re
import sys
import warnings
from pathlib import Path

import pytest
from helpers.cli import cli_main, in_process, run

ROOT = Path(__file__).resolve().parents[1]


def two_steps(config: str, batch: int, train: int, val: int, *overrides: str):
    """``moco-lightning fit`` of a shipped config for 2 steps (``fast_dev_run``) on a Fashion-MNIST subset."""
    sizes = (f"--data.init_args.batch_size={batch}", f"--data.init_args.train_subset={train}")
    return in_process(
        "fit", "--config", str(ROOT / "configs" / config), "--trainer.fast_dev_run=2", *sizes,
        f"--data.init_args.val_subset={val}", *overrides,
    )  # fmt: skip


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_quickstart_config_runs_offline_through_the_cli(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = two_steps("quickstart.yaml", 32, 256, 64)
    assert cli.trainer.global_step == 2 and cli.trainer.state.finished
    assert {type(c).__name__ for c in cli.trainer.callbacks} >= {"KNNMonitor", "LinearProbe"}  # every callback ran


@pytest.mark.slow  # a subprocess / several processes
def test_python_dash_m_entry_point_prints_the_config(tmp_path):
    result = run(
        [
            sys.executable,
            "-m",
            "moco_lightning",
            "fit",
            "--print_config",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "queue_size: 1024" in result.stdout and "FashionMNISTDataModule" in result.stdout


def test_swav_with_multi_crop_trains_through_the_cli(tmp_path, monkeypatch):
    """Another method from its shipped config (its class_path), with local views (the matrix has two views)."""
    monkeypatch.chdir(tmp_path)
    cli = two_steps(
        "swav_fashion_mnist.yaml", 32, 256, 64, "--data.init_args.local_views=2", "--data.init_args.local_size=12",
        "--trainer.callbacks=[]",
    )  # fmt: skip
    assert cli.trainer.global_step == 2 and cli.trainer.state.finished and type(cli.model).__name__ == "SwAV"


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_a_timm_backbone_trains_through_the_cli(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = two_steps(
        "quickstart.yaml", 16, 64, 32, "--model.backbone=timm:resnet10t", "--model.width=1.0", "--model.stem=cifar",
        "--model.channels_last=false", "--trainer.callbacks=[]",
    )  # fmt: skip
    assert cli.trainer.global_step == 2 and type(cli.model.backbone).__module__.startswith("timm")


RESUME_CONFIG = """
trainer:
  accelerator: cpu
  max_steps: 6
  max_epochs: 10
  enable_progress_bar: false
  enable_model_summary: false
  num_sanity_val_steps: 0
  limit_val_batches: 0
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args: {save_dir: runs, name: tiny}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {every_n_train_steps: 3, save_last: true, save_top_k: -1}
model:
  backbone: resnet18
  width: 0.125
  in_channels: 1
  image_size: 28
  hidden_dim: 32
  dim: 16
  queue_size: 256
  bn_splits: 2
data:
  class_path: moco_lightning.datamodules.FashionMNISTDataModule
  init_args: {batch_size: 16, train_subset: 64, val_subset: 16}
"""


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_ckpt_path_last_resumes_the_newest_run_in_its_own_version(tmp_path, monkeypatch, capsys):
    """No seed: only a real resume can leave run A's keys of steps 1-6 in the queue after step 9."""
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(RESUME_CONFIG)
    assert cli_main("fit", "--config", "cfg.yaml", "--ckpt_path", "last") == 0
    assert "--ckpt_path last: no checkpoint under runs/tiny (version_*/checkpoints): starting a new run" in (
        capsys.readouterr().err
    )
    after_a = torch.load(tmp_path / "runs/tiny/version_0/checkpoints/last.ckpt", weights_only=True)
    assert after_a["global_step"] == 6
    assert cli_main("fit", "--config", "cfg.yaml", "--ckpt_path", "last", "--trainer.max_steps", "9") == 0
    assert "resuming runs/tiny/version_0/checkpoints/last.ckpt" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "runs/tiny").iterdir()) == ["version_0"]  # no new version_1
    final = torch.load(tmp_path / "runs/tiny/version_0/checkpoints/last.ckpt", weights_only=True)
    assert final["global_step"] == 9
    enqueued = final["state_dict"]["dictionary.enqueued_at"]
    assert torch.equal(enqueued[: 6 * 16], after_a["state_dict"]["dictionary.enqueued_at"][: 6 * 16])
    assert [int((enqueued == s).sum()) for s in range(1, 10)] == [16] * 9  # 16 keys of each of steps 1-9


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_resume_with_other_model_settings_errors_or_warns_naming_each(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(RESUME_CONFIG.replace("max_steps: 6", "max_steps: 3"))
    assert cli_main("fit", "--config", "cfg.yaml") == 0
    ckpt = "runs/tiny/version_0/checkpoints/last.ckpt"
    capsys.readouterr()
    structural = cli_main("fit", "--config", "cfg.yaml", "--ckpt_path", ckpt, "--model.queue_size", "512",
                          "--model.dim", "8")  # fmt: skip
    err = capsys.readouterr().err
    assert structural == 2 and "Traceback" not in err, err[-3000:]
    wrong = "dim: checkpoint 16, config 8; queue_size: checkpoint 256, config 512"
    assert f"the checkpoint does not fit the configured model ({wrong})" in err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = cli_main("fit", "--config", "cfg.yaml", "--ckpt_path", ckpt, "--model.temperature", "0.5",
                         "--trainer.max_steps", "4")  # fmt: skip
    assert other == 0
    said = [str(w.message) for w in caught]
    assert any("these configured values are ignored: temperature: config 0.5, checkpoint 0.2" in m for m in said), said


def test_bad_settings_end_with_one_error_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    quickstart = ("fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.temperature=-1")
    assert cli_main(*quickstart, "--trainer.fast_dev_run=true") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-2] == (
        "moco-lightning fit: error: MoCo: temperature=-1.0 is not allowed; temperature must be a number > 0"
    )
    monkeypatch.setenv("MOCO_LIGHTNING_DEBUG", "1")
    with pytest.raises(ValueError, match="temperature=-1.0 is not allowed"):  # the traceback, for debugging
        cli_main(*quickstart)
    monkeypatch.delenv("MOCO_LIGHTNING_DEBUG")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert cli_main("export", "--ckpt", "notes.txt", "--out", "b.pt") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--ckpt notes.txt: not a checkpoint: a 16-byte text file, neither a" in err


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_a_torn_newest_checkpoint_falls_back_and_bad_files_are_one_line(tmp_path, monkeypatch, capsys):
    """A kill during a save (no atomic rename), a full disk, a truncated copy: ``last`` resumes the newest readable
    checkpoint naming both; an explicit path to a bad file is one line naming it, exit code 2."""
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(RESUME_CONFIG.replace("max_steps: 6", "max_steps: 3"))
    in_process(*["fit", "--config", "cfg.yaml"])
    folder = tmp_path / "runs/tiny/version_0/checkpoints"
    last, good = folder / "last.ckpt", next(folder.glob("*step=3.ckpt"))
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])  # torn
    os.utime(last, (good.stat().st_mtime + 5,) * 2)
    capsys.readouterr()
    cli = in_process(*["fit", "--config", "cfg.yaml", "--ckpt_path", "last", "--trainer.max_steps", "4"])  # fmt: skip
    err = capsys.readouterr().err
    assert "last.ckpt could not be used (not a readable checkpoint); resuming" in err and good.name in err
    assert cli.trainer.global_step == 4
    bad = tmp_path / "bad.ckpt"
    for content, said in (
        (b"", "not a readable checkpoint (0 bytes"),
        (b"not a checkpoint at all", "not a checkpoint: a 23-byte text file"),  # not "a save interrupted by a kill"
        (data[:1000], "not a readable checkpoint (1000 bytes"),
    ):
        bad.write_bytes(content)
        with pytest.raises(SystemExit) as exit_:
            in_process(*["fit", "--config", "cfg.yaml", "--ckpt_path", str(bad)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 2
        assert f"--ckpt_path {bad}: {said}" in err
    with pytest.raises(SystemExit):
        in_process(*["fit", "--config", "cfg.yaml", "--ckpt_path", "missing.ckpt"])
    assert "--ckpt_path missing.ckpt: no such file" in capsys.readouterr().err
    # a checkpoint of another method: an error naming both classes (it used to switch the method silently)
    ckpt = torch.load(good, weights_only=True)
    ckpt["hyper_parameters"]["_class_path"] = ckpt["moco_lightning"]["module"] = "moco_lightning.SimCLR"
    torch.save(ckpt, tmp_path / "simclr.ckpt")
    with pytest.raises(SystemExit):
        in_process(*["fit", "--config", "cfg.yaml", "--ckpt_path", "simclr.ckpt"])
    err = capsys.readouterr().err
    assert re.search(
        r"--ckpt_path simclr.ckpt: the checkpoint is a moco_lightning.SimCLR run, "
        r"not a moco_lightning[.\w]*\.MoCo one: "
        r"resume it with its own config \(model.class_path: moco_lightning.SimCLR\)",
        err,
    )


def test_optimizer_flags_are_refused_and_no_logger_prints_no_tensorboard_line(tmp_path, monkeypatch, capsys):
    from moco_lightning import MoCo, Pretraining
    from moco_lightning.cli import run_cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(RESUME_CONFIG.replace("max_steps: 6", "max_steps: 1"))
    with pytest.raises(SystemExit):
        in_process(*["fit", "--config", "cfg.yaml", "--optimizer", "torch.optim.Adam"])
    assert "--optimizer replaces the module's own optimizer" in capsys.readouterr().err
    run_cli(Pretraining, ["fit", "--config", "cfg.yaml", "--trainer.logger=false", "--trainer.callbacks=[]"],
            default_model=MoCo)  # fmt: skip
    out = capsys.readouterr().out
    assert "Final metrics (at step " in out and "TensorBoard" not in out


@pytest.mark.parametrize(
    "flag, line",
    [
        ("--model.lr=abc", "moco-lightning fit: error: model.lr: Expected a <class 'float'>. Got value: abc"),
        (
            "--model.lrr=1",
            "moco-lightning fit: error: model.lrr: not an argument of moco_lightning.MoCo; did you mean lr?",
        ),
        ("--data.init_args.batch_size=x", "moco-lightning fit: error: data.batch_size: Expected a <class 'int'>."),
        (
            "--model.class_path=moco_lightning.Foo",
            "moco-lightning fit: error: model.class_path: moco_lightning.Foo cannot be imported (module "
            "'moco_lightning' has no attribute 'Foo'); the methods: moco_lightning.BYOL, moco_lightning.EndToEnd, "
            "moco_lightning.MemoryBankMoCo, moco_lightning.MoCo, moco_lightning.MoCoV3, moco_lightning.SimCLR, "
            "moco_lightning.SwAV",
        ),
        (
            "--data.class_path=moco_lightning.datamodules.Foo",
            "moco-lightning fit: error: data.class_path: moco_lightning.datamodules.Foo cannot be imported",
        ),
        (
            "--model.init_args.stem=foo",
            "moco-lightning fit: error: model.stem: 'foo' is not allowed; one of 'imagenet', 'cifar', 'cifar_stride2'",
        ),
    ],
)
def test_a_wrong_type_or_unknown_key_is_one_line_first_not_after_the_usage(flag, line, capsys):
    """It was ~60 lines of usage and then a nested report naming the Union's alternatives."""
    from moco_lightning.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 2, err
    assert err[0].startswith(line) and err[1] == "  (moco-lightning fit --help lists the options)"


def test_help_names_every_command_export_included(capsys):
    from moco_lightning.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: moco-lightning ") and "moco-lightning export --ckpt" in out
    assert "moco-lightning linear fit" in out


def test_final_metrics_say_when_a_knn_number_was_measured(seeded):
    """every_n_epochs 2 in a 1-epoch run: val/knn_acc1 is the random-init baseline; the table says so."""
    import torch
    from helpers.data import tiny_data
    from helpers.models import tiny_moco
    from helpers.trainers import cpu_trainer

    from moco_lightning.callbacks import KNNMonitor
    from moco_lightning.cli import final_metrics_table

    trainer = cpu_trainer(max_epochs=1, limit_val_batches=0, callbacks=[KNNMonitor(every_n_epochs=2, k=5)])
    trainer.fit(tiny_moco(), tiny_data())
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if isinstance(v, torch.Tensor)}
    table = final_metrics_table(metrics, trainer).splitlines()
    assert table[1] == "Final metrics (at step 4):"
    knn = next(line for line in table if "val/knn_acc1" in line)
    assert knn.endswith("(step 0: before training)")
    assert not next(line for line in table if "train/loss" in line).endswith(")")


BAD_PRETRAINING = [  # (arguments after the config, what the one line says)
    (["--trainer.max_steps", "-5"], "trainer: `max_steps` must be a non-negative integer"),
    (["--trainer.devices", "0"], "trainer: `Trainer(devices='0')` value is not a valid input"),
    (["--trainer.accelerator", "gpu"], "this machine has no GPU: use trainer.accelerator cpu or auto"),
]


@pytest.mark.parametrize("args, line", BAD_PRETRAINING, ids=["max_steps", "devices", "gpu"])
def test_bad_trainer_settings_are_one_line_naming_the_trainer(args, line, tmp_path, monkeypatch, capsys):
    import torch

    if args[-1] == "gpu" and torch.cuda.is_available():
        args, line = ["--trainer.accelerator", "tpu"], "trainer: "  # a machine with a GPU: another missing device
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(RESUME_CONFIG)
    assert cli_main("fit", "--config", "cfg.yaml", *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("moco-lightning fit: error: ") and line in err[0], err


def test_a_missing_data_dir_and_a_malformed_config_say_which_and_where(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder.yaml").write_text("data:\n  class_path: moco_lightning.datamodules.ImageFolderDataModule\n")
    assert cli_main("fit", "--config", "folder.yaml") == 2
    assert capsys.readouterr().err.startswith(
        "moco-lightning fit: error: data.data_dir: required by moco_lightning.datamodules.ImageFolderDataModule and "
        "not set: give --data.init_args.data_dir"
    )
    (tmp_path / "bad.yaml").write_text("model:\n  queue_size: [1, 2\n  dim: 3\n")
    assert cli_main("fit", "--config", "bad.yaml") == 2
    assert capsys.readouterr().err.startswith("moco-lightning fit: error: --config bad.yaml: not valid YAML at line 3")


FIXTURE = ROOT / "tests" / "fixtures" / "format2" / "MoCo.ckpt"  # a grayscale (1-channel) MoCo checkpoint


def image_folder(root: Path, classes: tuple, mode: str) -> Path:
    from PIL import Image

    for split in ("train", "val"):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(3):
                Image.new(mode, (12, 12), color=(40 * i if mode == "L" else (40 * i, 9, 200))).save(
                    root / split / c / f"{i}.png"
                )
    return root


@pytest.mark.parametrize(
    "case, args, line",
    [
        ("views", ["--data.init_args.pretrain", "true"], "set data.init_args.pretrain false"),
        ("classes", ["--model.num_classes", "5"], "model.num_classes=5, but the datamodule has 10 classes"),
        ("one_class", [], "the datamodule has 1 class(es): a classifier needs at least 2 labelled classes"),
        ("rgb", [], "the backbone takes 1-channel images, the datamodule gives 3-channel ones"),
        ("test", [], "test: there is no test step"),
        ("predict", [], "predict: for features, export the backbone"),
    ],
)
def test_linear_eval_bad_inputs_are_one_line(case, args, line, tmp_path, monkeypatch, capsys):
    from moco_lightning.downstream.linear_eval import LinearClassifier

    monkeypatch.chdir(tmp_path)
    sub = case if case in ("test", "predict") else "fit"
    command = [sub, "--config", str(ROOT / "configs" / "low_label.yaml"), "--model.ckpt_path", str(FIXTURE), *args]
    if case in ("one_class", "rgb"):
        folder = image_folder(
            tmp_path / "images", ("a",) if case == "one_class" else ("a", "b"), "L" if case == "one_class" else "RGB"
        )
        channels = 1 if case == "one_class" else 3
        command += ["--data", "moco_lightning.datamodules.ImageFolderDataModule", "--data.init_args.data_dir",
                    str(folder), "--data.init_args.image_size", "28", "--data.init_args.in_channels", str(channels),
                    "--data.init_args.pretrain", "false", "--data.init_args.num_workers", "0",
                    "--model.label_fraction", "null", "--data.init_args.batch_size", "2"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        in_process(*[*command, "--trainer.max_steps", "1"], model=LinearClassifier)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 2 and "Traceback" not in "\n".join(err), err
    assert err[0].startswith(f"moco-lightning linear {sub}: error: ") and line in err[0], err


def test_export_to_a_device_and_load_backbone_of_a_directory_are_one_line(tmp_path, capsys):
    from moco_lightning import load_backbone
    from moco_lightning.errors import ConfigError

    for out in ("/dev/null", "/dev/full"):
        assert cli_main("export", "--ckpt", str(FIXTURE), "--out", out) == 2
        assert f"--out {out} is not a regular file (a device or a pipe): give a file name" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path))} is a directory: give the checkpoint file"):
        load_backbone(tmp_path)


def test_ckpt_path_last_without_a_last_ckpt_resumes_the_newest_checkpoint_and_says_so(tmp_path, monkeypatch, capsys):
    """Lightning's default checkpointing keeps epoch=E-step=S.ckpt and no last.ckpt: ``--ckpt_path last`` resumes the
    newest of them, saying so (it said "starting a new run"), and logs into its version."""

    monkeypatch.chdir(tmp_path)
    text = RESUME_CONFIG.replace("max_steps: 6\n  max_epochs: 10", "max_epochs: 2")
    text = text[: text.index("  callbacks:")] + text[text.index("model:") :]  # Lightning's default ModelCheckpoint
    (tmp_path / "cfg.yaml").write_text(text)
    in_process(*["fit", "--config", "cfg.yaml"])
    folder = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints"
    assert [p.name for p in folder.glob("*.ckpt")] == ["epoch=1-step=8.ckpt"]
    capsys.readouterr()
    args = ["fit", "--config", "cfg.yaml", "--ckpt_path", "last", "--trainer.max_epochs", "3"]
    cli = in_process(*args)
    err = capsys.readouterr().err
    assert (
        "--ckpt_path last: no last.ckpt under runs/tiny (version_*/checkpoints): resuming the newest checkpoint, "
        "runs/tiny/version_0/checkpoints/epoch=1-step=8.ckpt"
    ) in err
    assert cli.trainer.global_step == 12 and not (tmp_path / "runs" / "tiny" / "version_1").exists()


def test_linear_is_a_subcommand_of_moco_lightning(tmp_path, monkeypatch, capsys):
    """``moco-lightning linear fit ...`` is ``moco-lightning linear fit ...``, its messages named after
    the command that was typed."""
    from moco_lightning.cli import main

    config = str(ROOT / "configs" / "linear_eval.yaml")
    monkeypatch.setattr("sys.argv", ["moco-lightning", "linear", "fit", "--config", config, "--model.lr=-1"])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[0].startswith("moco-lightning linear fit: error: LinearClassifier: lr="), err


BEST_CONFIG = RESUME_CONFIG.replace("max_steps: 6\n  max_epochs: 10", "max_steps: -1\n  max_epochs: 3").replace(
    "limit_val_batches: 0", "limit_val_batches: 1"
).replace(
    "      init_args: {every_n_train_steps: 3, save_last: true, save_top_k: -1}",
    """      init_args: {save_last: true}
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {monitor: val/knn_acc1, mode: max, filename: best-knn, save_top_k: 1}
    - class_path: moco_lightning.callbacks.KNNMonitor
      init_args: {k: 5, every_n_epochs: 2}""",
)  # fmt: skip


def test_ckpt_best_and_last_name_a_runs_best_knn_and_last_checkpoints(tmp_path, monkeypatch, capsys):
    """A run keeps ``best-knn.ckpt`` (the best ``val/knn_acc1``, measured at epochs 0 and 2 here, not at 1) beside
    ``last.ckpt``; ``export``, ``embed`` and ``evaluate`` take ``--ckpt best`` / ``--ckpt last`` with the fit config,
    found as ``--ckpt_path last`` finds its file; without the config, or without such a file, one line says so."""
    import torch
    from helpers.files import write_tree

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(BEST_CONFIG)
    cli = in_process("fit", "--config", "cfg.yaml")
    folder = tmp_path / "runs/tiny/version_0/checkpoints"
    best = torch.load(folder / "best-knn.ckpt", weights_only=True)
    scores = [c for c in cli.trainer.checkpoint_callbacks if c.monitor == "val/knn_acc1"][0].best_model_score
    assert best["global_step"] in (4, 12) and float(scores) == pytest.approx(float(best["callbacks"][
        next(k for k in best["callbacks"] if "val/knn_acc1" in k)]["best_model_score"]))  # fmt: skip
    capsys.readouterr()
    for word, name in (("best", "best-knn.ckpt"), ("last", "last.ckpt")):
        assert cli_main("export", "--ckpt", word, "--config", "cfg.yaml", "--out", f"{word}.pt") == 0
        assert f"--ckpt {word}: {(folder / name).relative_to(tmp_path)}" in capsys.readouterr().err
    for a, b in zip(torch.load("best.pt").values(), torch.load(folder / "best-knn.ckpt")["state_dict"].values()):
        assert torch.equal(a, b)
    images = write_tree(tmp_path / "images", n_per_class=2, splits=("train",)) / "train"
    assert cli_main("embed", "--ckpt", "best", "--config", "cfg.yaml", "--data", str(images), "--out", "emb",
                    "--num_workers", "0") == 0  # fmt: skip
    assert (tmp_path / "emb" / "features.npy").exists()
    assert cli_main("evaluate", "--ckpt", "best", "--out", "ev") == 2
    assert "--ckpt best: give the fit config with --config" in capsys.readouterr().err
    (folder / "best-knn.ckpt").unlink()
    assert cli_main("evaluate", "--ckpt", "best", "--config", "cfg.yaml", "--out", "ev") == 2
    assert "--ckpt best: no readable best-knn.ckpt under" in capsys.readouterr().err


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_a_queue_larger_than_the_data_is_warned_through_the_cli(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        two_steps("quickstart.yaml", 32, 256, 64, "--model.queue_size=1024")
    said = [str(w.message) for w in caught if "training images" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("MoCo: queue_size=1024 against 256 training images")
