"""Checkpoints are read weights-only: a downloaded checkpoint cannot run code through any entry point.

The crafted file is a real checkpoint (a tiny MoCo run) with one extra hyper-parameter whose unpickling would call
``open(MARKER, "w")`` (``io.open``): through every entry point it is refused in one line naming the file and the
global it asks for, and the marker file never appears; ``MOCO_LIGHTNING_ALLOW_PICKLE=1`` (documented, off by
default) loads it.
"""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest
import torch
import yaml
from helpers.cli import in_process

from moco_lightning import MoCo, Pretraining, load_backbone
from moco_lightning.cli import run_cli
from moco_lightning.constants import FORMAT_VERSION
from moco_lightning.errors import ConfigError
from moco_lightning.training.checkpoint_io import ALLOW_PICKLE, read_checkpoint

ROOT = Path(__file__).resolve().parents[1]
LEGACY = Path(__file__).parent / "fixtures" / "format2" / "MoCo.ckpt"


class Payload:
    """Unpickled, it creates ``path``: what a malicious checkpoint would do (with a command instead)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return builtins.open, (self.path, "w")


@pytest.fixture
def evil(tmp_path):
    """(crafted checkpoint, crafted export, marker path)."""
    marker = tmp_path / "MARKER"
    checkpoint = torch.load(LEGACY, weights_only=True)
    checkpoint["hyper_parameters"]["note"] = Payload(marker)
    torch.save(checkpoint, tmp_path / "evil.ckpt")
    export = {k[len("backbone.") :]: v for k, v in checkpoint["state_dict"].items() if k.startswith("backbone.")}
    export["note"] = Payload(marker)
    torch.save(export, tmp_path / "evil.pt")
    assert not marker.exists()
    return tmp_path / "evil.ckpt", tmp_path / "evil.pt", marker


def refused(text: str, path: Path) -> bool:
    return f"{path}: refused: loading it needs pickle to import io.open" in text and ALLOW_PICKLE in text


def test_the_reader_refuses_a_file_that_needs_pickle_and_the_opt_in_loads_it(evil, monkeypatch):
    ckpt, export, marker = evil
    for path in (ckpt, export):
        with pytest.raises(ConfigError) as error:
            read_checkpoint(path, expect="either")
        assert refused(str(error.value), path) and "\n" not in str(error.value)
    assert not marker.exists()
    monkeypatch.setenv(ALLOW_PICKLE, "1")  # the documented opt-in, for a trusted source
    read_checkpoint(ckpt)
    assert marker.exists()


def test_export_load_backbone_and_load_from_checkpoint_refuse_it(evil, tmp_path, capsys):
    from moco_lightning.cli.export import main as export
    from moco_lightning.downstream.linear_eval import LinearClassifier

    ckpt, pt, marker = evil
    with pytest.raises(SystemExit) as exit_:
        export(["--ckpt", str(ckpt), "--out", str(tmp_path / "backbone.pt")])
    assert exit_.value.code == 2 and refused(capsys.readouterr().err, ckpt)
    assert not (tmp_path / "backbone.pt").exists()
    for load, path in (
        (lambda p: load_backbone(p), pt),
        (lambda p: MoCo.load_from_checkpoint(p), ckpt),
        (lambda p: LinearClassifier.load_from_checkpoint(p), ckpt),
        (lambda p: LinearClassifier(ckpt_path=str(p)), ckpt),
        (lambda p: LinearClassifier(backbone_state_dict=str(p)), pt),
    ):
        with pytest.raises(ConfigError) as error:
            load(path)
        assert refused(str(error.value), path)
    assert not marker.exists()


def test_the_cli_fit_validate_and_linear_eval_refuse_it(evil, tmp_path, monkeypatch, capsys):
    from moco_lightning.downstream.linear_eval import LinearClassifier

    ckpt, pt, marker = evil
    monkeypatch.chdir(tmp_path)
    quickstart = str(ROOT / "configs" / "quickstart.yaml")
    low_label, linear = str(ROOT / "configs" / "low_label.yaml"), str(ROOT / "configs" / "linear_eval.yaml")
    commands = [
        (Pretraining, ["fit", "--config", quickstart, "--ckpt_path", str(ckpt)]),
        (Pretraining, ["validate", "--config", quickstart, "--ckpt_path", str(ckpt)]),
        (LinearClassifier, ["fit", "--config", low_label, "--model.ckpt_path", str(ckpt)]),
        (LinearClassifier, ["fit", "--config", linear, "--model.backbone_state_dict", str(pt)]),
    ]
    for model_class, args in commands:
        with pytest.raises(SystemExit) as exit_:
            run_cli(model_class, args, default_model=MoCo if model_class is Pretraining else None)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 2, err
        assert refused(err, ckpt if "evil.ckpt" in " ".join(args) else pt), err
    assert not marker.exists()


def test_the_trainer_reads_ckpt_path_weights_only_even_when_asked_for_pickle(evil, tmp_path):
    """Python users' Trainer.fit(ckpt_path=...): the module makes the Trainer read through the safe reader, whatever
    weights_only the call passes (Lightning's own default is full pickle)."""
    from helpers.data import tiny_data
    from helpers.trainers import cpu_trainer

    ckpt, _, marker = evil
    model = MoCo(backbone="resnet18", width=0.0625, in_channels=1, image_size=28, cifar_stem=True, hidden_dim=16,
                 dim=8, queue_size=32, bn_splits=2)  # fmt: skip
    with pytest.raises(ConfigError, match="refused: loading it needs pickle to import io.open"):
        cpu_trainer(max_steps=3, limit_val_batches=0).fit(model, tiny_data(), ckpt_path=ckpt, weights_only=False)
    assert not marker.exists()


def test_ckpt_path_last_skips_a_refused_newest_checkpoint_saying_why(evil, tmp_path, monkeypatch, capsys):
    ckpt, _, marker = evil
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "older.ckpt").write_bytes(LEGACY.read_bytes())
    (folder / "last.ckpt").write_bytes(ckpt.read_bytes())
    config = dict(
        trainer=dict(accelerator="cpu", max_steps=3, enable_progress_bar=False, limit_val_batches=0,
                     num_sanity_val_steps=0, logger={"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                                     "init_args": {"save_dir": "runs", "name": "tiny"}}),
        model=dict(backbone="resnet18", width=0.0625, in_channels=1, image_size=28, cifar_stem=True, hidden_dim=16,
                   dim=8, queue_size=32, bn_splits=2),
        data={"class_path": "moco_lightning.datamodules.FashionMNISTDataModule",
              "init_args": dict(batch_size=16, train_subset=64, val_subset=16)},
    )  # fmt: skip
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    cli = in_process(*["fit", "--config", "cfg.yaml", "--ckpt_path", "last"])
    err = capsys.readouterr().err
    assert "last.ckpt could not be used (refused: loading it needs pickle" in err and "resuming" in err
    assert cli.trainer.global_step == 3 and not marker.exists()


@pytest.mark.parametrize("name", ["MoCo", "MoCoV3", "EndToEnd", "MemoryBankMoCo", "SimCLR", "BYOL", "SwAV"])
def test_the_previous_formats_checkpoints_load_weights_only(name):
    checkpoint = read_checkpoint(Path(__file__).parent / "fixtures" / "format2" / f"{name}.ckpt")
    meta = checkpoint["moco_lightning"]  # read weights-only, and upgraded to today's format by the reader
    assert meta["upgraded_from"] == 2 and meta["format_version"] == FORMAT_VERSION and checkpoint["global_step"] == 2


# --- a resumed run keeps its logs ----------------------------------------------------------------
LOGGED_RUN = """
seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: {steps}
  max_epochs: -1
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  num_sanity_val_steps: 0
  limit_val_batches: 1
  logger:
    class_path: {logger}
    init_args: {{save_dir: "{root}", name: run, version: 0}}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: "{root}/ckpt", every_n_train_steps: 1, save_top_k: -1, filename: "{{step}}"}}
    - class_path: moco_lightning.callbacks.KNNMonitor
      init_args: {{k: 5}}
model:
  backbone: resnet18
  width: 0.0625
  in_channels: 1
  image_size: 28
  hidden_dim: 16
  dim: 8
  queue_size: 32
  lr_schedule: constant
data:
  class_path: moco_lightning.datamodules.FashionMNISTDataModule
  init_args: {{batch_size: 16, train_subset: 64, val_subset: 32}}
"""


def _history(folder: Path, logger: str) -> list:
    """Every row of a CSVLogger's metrics.csv, or every scalar TensorBoard shows for the version (it reads all the
    events files of the folder, dropping the steps a restarted writer logs again)."""
    import csv

    version = folder / "run" / "version_0"
    if logger == "csv":
        with open(version / "metrics.csv", newline="") as f:
            return list(csv.DictReader(f))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(version))
    events.Reload()
    tags = [t for t in sorted(events.Tags()["scalars"]) if t != "hp_metric"]  # Lightning's placeholder: -1 at step 0
    return [(tag, e.step, e.value) for tag in tags for e in events.Scalars(tag)]


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
@pytest.mark.parametrize("logger", ["csv", "tensorboard"])
def test_a_resumed_run_keeps_the_whole_history_of_its_logger(logger, tmp_path, monkeypatch):
    """A run stopped after step 7 (rows logged up to step 6) and resumed from its step-5 checkpoint into the same
    version ends with the same history, row for row and value for value, as the run never stopped: the rows before
    the checkpoint are kept (Lightning's CSV writer deleted them), the ones after it are logged again, once."""
    import warnings

    monkeypatch.chdir(tmp_path)
    cls = {"csv": "lightning.pytorch.loggers.CSVLogger", "tensorboard": "lightning.pytorch.loggers.TensorBoardLogger"}

    def fit(root: Path, steps: int, *extra: str) -> None:
        config = tmp_path / f"{root.name}_{steps}.yaml"
        config.write_text(LOGGED_RUN.format(steps=steps, logger=cls[logger], root=root))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            in_process(*["fit", "--config", str(config), *extra])

    fit(tmp_path / "straight", 8)
    fit(tmp_path / "stopped", 7)
    stopped = _history(tmp_path / "stopped", logger)
    fit(tmp_path / "stopped", 8, "--ckpt_path", str(tmp_path / "stopped" / "ckpt" / "step=5.ckpt"))
    straight, resumed = _history(tmp_path / "straight", logger), _history(tmp_path / "stopped", logger)
    assert len(straight) > 8 and resumed == straight
    steps = {int(float(r["step"])) for r in stopped} if logger == "csv" else {s for _, s, _ in stopped}
    assert max(steps) == 6  # the stopped run had logged past the checkpoint it is resumed from


def test_a_checkpoint_of_another_method_is_one_line_in_python_fit_too(tmp_path):
    """``Trainer.fit(MoCo(...), ckpt_path=<a SimCLR checkpoint>)`` written from Python (no CLI class path in its
    hyper-parameters): one line naming both classes, as the CLI gives, not torch's list of missing keys."""
    from helpers.data import tiny_data
    from helpers.models import tiny_moco
    from helpers.trainers import cpu_trainer

    from moco_lightning import SimCLR

    simclr = SimCLR(backbone="resnet18", width=0.0625, in_channels=1, image_size=28, hidden_dim=16, dim=8)
    trainer = cpu_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(simclr, tiny_data())
    trainer.save_checkpoint(tmp_path / "simclr.ckpt")
    with pytest.raises(ConfigError) as error:
        cpu_trainer(max_steps=2, limit_val_batches=0).fit(tiny_moco(), tiny_data(), ckpt_path=tmp_path / "simclr.ckpt")
    message = str(error.value)
    assert (
        "MoCo: the checkpoint is a moco_lightning.methods.simclr.SimCLR run, not a moco_lightning.methods.moco.MoCo one"
        in message
    )
    assert "\n" not in message and "Missing key" not in message
    with pytest.raises(
        ConfigError,
        match="simclr.ckpt: the checkpoint is a moco_lightning.methods.simclr.SimCLR run, not a "
        "moco_lightning.methods.moco.MoCo one: load it with SimCLR.load_from_checkpoint",
    ):
        MoCo.load_from_checkpoint(tmp_path / "simclr.ckpt")


@pytest.mark.parametrize("method", ["MoCo", "SimCLR"])
def test_the_last_step_of_a_run_is_in_last_ckpt_whatever_the_saving_interval(method, tmp_path):
    """A checkpoint every 3 steps (or every few minutes) of a 8-step run: Lightning's last.ckpt held step 6; the
    run's last step is saved too."""
    from helpers.data import tiny_data
    from helpers.models import tiny_moco
    from helpers.trainers import cpu_trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    import moco_lightning

    model = tiny_moco() if method == "MoCo" else moco_lightning.SimCLR(backbone=tiny_moco().backbone, hidden_dim=16,
                                                                       dim=8, in_channels=1, image_size=28)  # fmt: skip
    saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_last=True)
    trainer = cpu_trainer(max_steps=8, max_epochs=-1, callbacks=[saving], enable_checkpointing=True,
                          limit_val_batches=0)  # fmt: skip
    trainer.fit(model, tiny_data())
    last = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert last["global_step"] == 8
    for key, value in model.state_dict().items():
        assert torch.equal(value, last["state_dict"][key]), key


@pytest.mark.parametrize("cls,old", [("MoCo", "queue."), ("MemoryBankMoCo", "memory_bank.")])
def test_a_format_3_checkpoint_with_the_dictionary_under_its_old_name_reloads_and_resumes(cls, old, tmp_path, seeded):
    """Format 3 (main before the one step protocol) saved the dictionary as ``queue`` / ``memory_bank``."""
    from helpers.data import tiny_data
    from helpers.models import tiny_backbone, tiny_moco
    from helpers.trainers import cpu_trainer

    import moco_lightning

    extra = dict(memory_bank_size=64, num_negatives=8) if cls == "MemoryBankMoCo" else {}
    model = tiny_moco(getattr(moco_lightning, cls), **extra)
    trainer = cpu_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(model, tiny_data())
    trainer.save_checkpoint(tmp_path / "now.ckpt")
    checkpoint = torch.load(tmp_path / "now.ckpt", weights_only=True)
    state = checkpoint["state_dict"]
    dictionary = {k: v for k, v in state.items() if k.startswith("dictionary.")}
    assert dictionary
    for key in dictionary:
        state[old + key.split(".", 1)[1]] = state.pop(key)
    checkpoint["moco_lightning"]["format_version"] = 3
    torch.save(checkpoint, tmp_path / "format3.ckpt")

    loaded = getattr(moco_lightning, cls).load_from_checkpoint(tmp_path / "format3.ckpt", backbone=tiny_backbone())
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    resumed = tiny_moco(getattr(moco_lightning, cls), **extra)
    cpu_trainer(max_steps=3, limit_val_batches=0).fit(resumed, tiny_data(), ckpt_path=tmp_path / "format3.ckpt")
    assert resumed.global_step == 3
    assert not torch.equal(resumed.state_dict()[next(iter(dictionary))], dictionary[next(iter(dictionary))])
