"""Resume after a crash, the NaN guard, checkpoint compatibility, export for downstream use."""

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torchvision
from helpers.cli import run_module_forked, subprocess_env
from helpers.data import tiny_data
from helpers.models import tiny_moco
from helpers.trainers import cpu_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from moco_lightning import MoCo
from moco_lightning.downstream.export import backbone_state_dict, export_backbone
from moco_lightning.training.run_state import FORMAT_VERSION

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  max_epochs: 2
  logger: false
  enable_progress_bar: false
  num_sanity_val_steps: 0
  limit_val_batches: 1
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: "{ckpt_dir}", every_n_train_steps: 2, save_last: true, save_top_k: -1}}
{kill}
model:
  backbone: resnet18
  width: 0.25
  in_channels: 1
  image_size: 28
  hidden_dim: 32
  dim: 16
  queue_size: 40
  momentum: 0.9
  bn_splits: 2
data:
  class_path: moco_lightning.datamodules.FashionMNISTDataModule
  init_args: {{batch_size: 16, train_subset: 160, val_subset: 16}}
"""


def _final_state(path: Path) -> dict:
    """Everything a resumed run must reproduce: weights and buffers (queue), optimizer and schedule, the loops'
    progress, each rank's global RNGs and augmentation generator."""
    c = torch.load(path, map_location="cpu", weights_only=True)
    return {
        "state_dict": c["state_dict"],
        "optimizer_states": c["optimizer_states"],
        "lr_schedulers": c["lr_schedulers"],
        "global_step": c["global_step"],
        "epoch": c["epoch"],
        "rng_states": c["moco_lightning"]["rng_states"],
        "datamodule": c["FashionMNISTDataModule"],
    }


def _assert_equal(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


# ``moco-lightning fit`` runs as a process of its own (killed, signalled), forked from this one with a fresh
# interpreter's environment (``subprocess_env``: one torch thread) but not its ~8 s of imports; the second rank of a
# 2-process run is a fresh interpreter (Lightning starts it with ``python -m``)
CB = "    - class_path: helpers.callbacks."  # a callback of the config, at a step
INTERRUPTIONS = {  # how a run is stopped mid-epoch: (callback, the exit code, the step of the checkpoint it leaves)
    "kill -9": (CB + "KillAt\n      init_args: {{step: 7}}", -signal.SIGKILL, lambda d: 6),
    # a preemption noted at the end of step 7 on the last rank: one process saves at that step; with several, the
    # ranks agree through the NaN guard's all-reduce, read by every rank at step 8's checkpoint save (every 2 steps
    # here), and SaveOnSignal, which runs before ModelCheckpoint in a step, saves on every rank at the end of step 9
    "SIGTERM": (CB + "SignalAt\n      init_args: {{step: 7, signum: SIGTERM, rank: {last}}}", 0,
                lambda d: 7 if d == 1 else 9),
    "SIGINT": (CB + "SignalAt\n      init_args: {{step: 7, signum: SIGINT}}", 1, lambda d: 7),
}  # fmt: skip


@pytest.mark.slow  # a subprocess / several processes
@pytest.mark.parametrize("devices", [1, 2])
def test_killed_or_preempted_anywhere_the_resumed_run_is_bit_equal_to_the_uninterrupted_one(devices, tmp_path):
    """SIGKILL at the end of step 7 (mid-epoch: 10 steps an epoch with one process, 5 with two; the last checkpoint
    is step 6's), by a callback of the run itself (no sleeps, no polling: the same on a fast or a slow machine), then
    ``--ckpt_path last``: the final weights, queue, optimizer, schedule, RNGs and augmentation generators are
    bit-equal to a run that was never killed, and Lightning does not warn that the loader is not resumable (the
    resumed epoch skips the 6 batches it had trained on instead of training on its first batches again).
    A preemption (SIGTERM on one rank; Ctrl-C's SIGINT) saves ``last.ckpt`` at a step boundary and exits cleanly,
    saying so; resumed, it too ends bit-equal."""
    ddp = (
        "  devices: 2\n  strategy:\n    class_path: lightning.pytorch.strategies.DDPStrategy\n"
        "    init_args: {find_unused_parameters: false}\n"
        if devices == 2
        else ""
    )
    steps = 20 // devices  # 2 epochs

    def fit(name: str, interrupt: str, *extra: str) -> subprocess.CompletedProcess:
        config = tmp_path / f"{name}.yaml"
        stop = INTERRUPTIONS[interrupt][0].format(last=devices - 1) if interrupt else ""
        text = CONFIG.format(ckpt_dir=tmp_path / name, kill=stop)
        config.write_text(text.replace("trainer:\n", "trainer:\n" + ddp, 1))
        args = ["fit", "--config", str(config), *extra]
        return run_module_forked("moco_lightning", args, tmp_path, 600, subprocess_env())

    whole = fit("whole", "")
    assert whole.returncode == 0, whole.stderr[-3000:]
    at_stop = {}
    for interrupt in ("kill -9", "SIGTERM") if devices == 2 else INTERRUPTIONS:  # SIGINT after SIGTERM
        name = interrupt.replace(" ", "").replace("-", "")
        _, code, saved_at = INTERRUPTIONS[interrupt]
        stopped = fit(name, interrupt)
        assert stopped.returncode == code, (interrupt, stopped.stderr[-2000:])
        last = tmp_path / name / "last.ckpt"
        assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == saved_at(devices), interrupt
        at_stop[interrupt] = _final_state(last)
        if interrupt != "kill -9":
            said = f"moco-lightning: {interrupt} at step {saved_at(devices)}: saved a resumable checkpoint to {last}"
            assert said in stopped.stderr, stopped.stderr[-2000:]
        if interrupt == "SIGINT":  # the same step boundary as SIGTERM's: the same state, whose resume is tested
            _assert_equal(at_stop["SIGINT"], at_stop["SIGTERM"], "SIGINT vs SIGTERM")
            continue
        resumed = fit(name, "", "--ckpt_path", "last")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"Restored all states from the checkpoint at {last}" in resumed.stderr + resumed.stdout
        assert "not resumable" not in resumed.stderr and "not resumable" not in resumed.stdout
        final = _final_state(last)
        assert final["global_step"] == steps and final["epoch"] == 1
        # the restored run carried the queue on: every step after the stop enqueued its 16 x devices keys
        assert final["state_dict"]["dictionary.ptr"].item() == (steps * 16 * devices) % 40
        assert final["state_dict"]["dictionary.enqueued_at"].max().item() == steps
        _assert_equal(final, _final_state(tmp_path / "whole" / "last.ckpt"), f"{interrupt}: checkpoint")


@pytest.mark.slow  # a subprocess / several processes
def test_slurm_requeue_saves_at_a_step_boundary_and_the_requeued_job_continues_bit_equal(tmp_path):
    """Under SLURM with auto-requeue, SIGUSR1 at the end of step 7: Lightning's requeue (hpc_ckpt_1.ckpt,
    ``scontrol requeue <job>``) runs at that step boundary instead of inside the signal handler mid-step; the
    requeued job (the same command, no --ckpt_path) restores it and ends bit-equal to the run never stopped."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    slurm = dict(SLURM_NTASKS="1", SLURM_JOB_NAME="pretrain", SLURM_JOB_ID="4242", SLURM_PROCID="0",
                 SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="localhost")  # fmt: skip

    def fit(name: str, signal_at: bool, on_slurm: bool) -> subprocess.CompletedProcess:
        config = tmp_path / f"{name}.yaml"
        stop = (
            "    - class_path: helpers.callbacks.SignalAt\n      init_args: {step: 7, signum: SIGUSR1}"
            if signal_at
            else ""
        )
        text = CONFIG.format(ckpt_dir=tmp_path / name, kill=stop)
        config.write_text(text.replace("trainer:\n", f"trainer:\n  default_root_dir: {tmp_path / name}\n", 1))
        env = subprocess_env(**slurm, PATH=f"{bin_dir}:{os.environ['PATH']}") if on_slurm else subprocess_env()
        return run_module_forked("moco_lightning", ["fit", "--config", str(config)], tmp_path, 600, env)

    whole = fit("whole", False, False)
    assert whole.returncode == 0, whole.stderr[-3000:]
    stopped = fit("slurm", True, True)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    hpc = tmp_path / "slurm" / "hpc_ckpt_1.ckpt"
    assert torch.load(hpc, map_location="cpu", weights_only=True)["global_step"] == 7
    assert f"SIGUSR1 at step 7: saved a resumable checkpoint to {hpc}" in stopped.stderr
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    requeued = fit("slurm", False, True)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"Restored all states from the checkpoint at {hpc}" in requeued.stderr + requeued.stdout
    final = _final_state(tmp_path / "slurm" / "last.ckpt")
    assert final["global_step"] == 20
    _assert_equal(final, _final_state(tmp_path / "whole" / "last.ckpt"), "checkpoint")


def test_nan_loss_stops_with_a_message_and_leaves_the_last_checkpoint_loadable(seeded, tmp_path):
    model = tiny_moco()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = cpu_trainer(max_epochs=1, callbacks=[checkpoint], enable_checkpointing=True, limit_val_batches=0)
    original = model.views_loss

    def poisoned(*views_and_index):
        out = original(*views_and_index)
        if trainer.global_step == 2:
            out["loss"] = out["loss"] * float("nan")
        return out

    model.views_loss = poisoned
    with pytest.raises(
        FloatingPointError, match=r"loss is nan at global step 2 \(epoch 0, batch 2\).*lr=0.06.*temperature=0.2"
    ):
        trainer.fit(model, tiny_data())
    saved = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert saved == ["step=1.ckpt", "step=2.ckpt"]
    good = MoCo.load_from_checkpoint(tmp_path / "step=2.ckpt", backbone=tiny_moco().backbone)
    assert all(torch.isfinite(p).all() for p in good.parameters())


class NanPixels(torch.utils.data.Dataset):
    """Two-view items of random images; item 20 (in the second batch of 16) holds a NaN pixel, or an inf one."""

    def __init__(self, bad: float) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        views = [torch.randn(1, 28, 28, generator=g) for _ in range(2)]
        if i == 20:
            views[1][0, 3, 4] = self.bad
        return views, 0, i


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("method", ["MoCo", "SimCLR"])
def test_non_finite_pixels_are_named_as_the_cause_not_the_lr(seeded, method, bad):
    """A batch with a NaN or inf pixel: the error says the batch holds non-finite values (the contrastive family's
    step and the base step alike), not "a learning rate too high ... try 32" while running at 32-true."""
    from lightning.pytorch import LightningDataModule

    import moco_lightning

    model = tiny_moco() if method == "MoCo" else moco_lightning.SimCLR(backbone=tiny_moco().backbone, hidden_dim=16,
                                                                       dim=8, in_channels=1, image_size=28)  # fmt: skip
    data = LightningDataModule.from_datasets(train_dataset=NanPixels(bad), batch_size=16)
    with pytest.raises(FloatingPointError) as error:
        cpu_trainer(max_epochs=1, limit_val_batches=0).fit(model, data)
    message = str(error.value)
    assert re.match(
        rf"{method}: the training batch at global step (\d) \(epoch 0, batch \1\) holds non-finite values", message
    )
    assert "learning rate" not in message and "mean and std" in message


def test_a_non_finite_loss_at_full_precision_does_not_suggest_full_precision(seeded):
    model = tiny_moco()
    trainer = cpu_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(model, tiny_data())
    assert "fp16" not in model.nan_hints() and "32-true" not in model.nan_hints()


def test_nan_loss_can_skip_the_batch(seeded):
    model = tiny_moco(on_nan="skip", queue_size=64)
    original = model.views_loss
    calls = []

    def poisoned(*views_and_index):
        out = original(*views_and_index)
        calls.append(1)
        if len(calls) == 2:
            out["loss"] = out["loss"] * float("inf")
        return out

    model.views_loss = poisoned
    trainer = cpu_trainer(max_epochs=1, limit_val_batches=0)
    with pytest.warns(UserWarning, match="loss is inf at global step 1.*batch skipped"):
        trainer.fit(model, tiny_data())
    # Lightning still counts the optimizer call of the skipped batch (it has no gradients, so SGD leaves the weights)
    assert trainer.global_step == 4
    # the skipped batch's keys were not enqueued: keys of 3 batches, written at steps 1, 3 and 4
    assert model.dictionary.ptr.item() == 3 * 16
    assert set(model.dictionary.enqueued_at.tolist()) == {-1, 1, 3, 4}


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_checkpoint_mismatch_says_what_differs(seeded, tmp_path):
    model = tiny_moco(backbone="resnet18", hidden_dim=16)
    trainer = cpu_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(model, tiny_data())
    path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(path)
    other = tiny_moco(backbone="resnet18", hidden_dim=16, queue_size=64, dim=4)
    with pytest.raises(ValueError, match=r"dim: checkpoint 8, model 4; queue_size: checkpoint 32, model 64"):
        cpu_trainer(max_steps=2, limit_val_batches=0).fit(other, tiny_data(), ckpt_path=path)
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["moco_lightning"]["format_version"] == FORMAT_VERSION
    checkpoint["moco_lightning"]["format_version"] = FORMAT_VERSION + 1
    torch.save(checkpoint, tmp_path / "future.ckpt")
    with pytest.raises(
        ValueError, match=rf"checkpoint format {FORMAT_VERSION + 1} .* is newer than this moco-lightning"
    ):
        MoCo.load_from_checkpoint(tmp_path / "future.ckpt")


def test_exported_backbone_loads_strictly_into_torchvision_and_gives_the_same_features(seeded, tmp_path, capsys):
    model = MoCo(backbone="resnet18", in_channels=1, queue_size=16, dim=8, hidden_dim=16, shuffle_bn="off")
    trainer = cpu_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(model, tiny_data(batch_size=8, train_subset=16, val_subset=8))
    ckpt = tmp_path / "m.ckpt"
    trainer.save_checkpoint(ckpt)
    out = export_backbone(ckpt, tmp_path / "backbone.pt")
    fresh = torchvision.models.resnet18()
    fresh.conv1 = torch.nn.Conv2d(1, 64, 7, 2, 3, bias=False)  # the grayscale stem it was trained with
    fresh.fc = torch.nn.Identity()
    fresh.load_state_dict(torch.load(out), strict=True)
    fresh.eval()
    model.eval()
    x = torch.randn(4, 1, 28, 28)
    assert torch.equal(fresh(x), model(x))
    key = backbone_state_dict(ckpt, "key")
    assert not torch.equal(key["conv1.weight"], model.backbone.conv1.weight)  # the key encoder lags behind

    def export(*args: str) -> tuple[int, str, str]:  # the command line's main, in this process (no 10 s of imports)
        from moco_lightning.cli import main

        capsys.readouterr()
        try:
            main(["export", *args])
            code = 0
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = export("--ckpt", str(ckpt), "--out", str(tmp_path / "k.pt"), "--encoder", "key")
    assert code == 0 and "key encoder backbone" in out
    assert torch.equal(torch.load(tmp_path / "k.pt")["conv1.weight"], key["conv1.weight"])
    code, _, err = export("--ckpt", str(tmp_path / "nope.ckpt"), "--out", "x.pt")
    assert code == 2 and "nope.ckpt: no such file" in err
    for out, says in ((tmp_path, "is a directory"), (Path("/proc/no/backbone.pt"), "cannot write there")):
        code, _, err = export("--ckpt", str(ckpt), "--out", str(out))
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_an_export_says_what_it_holds_and_load_backbone_rebuilds_it(seeded, tmp_path):
    """The quickstart's narrow grayscale ResNet-18: torchvision's resnet18() does not fit it, load_backbone does,
    from the file alone (its _metadata names backbone, width, channels, stem), giving the module's features."""
    from moco_lightning import load_backbone

    model = MoCo(
        backbone="resnet18", width=0.5, in_channels=1, image_size=28, queue_size=16, dim=8, hidden_dim=16, bn_splits=2
    )
    trainer = cpu_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(model, tiny_data(batch_size=8, train_subset=16, val_subset=8))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    out = export_backbone(tmp_path / "m.ckpt", tmp_path / "backbone.pt")
    state = torch.load(out)
    assert state._metadata["moco_lightning"] == {
        "backbone": "resnet18",
        "cifar_stem": False,
        "in_channels": 1,
        "image_size": 28,
        "width": 0.5,
        "stem": None,  # cifar_stem decides
    }
    backbone = load_backbone(out).eval()
    model.eval()
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(backbone(x), model(x))
    torch.save(dict(state), tmp_path / "plain.pt")  # a state dict without the description
    with pytest.raises(ValueError, match="does not say which backbone it holds"):
        load_backbone(tmp_path / "plain.pt")


def test_the_nan_guard_reads_its_flags_at_least_every_max_unread_steps(seeded, monkeypatch):
    """#53: the flags wait on the device for the next logging step, but never more than ``MAX_UNREAD`` of them
    (whatever log_every_n_steps says): what is kept unread stays small."""
    from lightning.pytorch import Callback

    from moco_lightning.training.nan_guard import NanGuard

    monkeypatch.setattr(NanGuard, "MAX_UNREAD", 2)
    kept = []

    class Look(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            kept.append(len(pl_module.nan_guard._pending))

    model = tiny_moco()
    cpu_trainer(limit_val_batches=0, log_every_n_steps=1000, callbacks=[Look()]).fit(model, tiny_data())  # 4 steps
    assert kept == [0, 1, 0, 1]  # seen before NanStop records the step's flag; it reads them after each second step
