"""Every method × every entry point, on tiny data and tiny networks.

Methods: MoCo v1, v2, v2+ (symmetric), v3 with a ResNet and with a ViT, EndToEnd, MemoryBankMoCo, SimCLR, BYOL, SwAV.
Entry points: the CLI from a minimal config (each class's own defaults, the paper's), CLI fit, Python fit (the same
weights as the CLI), a resume from a mid-epoch checkpoint (bit-equal to the run never interrupted), a run that
``max_steps`` stopped mid-epoch extended with ``--ckpt_path`` (bit-equal too), ``load_from_checkpoint``,
``validate``, ``test`` / ``predict`` (one-line refusals), ``export`` + ``load_backbone``, linear evaluation and
low-label fine-tuning from the checkpoint and from the export.

One run per method (8 steps, a checkpoint after each) is shared by that method's tests: they run in
one pytest-xdist group (``--dist loadgroup``), and the run is made once per worker.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from helpers.cli import in_process
from helpers.data import tiny_data
from helpers.distributed import ExitHandlers
from helpers.models import tiny_moco
from helpers.resume import assert_epoch_resume_bit_equal, assert_resumes_bit_equal

import moco_lightning
from moco_lightning.modules import distributed

TINY = dict(backbone="resnet18", width=0.0625, in_channels=1, image_size=28, hidden_dim=16, dim=8)
CONSTANT = dict(lr_schedule="constant", warmup_epochs=0)  # schedules that do not depend on the planned length
VIT = {
    "class_path": "moco_lightning.modules.backbones.ViT",
    "init_args": dict(image_size=28, patch_size=7, in_channels=1, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32),
}
METHODS = {  # name: (class, the tiny run's arguments)
    "moco_v1": ("MoCo", dict(head="linear", temperature=0.07, queue_size=32, momentum=0.99, bn_splits=2)),
    "moco_v2": ("MoCo", dict(queue_size=32, bn_splits=2)),
    "moco_v2plus": ("MoCo", dict(queue_size=32, symmetric=True, bn_splits=2)),
    "moco_v3_resnet": ("MoCoV3", dict(momentum_schedule="constant")),
    "moco_v3_vit": (
        "MoCoV3",
        dict(
            backbone=VIT, width=1.0, optimizer="adamw", lr=1e-3, momentum_schedule="constant", freeze_patch_embed=True
        ),
    ),
    "end_to_end": ("EndToEnd", dict(symmetric=True)),
    "memory_bank": ("MemoryBankMoCo", dict(memory_bank_size=64, num_negatives=16)),
    "simclr": ("SimCLR", {}),
    "byol": ("BYOL", dict(momentum_schedule="constant")),
    "swav": ("SwAV", dict(n_prototypes=10, freeze_prototypes_epochs=0)),
}
MOMENTUM = {"MoCo", "MoCoV3", "BYOL"}  # methods with a momentum copy of the backbone
DATA = {
    "class_path": "moco_lightning.datamodules.FashionMNISTDataModule",
    "init_args": dict(batch_size=16, train_subset=64, val_subset=32, seed=0),
}

# the papers' values, what a config naming only the class gets (the official v1/v2 code, MoCo v3, InstDisc / the MoCo
# paper's Fig. 3 for the other two dictionaries, SimCLR §B.1, BYOL §3.2, SwAV's batch-256 recipe)
DEFAULTS = {
    "MoCo": dict(head="mlp", dim=128, hidden_dim=2048, queue_size=65536, momentum=0.999, momentum_schedule="constant",
                 temperature=0.2, symmetric=False, optimizer="sgd", lr=0.03, weight_decay=1e-4, decay_norm_bias=True,
                 lr_schedule="cosine", warmup_epochs=0.0),
    "MoCoV3": dict(dim=256, hidden_dim=4096, momentum=0.99, momentum_schedule="cosine", temperature=1.0,
                   optimizer="lars", lr=0.6, weight_decay=1e-6, warmup_epochs=10.0, lr_schedule="cosine",
                   shuffle_bn="off", zero_init_residual=True),
    "EndToEnd": dict(head="linear", temperature=0.07, symmetric=False, dim=128, decay_norm_bias=True),
    "MemoryBankMoCo": dict(head="linear", temperature=0.07, num_negatives=4096, bank_momentum=0.5, dim=128),
    "SimCLR": dict(temperature=0.5, hidden_dim=2048, dim=128, optimizer="lars", lr=0.3, weight_decay=1e-6,
                   warmup_epochs=10.0, decay_norm_bias=False),
    "BYOL": dict(momentum=0.996, momentum_schedule="cosine", hidden_dim=4096, dim=256, optimizer="lars", lr=0.2,
                 weight_decay=1.5e-6, warmup_epochs=10.0, decay_norm_bias=False),
    "SwAV": dict(temperature=0.1, n_prototypes=3000, sinkhorn_iterations=3, sinkhorn_epsilon=0.05,
                 freeze_prototypes_epochs=1.0, optimizer="lars", lr=0.6, weight_decay=1e-6, decay_norm_bias=False),
}  # fmt: skip
ABSENT = {  # settings a class must not offer (its mechanism has no such thing)
    "MoCoV3": ("queue_size", "head", "symmetric"),
    "EndToEnd": ("queue_size", "momentum", "momentum_schedule", "shuffle_bn", "bn_splits"),
    "MemoryBankMoCo": ("queue_size", "momentum", "momentum_schedule", "shuffle_bn", "bn_splits"),
    "SimCLR": ("momentum", "queue_size"),
    "SwAV": ("momentum", "queue_size"),
}
SHIPPED = {  # the shipped configs of the MoCo variants: what they must say
    "moco_v1.yaml": dict(head="linear", temperature=0.07, momentum=0.999, queue_size=65536, lr_schedule="step"),
    "moco_v2plus.yaml": dict(symmetric=True, momentum_schedule="cosine", head="mlp"),
    "moco_v3_vit_small.yaml": dict(optimizer="adamw", lr=1.5e-4, weight_decay=0.1, warmup_epochs=40.0),
}

FAST = (
    "moco_v2"  # the fast loop's column (`-m "not slow"`): every entry point for MoCo v2; the full suite, every method
)
GROUPS = [
    pytest.param(m, marks=[pytest.mark.xdist_group(m)] + ([] if m == FAST else [pytest.mark.slow])) for m in METHODS
]
CLASSES = [n if n == "MoCo" else pytest.param(n, marks=pytest.mark.slow) for n in DEFAULTS]  # MoCo's in the fast loop


def cls_of(method: str) -> type:
    return getattr(moco_lightning, METHODS[method][0])


def config(
    method: str, folder: Path, max_steps: int = 8, max_epochs: int = 10, every_step: bool = True, **model_args
) -> Path:
    """The tiny run's config (a checkpoint after every step, step=N.ckpt and last.ckpt; or, not ``every_step``, at
    each epoch's end, as Lightning's default) in ``folder``; ``model_args`` replace the tiny run's."""
    name, args = METHODS[method]
    saving = dict(every_n_train_steps=1, save_top_k=-1, filename="{step}") if every_step else {}
    trainer = dict(
        accelerator="cpu", max_steps=max_steps, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
        default_root_dir=str(folder / "root"),  # where LightningCLI saves the config it ran
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": dict(dirpath=str(folder / "ckpt"), save_last=True, **saving)},
            {"class_path": "helpers.callbacks.RecordSchedules"},
        ],
    )  # fmt: skip
    model = {"class_path": f"moco_lightning.{name}", "init_args": {**TINY, **CONSTANT, **args, **model_args}}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(dict(seed_everything=0, trainer=trainer, model=model, data=DATA)))
    return path


_RUNS: dict = {}


def run(method: str, tmp_path_factory) -> Path:
    """The method's shared run: 8 steps through the CLI (4 steps an epoch), its folder."""
    if method not in _RUNS:
        folder = tmp_path_factory.mktemp(method)
        result = in_process("fit", "--config", str(config(method, folder)))
        assert result.trainer.global_step == 8
        _RUNS[method] = folder
    return _RUNS[method]


def state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_run(a: dict, b: dict) -> None:
    """Weights and buffers (queues, banks, momentum copies) and the optimizer's state bit-equal."""
    assert a["global_step"] == b["global_step"]
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    for i, opt in a["optimizer_states"][0]["state"].items():
        for key, value in opt.items():
            assert torch.equal(value, b["optimizer_states"][0]["state"][i][key]), (i, key)


# --- the CLI from a minimal config: each class's own defaults ----------------------------------
def printed_model(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit):
        in_process("fit", *args, "--print_config")
    return yaml.safe_load(capsys.readouterr().out)["model"]


@pytest.mark.parametrize("name", CLASSES)
def test_a_minimal_config_gets_the_papers_defaults(name, tmp_path, capsys):
    """``fit --print_config`` of a config naming only the class: its paper's defaults; ``from_config`` builds the
    same (#54.2: it gave every class MoCo's defaults where the config left them out)."""
    from moco_lightning.cli import from_config

    minimal = tmp_path / "minimal.yaml"
    minimal.write_text(f"model:\n  class_path: moco_lightning.{name}\n")
    printed = printed_model(capsys, "--config", str(minimal))
    assert printed["class_path"] == f"moco_lightning.{name}"
    got = printed["init_args"]
    assert {k: got[k] for k in DEFAULTS[name]} == DEFAULTS[name]
    assert not set(ABSENT.get(name, ())) & set(got)
    data = "data:\n  class_path: moco_lightning.datamodules.FashionMNISTDataModule\n"
    bank = "  init_args: {memory_bank_size: 100}\n" if name == "MemoryBankMoCo" else ""
    minimal.write_text(f"model:\n  class_path: moco_lightning.{name}\n{bank}{data}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = from_config(minimal)[0]
    assert type(built).__name__ == name
    hparams = {k: v for k, v in built.hparams.items() if not k.startswith("_")}
    printed = {**got, **({"memory_bank_size": 100} if bank else {})}
    assert {k: hparams[k] for k in printed} == {k: _plain_value(v) for k, v in printed.items()}
    if name == "MemoryBankMoCo":  # #54.7: the class's own one-line error, not jsonargparse's Union report
        minimal.write_text(f"model:\n  class_path: moco_lightning.{name}\n{data}")
        with pytest.raises(ValueError, match="^MemoryBankMoCo: memory_bank_size must be the number of training"):
            from_config(minimal)
    if name == "MoCo":  # a config without class_path is MoCo v2
        without = tmp_path / "plain.yaml"
        without.write_text("model:\n  queue_size: 4096\n")
        plain = printed_model(capsys, "--config", str(without))
        assert plain["class_path"] == "moco_lightning.MoCo" and plain["init_args"]["queue_size"] == 4096


def _plain_value(v):
    """A printed config value as the module records it (YAML lists for tuples)."""
    return list(v) if isinstance(v, tuple) else v


@pytest.mark.parametrize("shipped", list(SHIPPED))
def test_the_shipped_variant_configs_say_their_papers_values(shipped, capsys):
    got = printed_model(capsys, "--config", str(Path(__file__).parents[1] / "configs" / shipped))["init_args"]
    assert {k: got[k] for k in SHIPPED[shipped]} == SHIPPED[shipped]


# --- training entry points ---------------------------------------------------------------------
@pytest.mark.parametrize("method", GROUPS)
def test_python_fit_trains_the_weights_the_cli_trains(method, tmp_path_factory, monkeypatch):
    from lightning.pytorch import Trainer, seed_everything

    from moco_lightning.datamodules import FashionMNISTDataModule
    from moco_lightning.modules.backbones import build_from_spec

    cli_run = state(run(method, tmp_path_factory) / "ckpt" / "last.ckpt")
    seed_everything(0, verbose=False)
    args = {**TINY, **CONSTANT, **METHODS[method][1]}
    if isinstance(args["backbone"], dict):
        args["backbone"] = build_from_spec(args["backbone"])
    model = cls_of(method)(**args)
    monkeypatch.setattr(distributed, "atexit", ExitHandlers())
    trainer = Trainer(
        accelerator="cpu", max_steps=8, max_epochs=10, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, FashionMNISTDataModule(**DATA["init_args"]))
    for key, value in model.state_dict().items():
        assert torch.equal(value, cli_run["state_dict"][key]), key
    assert distributed.atexit.handlers == [distributed.end_process_group]  # a DDP rank ends its group before exit


@pytest.mark.parametrize("method", GROUPS)
def test_a_resume_from_a_mid_epoch_checkpoint_is_bit_equal(method, tmp_path_factory, tmp_path):
    """The step-3 checkpoint (epoch 0, batch 3 of 4): what a run killed after it leaves; resumed to step 8."""
    straight = run(method, tmp_path_factory)
    in_process("fit", "--config", str(config(method, tmp_path)), "--ckpt_path", str(straight / "ckpt" / "step=3.ckpt"))
    assert_same_run(state(straight / "ckpt" / "last.ckpt"), state(tmp_path / "ckpt" / "last.ckpt"))


#: the Python-API resumes (the run a user's Trainer makes): warm-up + cosine lr (and BYOL's cosine momentum) continue
#: mid-epoch, SwAV's frozen prototypes too; MoCo's cosine schedules across an epoch's end, and multi-crop's views
PYTHON_RESUMES = {
    "simclr_mid_epoch": lambda tmp: assert_resumes_bit_equal(moco_lightning.SimCLR, tmp),
    "byol_mid_epoch": lambda tmp: assert_resumes_bit_equal(moco_lightning.BYOL, tmp),
    "swav_mid_epoch": lambda tmp: assert_resumes_bit_equal(moco_lightning.SwAV, tmp, freeze_prototypes_epochs=0.5),
    "moco_epoch_end_cosine": lambda tmp: assert_epoch_resume_bit_equal(
        tmp,
        lambda: tiny_moco(momentum_schedule="cosine", lr_schedule="cosine", warmup_epochs=0.5),
        lambda: tiny_data(),
        limit_val_batches=1,
    ),
    "moco_multi_crop": lambda tmp: assert_epoch_resume_bit_equal(
        tmp,
        lambda: tiny_moco(symmetric=True, lr_schedule="cosine"),
        lambda: tiny_data(local_views=2, local_size=14),
        limit_val_batches=0,
    ),
}


@pytest.mark.parametrize("case", PYTHON_RESUMES)
def test_a_resumed_python_run_is_bit_equal(case, tmp_path):
    """The run resumed from its checkpoint ends with the weights, buffers (queue, momentum copy) and optimizer state
    of the run never interrupted (the CLI's mid-epoch resume of every method: the test above)."""
    PYTHON_RESUMES[case](tmp_path)


@pytest.mark.parametrize("method", GROUPS)
def test_extending_a_run_stopped_mid_epoch_continues_that_epoch(method, tmp_path_factory, tmp_path):
    """max_steps 6 stops in epoch 1 after 2 of its 4 batches; extended to 8 with --ckpt_path, steps 7-8 are that
    epoch's batches 3-4: the run ends bit-equal to the one that ran 8 steps at once."""
    in_process("fit", "--config", str(config(method, tmp_path, max_steps=6)))
    assert state(tmp_path / "ckpt" / "last.ckpt")["global_step"] == 6
    in_process("fit", "--config", str(config(method, tmp_path)), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"))
    assert_same_run(state(run(method, tmp_path_factory) / "ckpt" / "last.ckpt"), state(tmp_path / "ckpt" / "last.ckpt"))


@pytest.mark.parametrize("method", GROUPS)
def test_a_cut_epoch_continues_when_max_epochs_binds(method, tmp_path_factory, tmp_path):
    """max_steps 6 stops in epoch 1 after 2 of its 4 batches and Lightning's default checkpoint is written at that
    epoch's end; resumed with max_epochs 2 binding (no max_steps), the 2 batches left are trained (not "max_epochs
    reached", 0 steps) and the run ends bit-equal to the straight 8-step run: nothing the run depends on changes
    with max_steps while the schedules do not (constant lr and momentum)."""
    in_process("fit", "--config", str(config(method, tmp_path, max_steps=6, max_epochs=2, every_step=False)))
    assert state(tmp_path / "ckpt" / "last.ckpt")["global_step"] == 6
    extend = config(method, tmp_path, max_steps=-1, max_epochs=2, every_step=False)
    result = in_process("fit", "--config", str(extend), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"))
    assert result.trainer.global_step == 8
    assert_same_run(state(run(method, tmp_path_factory) / "ckpt" / "last.ckpt"), state(tmp_path / "ckpt" / "last.ckpt"))


@pytest.mark.parametrize("method", GROUPS)
def test_training_longer_follows_the_schedules_of_the_new_length(method, tmp_path):
    """A finished 2-epoch run (8 steps, cosine lr with a 2-step warm-up, the momentum on its cosine where the method
    has one) resumed with ``--ckpt_path last --trainer.max_epochs 4``: the 8 added steps train (the backbone moves)
    at the lr and momentum of a run planned for 16 steps, step for step, and the warning names the real end step."""
    from helpers.models import cosine

    name = METHODS[method][0]
    schedules = dict(lr_schedule="cosine", warmup_epochs=0.5)
    if name in MOMENTUM:
        schedules["momentum_schedule"] = "cosine"
    in_process("fit", "--config", str(config(method, tmp_path, max_steps=-1, max_epochs=2, **schedules)))
    finished = state(tmp_path / "ckpt" / "last.ckpt")
    assert finished["global_step"] == 8
    longer = config(method, tmp_path, max_steps=-1, max_epochs=4, **schedules)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = in_process(*["fit", "--config", str(longer), "--ckpt_path", "last"])
    assert result.trainer.global_step == 16
    messages = [str(w.message) for w in caught]
    assert any("resumed at step 8, the run now ends at step 16" in m for m in messages), messages
    seen = next(c for c in result.trainer.callbacks if type(c).__name__ == "RecordSchedules")
    model = result.model
    peak = model.hparams.lr * 16 / 256
    for step in range(8, 16):  # warm-up over steps 0-1, then the cosine of 16 steps
        assert seen.lrs[step] == pytest.approx(peak * cosine(step - 2, 14, 1.0, 0.0), rel=1e-6), step
        if name in MOMENTUM:
            m0 = model.hparams.momentum
            assert seen.momenta[step] == pytest.approx(cosine(step + 1, 16, m0, 1.0), rel=1e-6), step
    assert seen.lrs[8] > 0.4 * peak  # not the finished run's lr 0
    after = state(tmp_path / "ckpt" / "last.ckpt")["state_dict"]
    trained = [f"backbone.{k}" for k, p in model.backbone.named_parameters() if p.requires_grad]
    assert trained and all(not torch.equal(finished["state_dict"][k], after[k]) for k in trained)


# --- reloading, validating, refusing -----------------------------------------------------------
@pytest.mark.parametrize("method", GROUPS)
def test_load_from_checkpoint_rebuilds_the_module_and_its_weights(method, tmp_path_factory):
    path = run(method, tmp_path_factory) / "ckpt" / "last.ckpt"
    saved = state(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls_of(method).load_from_checkpoint(path)
    assert type(model) is cls_of(method)
    assert model.state_dict().keys() == saved["state_dict"].keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved["state_dict"][key]), key
    for key, value in METHODS[method][1].items():
        assert model.hparams[key] == value, key


@pytest.mark.parametrize("method", GROUPS)
def test_validate_from_the_checkpoint_reports_the_pretext_metrics(method, tmp_path_factory):
    folder = run(method, tmp_path_factory)
    args = ("validate", "--config", str(folder / "config.yaml"), "--ckpt_path", str(folder / "ckpt" / "last.ckpt"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = in_process(*[*args, "--trainer.limit_val_batches=2"])
    metrics = result.trainer.callback_metrics
    if method == "memory_bank":  # validation images have no row in the bank: said, not silent
        assert any("MemoryBankMoCo has no validation loss" in str(w.message) for w in caught)
    else:
        assert torch.isfinite(metrics["val/loss"])
    if cls_of(method).__name__ in ("MoCo", "MoCoV3", "EndToEnd"):
        assert 0 <= float(metrics["val/acc1"]) <= 1


@pytest.mark.parametrize("method", GROUPS)
def test_a_batch_of_one_image_is_one_line_for_every_method(method, tmp_path, capsys):
    """Batch size 1: SimCLR and EndToEnd trained at loss 0, MoCo v3 ended in a BatchNorm traceback, MoCo advised
    "bn_splits at most 1" when it was 1: one line for every method, at fit start, exit code 2."""
    with pytest.raises(SystemExit) as exit_:
        in_process("fit", "--config", str(config(method, tmp_path)), "--data.init_args.batch_size=1")
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 2, err
    assert err[0] == (
        f"moco-lightning fit: error: {METHODS[method][0]} needs at least 2 images per batch, and the training batch of "
        "each process holds 1 (data.batch_size): BatchNorm's statistics, the contrast between images and the codes of "
        "a batch need several; raise data.batch_size"
    )


@pytest.mark.parametrize("sub", ["test", "predict"])
@pytest.mark.parametrize("method", GROUPS)
def test_test_and_predict_are_refused_in_one_line(method, sub, tmp_path_factory, capsys):
    folder = run(method, tmp_path_factory)
    with pytest.raises(SystemExit) as exit_:
        in_process(sub, "--config", str(folder / "config.yaml").replace("config.yaml", "config.yaml"))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 2 and err[0].startswith(f"moco-lightning {sub}: error: {sub}: ")


# --- the encoder downstream: export, load_backbone, linear evaluation, low labels ----------------
@pytest.mark.parametrize("method", GROUPS)
def test_export_and_load_backbone_give_the_trained_encoders(method, tmp_path_factory, tmp_path):
    import numpy as np
    from helpers.cli import cli_main
    from helpers.files import write_tree
    from PIL import Image

    from moco_lightning import load_backbone
    from moco_lightning.cli.export import main as export
    from moco_lightning.datamodules import FashionMNISTDataModule

    path = run(method, tmp_path_factory) / "ckpt" / "last.ckpt"
    saved = state(path)["state_dict"]
    model = cls_of(method).load_from_checkpoint(path).eval()
    encoders = {"query": "backbone"}
    if cls_of(method).__name__ in MOMENTUM:
        encoders["key"] = "key_backbone" if cls_of(method).__name__ != "BYOL" else "target_backbone"
    x = torch.randn(4, 1, 28, 28)
    for encoder, prefix in encoders.items():
        out = tmp_path / f"{encoder}.pt"
        export(["--ckpt", str(path), "--out", str(out), "--encoder", encoder])
        backbone, transform = load_backbone(out, with_transform=True)
        for key, value in backbone.eval().state_dict().items():
            assert torch.equal(value, saved[f"{prefix}.{key}"]), (encoder, key)
        if encoder == "query":
            torch.testing.assert_close(backbone(x), model(x), rtol=0, atol=0)
    # the evaluation transform of pretraining, recorded by every method: Fashion-MNIST's statistics at 28 px
    fm = FashionMNISTDataModule
    recorded = dict(mean=list(fm.mean), std=list(fm.std), image_size=28, in_channels=1, resize=28)
    assert state(path)["moco_lightning"]["eval_transform"] == recorded
    image = Image.fromarray(np.full((40, 30, 3), 200, dtype=np.uint8))
    assert torch.allclose(transform(image), torch.full((1, 28, 28), (200 / 255 - fm.mean[0]) / fm.std[0]), atol=1e-5)
    # embed of the export: a folder's rows are load_backbone's features through that transform
    folder = write_tree(tmp_path / "images", n_per_class=2, splits=("train",)) / "train"
    assert cli_main("embed", "--ckpt", str(tmp_path / "query.pt"), "--data", str(folder), "--out",
                    str(tmp_path / "emb"), "--num_workers", "0") == 0  # fmt: skip
    rows = (tmp_path / "emb" / "index.csv").read_text().splitlines()[1:]
    query = load_backbone(tmp_path / "query.pt").eval()
    with torch.no_grad():
        expected = query(torch.stack([transform(Image.open(r.split(",")[1])) for r in rows]))
    assert torch.allclose(torch.from_numpy(np.load(tmp_path / "emb" / "features.npy")), expected, atol=1e-5)
    if cls_of(method).__name__ not in MOMENTUM:
        with pytest.raises(SystemExit):
            export(["--ckpt", str(path), "--out", str(tmp_path / "k.pt"), "--encoder", "key"])


@pytest.mark.parametrize("method", GROUPS)
def test_linear_evaluation_and_low_label_fine_tuning_from_checkpoint_and_export(
    method, tmp_path_factory, tmp_path, monkeypatch
):
    from lightning.pytorch import Trainer

    from moco_lightning.cli.export import main as export
    from moco_lightning.datamodules import FashionMNISTDataModule
    from moco_lightning.downstream.linear_eval import LinearClassifier

    path = run(method, tmp_path_factory) / "ckpt" / "last.ckpt"
    saved = state(path)["state_dict"]
    export(["--ckpt", str(path), "--out", str(tmp_path / "backbone.pt")])
    sources = {"ckpt_path": str(path), "backbone_state_dict": str(tmp_path / "backbone.pt")}
    for source, value in sources.items():
        for low_label in (False, True):
            extra = dict(labels_per_class=2, finetune=True, lr=0.05, schedule="cosine") if low_label else {}
            classifier = LinearClassifier(**{source: value}, **extra)
            monkeypatch.setattr(distributed, "atexit", ExitHandlers())
            for key, weight in classifier.backbone.state_dict().items():
                assert torch.equal(weight, saved[f"backbone.{key}"]), (source, key)
            data = FashionMNISTDataModule(batch_size=8, train_subset=64, val_subset=16, pretrain=False, seed=0)
            trainer = Trainer(
                accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_val_batches=1, logger=False,
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                num_sanity_val_steps=0,
            )  # fmt: skip
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.fit(classifier, data)
            assert trainer.global_step == 2 and 0 <= float(trainer.callback_metrics["val/acc1"]) <= 1
            assert distributed.atexit.handlers == [distributed.end_process_group]
            moved = any(not torch.equal(w, saved[f"backbone.{k}"]) for k, w in classifier.backbone.state_dict().items())
            assert moved == low_label, (source, low_label)  # frozen for the linear probe, trained when fine-tuned
            if low_label:
                assert len(classifier.labelled_indices) == 2 * 10


# --- checkpoints written by earlier versions -------------------------------------------------------
FIXTURES = Path(__file__).parent / "fixtures" / "format2"
FIXTURE_MODEL = dict(TINY, width=0.0625, cifar_stem=True)  # what they were trained with
FIXTURE_ARGS = {
    "MoCo": dict(queue_size=32, bn_splits=2),
    "MoCoV3": {},
    "EndToEnd": dict(head="mlp"),
    "MemoryBankMoCo": dict(head="mlp", memory_bank_size=64, num_negatives=16),
    "SimCLR": {},
    "BYOL": {},
    "SwAV": dict(n_prototypes=10),
}


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.ckpt")))  # a method newer than 0.2 has none
def test_a_checkpoint_of_the_previous_format_loads_resumes_and_exports(name, tmp_path):
    """Tiny checkpoints written by moco-lightning 0.2.0 (format 2, `moco-lightning fit`, 2 steps), one per method that
    release had: MoCo v3, EndToEnd and MemoryBankMoCo ones could not be reloaded then; they load, resume and export
    now."""
    from moco_lightning.cli.export import main as export

    path = FIXTURES / f"{name}.ckpt"
    saved = state(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(moco_lightning, name).load_from_checkpoint(path)
    old_name = {"dictionary.": "memory_bank." if name == "MemoryBankMoCo" else "queue."}  # format 3 and older
    for key, value in model.state_dict().items():
        old = next((new.join(key.split(k, 1)) for k, new in old_name.items() if key.startswith(k)), key)
        assert torch.equal(value, saved["state_dict"][old]), key
    cfg = tmp_path / "resume.yaml"
    cfg.write_text(
        yaml.safe_dump(
            dict(
                trainer=dict(accelerator="cpu", max_steps=3, max_epochs=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                             default_root_dir=str(tmp_path)),
                model={"class_path": f"moco_lightning.{name}", "init_args": {**FIXTURE_MODEL, **FIXTURE_ARGS[name]}},
                data={**copy.deepcopy(DATA), "init_args": dict(batch_size=16, train_subset=64, val_subset=16)},
            )
        )
    )  # fmt: skip
    result = in_process("fit", "--config", str(cfg), "--ckpt_path", str(path))
    assert result.trainer.global_step == 3 and type(result.model).__name__ == name
    export(["--ckpt", str(path), "--out", str(tmp_path / "b.pt")])
    assert (tmp_path / "b.pt").stat().st_size > 0


@pytest.mark.parametrize("method", GROUPS)
def test_a_training_step_reads_nothing_back_to_the_host_between_logging_steps(method, tmp_path):
    """#53: on a GPU every host read waits for the whole queue of kernels. Between Lightning's logging steps (every
    4 here, when it reads the logged metrics, and the NaN guard its flags) a step of every method, with its split BN,
    queue, memory bank, NaN guard, schedules and TensorBoard logging, reads nothing; the logging steps do (which
    shows that the count sees reads)."""
    from helpers.host_reads import HostReads
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.loggers import TensorBoardLogger

    from moco_lightning.datamodules import FashionMNISTDataModule
    from moco_lightning.modules.backbones import build_from_spec

    seed_everything(0, verbose=False)
    args = {**TINY, **CONSTANT, **METHODS[method][1]}
    if isinstance(args["backbone"], dict):
        args["backbone"] = build_from_spec(args["backbone"])
    if "memory_bank_size" in args:
        args["memory_bank_size"] = 160
    model = cls_of(method)(**args)
    reads = HostReads()
    trainer = Trainer(
        accelerator="cpu", max_steps=9, logger=TensorBoardLogger(tmp_path), log_every_n_steps=4, callbacks=[reads],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        enable_checkpointing=False,
    )  # fmt: skip
    data = FashionMNISTDataModule(**{**DATA["init_args"], "train_subset": 160})  # 10 steps an epoch: no epoch end
    with warnings.catch_warnings(), reads:
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    assert trainer.global_step == 9
    between = {step: reads.per_step[step] for step in (2, 4, 5, 6)}
    assert all(not where for where in between.values()), between
    assert reads.per_step[3] and reads.per_step[7]  # the logging steps (batches 4 and 8)


# --- #54: what a demanding user found wrong from the outside, through the entry point they used ---------------------
def _folder_with_a_corrupt_image(root: Path) -> Path:
    from helpers.files import write_tree

    write_tree(root, n_per_class=4, classes=("cat", "dog"))
    (root / "train" / "cat" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    return root


@pytest.mark.parametrize("command", ["evaluate", "embed"])
def test_a_corrupt_image_is_one_line_naming_the_commands_own_flag_which_skips_it(command, tmp_path, capfd):
    """#54.4: a DataLoader worker's 30-line traceback ending in "set data.skip_bad_images=true" (an option neither
    command has): now one line, exit code 2, naming the file and --skip_bad_images, which then embeds / evaluates."""
    from helpers.cli import cli_main
    from helpers.data import FIXTURE_CKPT

    root = _folder_with_a_corrupt_image(tmp_path / "photos")
    args = {
        "evaluate": ["--data_dir", str(root), "--fractions", "--k", "3", "--out", str(tmp_path / "out")],
        "embed": ["--data", str(root / "train"), "--out", str(tmp_path / "out"), "--num_workers", "1"],
    }[command]
    assert cli_main(command, "--ckpt", FIXTURE_CKPT, *args) == 2
    err = capfd.readouterr().err.strip()  # (evaluate says what it is computing first, on a line of its own)
    assert "Traceback" not in err and [line for line in err.splitlines() if "error" in line] == [err.splitlines()[-1]]
    assert err.splitlines()[-1].startswith(f"moco-lightning {command}: error: "), err
    assert "broken.jpg: cannot be read as an image" in err and "pass --skip_bad_images" in err
    assert "data.skip_bad_images" not in err
    assert cli_main(command, "--ckpt", FIXTURE_CKPT, *args, "--skip_bad_images") == 0
    assert "broken.jpg" in capfd.readouterr().err  # skipped, and said


@pytest.mark.parametrize("command", ["evaluate", "embed"])
def test_an_out_that_is_a_file_is_refused_before_any_work(command, tmp_path, capsys, monkeypatch):
    """#54.5: ``--out`` naming an existing file raised FileExistsError after the whole evaluation (its results lost):
    now one line before anything is read or computed."""
    from helpers.cli import cli_main
    from helpers.data import FIXTURE_CKPT
    from helpers.files import write_tree

    import moco_lightning.cli.evaluate as cli_evaluate
    import moco_lightning.downstream.encoder as encoder

    def no_work(*args, **kwargs):
        raise AssertionError("work started before --out was checked")

    monkeypatch.setattr(cli_evaluate, "datamodule_of", no_work)
    monkeypatch.setattr(encoder.Encoder, "read", classmethod(no_work))  # the one reader of a checkpoint or export
    root = write_tree(tmp_path / "photos", n_per_class=2)
    (tmp_path / "taken").write_text("a file")
    data = ["--data_dir", str(root)] if command == "evaluate" else ["--data", str(root / "train")]
    assert cli_main(command, "--ckpt", FIXTURE_CKPT, *data, "--out", str(tmp_path / "taken")) == 2
    assert f"--out {tmp_path / 'taken'}: a file is there; give a folder" in capsys.readouterr().err


def test_the_data_install_fetches_the_package_lists_first(tmp_path):
    """#54.8: on a machine whose package lists were never fetched, ``apt-get install`` finds no package: the set-up
    (scripts/setup.sh and CI, through scripts/install_data.sh) runs ``apt-get update`` first; nothing when the data
    is there."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "apt.log"}\n')
    (bin_dir / "apt-get").chmod(0o755)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SUDO=" ")
    for data in (tmp_path / "missing.gz", Path(__file__)):  # not installed; installed (any existing file)
        run = subprocess.run(["bash", "scripts/install_data.sh"], cwd=root, capture_output=True, text=True,
                             env=dict(env, MOCO_FASHION_MNIST_FILE=str(data)))  # fmt: skip
        assert run.returncode == 0, run.stderr
    assert (tmp_path / "apt.log").read_text().splitlines() == ["update -qq", "install -y -qq dataset-fashion-mnist"]
    assert "bash scripts/install_data.sh" in (root / "scripts" / "setup.sh").read_text()
    assert "bash scripts/install_data.sh" in (root / ".ci" / "run").read_text()


@pytest.mark.parametrize("method", [g for g in GROUPS if g.values[0] in ("moco_v2", "byol")])
def test_last_ckpt_of_a_preempted_run_resumed_is_the_runs_last_step(method, tmp_path):
    """#54.1: SIGTERM inside the first epoch (before the checkpoint callback had saved ``last.ckpt``), then the same
    command with ``--ckpt_path last``: the run's end state was written to ``last-v1.ckpt`` and ``last.ckpt`` stayed at
    the preempted step, which evaluate / export / embed read. Now ``last.ckpt`` is bit-equal to the uninterrupted
    run's (constant schedules) and there is no other ``last``."""
    straight = config(method, tmp_path / "straight", every_step=False)  # last.ckpt at each epoch's end
    assert in_process("fit", "--config", str(straight), quiet=True).trainer.global_step == 8
    preempted = config(method, tmp_path / "preempted", every_step=False)
    text = yaml.safe_load(preempted.read_text())
    signal = {"class_path": "helpers.callbacks.SignalAt", "init_args": {"step": 2, "signum": "SIGTERM"}}
    text["trainer"]["callbacks"].append(signal)
    preempted.write_text(yaml.safe_dump(text))
    with pytest.raises(SystemExit):  # Lightning's clean exit of a terminated run
        in_process("fit", "--config", str(preempted), quiet=True)
    folder = tmp_path / "preempted" / "ckpt"
    assert state(folder / "last.ckpt")["global_step"] == 2
    resumed = config(method, tmp_path / "preempted", every_step=False)  # the same command, --ckpt_path last
    assert in_process("fit", "--config", str(resumed), "--ckpt_path", "last", quiet=True).trainer.global_step == 8
    assert sorted(p.name for p in folder.glob("last*.ckpt")) == ["last.ckpt"]
    final, whole = state(folder / "last.ckpt"), state(tmp_path / "straight" / "ckpt" / "last.ckpt")
    assert final["global_step"] == whole["global_step"] == 8
    for key, value in whole["state_dict"].items():
        assert torch.equal(final["state_dict"][key], value), key


@pytest.mark.parametrize("method", GROUPS)
def test_linear_refuses_an_architecture_its_checkpoint_contradicts_and_records_the_one_it_used(
    method, tmp_path_factory, tmp_path, capsys
):
    """#54.3: ``linear fit --model.ckpt_path X --model.width 2.0 --model.stem imagenet --model.image_size 64`` used
    the checkpoint's encoder and recorded the flags (without them, the unused defaults: 3 channels, 224 px). Now the
    contradiction is one line, and hparams.yaml records the architecture that was trained on."""
    from helpers.cli import cli_main

    path = run(method, tmp_path_factory) / "ckpt" / "last.ckpt"
    common = ["--config", "configs/linear_eval.yaml", "--model.ckpt_path", str(path), "--trainer.max_steps", "1",
              "--trainer.limit_val_batches", "1", f"--trainer.logger.init_args.save_dir={tmp_path}",
              "--trainer.enable_progress_bar", "false", "--data.init_args.batch_size", "8",
              "--data.init_args.train_subset", "64", "--data.init_args.val_subset", "8",
              "--trainer.callbacks", "[]"]  # fmt: skip
    assert cli_main("linear", "fit", *common, "--model.width", "2.0", "--model.image_size", "64") == 2
    err = capsys.readouterr().err
    assert "model.image_size=64 (the encoder's: 28), model.width=2.0 (the encoder's: " in err, err[-2000:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli_main("linear", "fit", *common) == 0
    recorded = yaml.safe_load(next(tmp_path.rglob("hparams.yaml")).read_text())
    built = {k: v for k, v in {**TINY, **METHODS[method][1]}.items() if k in ("in_channels", "image_size", "width")}
    assert {k: recorded[k] for k in built} == built
    if method != "moco_v3_vit":  # (a ViT's patch grid is fixed: torchvision refuses other sizes itself)
        with pytest.warns(UserWarning, match="pretrained on 28 px images and the datamodule gives 56 px"):
            assert cli_main("linear", "fit", *common, "--data.init_args.image_size", "56") == 0


@pytest.mark.parametrize("method", GROUPS)
def test_a_fine_tuned_checkpoint_exports_its_backbone(method, tmp_path_factory, tmp_path, capsys):
    """#54.6: a linear-evaluation or fine-tuning checkpoint given to export / evaluate / embed was "not a checkpoint
    of moco-lightning pretraining" though it holds the backbone: its backbone (the fine-tuned one) is exported, and
    read by evaluate and embed, with the architecture and evaluation transform of its pretraining."""
    from helpers.cli import cli_main
    from helpers.files import write_tree
    from lightning.pytorch import Trainer

    from moco_lightning import load_backbone
    from moco_lightning.datamodules import FashionMNISTDataModule
    from moco_lightning.downstream.linear_eval import LinearClassifier

    path = run(method, tmp_path_factory) / "ckpt" / "last.ckpt"
    classifier = LinearClassifier(ckpt_path=str(path), finetune=True, lr=0.05, schedule="cosine")
    trainer = Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(tmp_path),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(classifier, FashionMNISTDataModule(batch_size=8, train_subset=64, pretrain=False, seed=0))
    tuned = next(tmp_path.rglob("*.ckpt"))
    assert cli_main("export", "--ckpt", str(tuned), "--out", str(tmp_path / "tuned.pt")) == 0
    backbone = load_backbone(str(tmp_path / "tuned.pt"))
    for key, weight in classifier.backbone.state_dict().items():
        assert torch.equal(backbone.state_dict()[key], weight), key
    if method == "moco_v2":
        root = write_tree(tmp_path / "photos", n_per_class=2)
        assert cli_main("embed", "--ckpt", str(tuned), "--data", str(root / "train"), "--out", str(tmp_path / "e")) == 0
        assert cli_main("evaluate", "--ckpt", str(tuned), "--fast", "--fractions", "--k", "3", "--out",
                        str(tmp_path / "v")) == 0  # fmt: skip


@pytest.mark.parametrize("method", GROUPS)
def test_the_base_class_loads_a_checkpoint_as_the_method_that_wrote_it(method, tmp_path_factory):
    """#54.6: ``Pretraining.load_from_checkpoint`` raised torch's kilobytes of missing keys (the base class has no
    heads): it builds the class that wrote the checkpoint."""
    from moco_lightning import Pretraining

    path = run(method, tmp_path_factory) / "ckpt" / "last.ckpt"
    model = Pretraining.load_from_checkpoint(path)
    assert type(model) is cls_of(method)
    for key, value in state(path)["state_dict"].items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_evaluate_says_what_it_measured_and_names_the_folders_classes(tmp_path, capsys):
    """#54.6-7 through ``moco-lightning evaluate`` on a user's folder (3 classes x 6 training images): a k above the
    bank is said to be capped; a budget whose few images are another share than asked says the share given; no
    "pip install matplotlib" where no curve was asked; a --per_class too large names the class folder and the flag;
    --holdout sets the held-out share; an empty class folder does not stop embed."""
    import json

    from helpers.cli import cli_main
    from helpers.data import FIXTURE_CKPT
    from helpers.files import write_tree

    root = write_tree(tmp_path / "photos", n_per_class=6, classes=("cat", "dog", "fox"))
    out = ["--out", str(tmp_path / "out")]
    assert cli_main("evaluate", "--ckpt", FIXTURE_CKPT, "--data_dir", str(root), "--k", "500", "--fractions", *out) == 0
    said = capsys.readouterr()
    assert "kNN k 18 (--k 500 capped: 18 training images)" in said.out and "matplotlib" not in said.err
    assert cli_main("evaluate", "--ckpt", FIXTURE_CKPT, "--data_dir", str(root), "--k", "3", "--fractions", "0.01",
                    "--steps", "1", *out) == 0  # fmt: skip
    assert "| 1 % asked, 16.7 % given (3) |" in capsys.readouterr().out  # one image of each class's six
    assert cli_main("evaluate", "--ckpt", FIXTURE_CKPT, "--data_dir", str(root), "--per_class", "7", *out) == 2
    assert "--per_class=7, but class 'cat' has only 6 training images: give at most 6" in capsys.readouterr().err
    assert cli_main("evaluate", "--ckpt", FIXTURE_CKPT, "--data_dir", str(root), "--split", "val", "--holdout", "0.5",
                    "--fractions", "--k", "3", *out) == 0  # fmt: skip
    assert json.loads((tmp_path / "out" / "evaluate.json").read_text())["eval_images"] == 9
    assert cli_main("evaluate", "--ckpt", FIXTURE_CKPT, "--holdout", "0.5", *out) == 2
    assert "--holdout: only with --split val, or an image folder without val/" in capsys.readouterr().err
    (root / "train" / "empty").mkdir()
    assert cli_main("embed", "--ckpt", FIXTURE_CKPT, "--data", str(root / "train"), "--out", str(tmp_path / "e")) == 0
