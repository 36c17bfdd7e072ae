"""``precision: auto``: bf16-mixed where bf16 is native (CUDA with bf16, a CPU with AMX), else 32-true, said in one
line; through the CLI's Trainer and the public helper, with the hardware probes mocked both ways."""

import pytest

import moco_lightning.training.precision as precision
from moco_lightning.training.precision import AutoPrecisionTrainer, auto_precision


@pytest.mark.parametrize(
    "instructions, expected", [("AMX", "bf16-mixed"), ("AVX512-BF16", "bf16-mixed"), (None, "32-true")]
)
def test_auto_on_the_cpu_follows_its_bf16_instructions(instructions, expected, monkeypatch, capsys):
    monkeypatch.setattr(precision, "cpu_bf16", lambda: instructions)
    monkeypatch.setattr(precision.torch.cuda, "is_available", lambda: False)
    assert auto_precision("cpu") == expected
    line = capsys.readouterr().err.strip()
    assert line == f"moco-lightning: precision auto: {expected} (CPU, " + (
        f"{instructions} bf16 instructions)"
        if instructions
        else "no AMX or AVX512-BF16: bf16 would be emulated, slower)"
    )


def test_the_cpu_probe_reads_the_flags(monkeypatch, tmp_path):
    for flags, found in (
        ("fpu avx2 amx_bf16 avx512_bf16", "AMX"),
        ("avx512f avx512_bf16", "AVX512-BF16"),
        ("avx2", None),
    ):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor : 0\nflags : {flags}\n")
        monkeypatch.setattr(precision, "Path", lambda _, path=cpuinfo: path)
        assert precision.cpu_bf16() == found


@pytest.mark.parametrize("bf16, expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_auto_on_a_gpu_follows_its_bf16_support(bf16, expected, monkeypatch):
    monkeypatch.setattr(precision.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(precision.torch.cuda, "get_device_name", lambda: "H200")
    monkeypatch.setattr(precision, "cuda_has_bf16", lambda: bf16)
    monkeypatch.setattr(precision, "cpu_bf16", lambda: None if bf16 else "AMX")  # the CPU's answer must not matter
    assert auto_precision("auto", verbose=False) == expected
    assert auto_precision("cpu", verbose=False) == ("32-true" if bf16 else "bf16-mixed")  # accelerator cpu: the CPU


@pytest.mark.parametrize("amx", [True, False])
def test_the_clis_trainer_takes_precision_auto(amx, monkeypatch, tmp_path):
    from moco_lightning import MoCo, Pretraining
    from moco_lightning.cli import run_cli

    monkeypatch.setattr(precision, "cpu_bf16", lambda: "AMX" if amx else None)
    monkeypatch.chdir(tmp_path)
    cli = run_cli(
        Pretraining,
        ["fit", "--config", str(precision_config(tmp_path)), "--trainer.precision", "auto", "--trainer.fast_dev_run=1"],
        default_model=MoCo,
    )
    assert isinstance(cli.trainer, AutoPrecisionTrainer) and cli.trainer.global_step == 1
    assert str(cli.trainer.precision) == ("bf16-mixed" if amx else "32-true")


def precision_config(folder):
    path = folder / "tiny.yaml"
    path.write_text(
        "trainer: {accelerator: cpu, logger: false, enable_progress_bar: false, callbacks: []}\n"
        "model: {backbone: resnet18, width: 0.0625, in_channels: 1, image_size: 28, hidden_dim: 16, dim: 8,"
        " queue_size: 32, shuffle_bn: 'off'}\n"
        "data: {class_path: moco_lightning.datamodules.FashionMNISTDataModule,"
        " init_args: {batch_size: 16, train_subset: 32, val_subset: 16}}\n"
    )
    return path
