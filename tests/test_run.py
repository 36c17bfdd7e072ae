"""The run's machinery as callbacks (``moco_lightning.run``): a module dropped into a Lightning user's project keeps
every behaviour whatever hooks the user's subclass overrides without ``super()``, or says which hook in one line;
a user's own instance of a run callback replaces the module's; ``run_callbacks=False`` is a plain Lightning run; the
Trainer's tuners and schedulers meet the module's units checked."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.data import tiny_data
from helpers.models import tiny, tiny_backbone, tiny_moco
from helpers.trainers import cpu_trainer
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

import moco_lightning as ml
from moco_lightning import run
from moco_lightning.errors import ConfigError
from moco_lightning.methods.contrastive import Contrastive

METHODS = {  # name: (class, the tiny run's arguments)
    "moco_v2": (ml.MoCo, dict(shuffle_bn="split", bn_splits=2)),  # split BN: a setup() override must not drop it
    "moco_v1": (ml.MoCo, dict(head="linear", temperature=0.07)),
    "moco_v3": (ml.MoCoV3, {}),
    "end_to_end": (ml.EndToEnd, {}),
    "memory_bank": (ml.MemoryBankMoCo, dict(memory_bank_size=64, num_negatives=16)),
    "simclr": (ml.SimCLR, {}),
    "byol": (ml.BYOL, {}),
    "swav": (ml.SwAV, {}),
}
#: methods whose after-step work lives in on_train_batch_end: a momentum copy or a dictionary that stores keys
AFTER_STEP = {"moco_v2", "moco_v1", "moco_v3", "memory_bank", "byol"}


def build(name: str, cls: type = None, **kwargs):
    base, args = METHODS[name]
    cls = cls or base
    return (tiny_moco if issubclass(base, Contrastive) else tiny)(cls, **{**args, **kwargs})


def _sgd(self):
    return torch.optim.SGD([p for m in self.trained_modules() for p in m.parameters()], lr=0.05, momentum=0.9)


#: a user's override of each hook the library used to hang its run on, without super() (LightningModule's are no-ops)
OVERRIDES = {
    "setup": lambda self, stage: None,
    "on_fit_start": lambda self: None,
    "on_train_start": lambda self: None,
    "on_train_batch_end": lambda self, outputs, batch, batch_idx: None,
    "on_save_checkpoint": lambda self, checkpoint: None,
    "on_load_checkpoint": lambda self, checkpoint: None,
    "on_train_end": lambda self: None,
    "configure_optimizers": _sgd,  # the user's own optimizer
    "training_step": None,  # calls super(): below
    "configure_callbacks": lambda self: [],  # drops the library's callbacks
}


def subclass(base: type, hook: str) -> type:
    if hook == "training_step":

        def body(self, batch, batch_idx):
            return base.training_step(self, batch, batch_idx)

    else:
        body = OVERRIDES[hook]
    return type(f"User{base.__name__}", (base,), {hook: body, "__module__": __name__})


def fit(name: str, cls: type, folder, ckpt_path=None):
    """2 epochs of 4 steps, a checkpoint every 3 steps and last.ckpt (a user's ModelCheckpoint); returns the module."""
    seed_everything(0, verbose=False)
    model = build(name, cls)
    checkpoint = ModelCheckpoint(
        dirpath=folder, every_n_train_steps=3, save_top_k=-1, save_last=True, filename="{step}"
    )
    trainer = cpu_trainer(max_epochs=2, callbacks=[checkpoint], enable_checkpointing=True, limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, tiny_data(), ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("hook", list(OVERRIDES))
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n == "moco_v2" else pytest.mark.slow) for n in METHODS]
)  # fmt: skip
def test_a_subclass_overriding_a_hook_keeps_todays_behaviour_or_is_told_which_hook(name, hook, tmp_path):
    """Today's behaviour (the copy moves, resume from the step-3 checkpoint bit-equal, last.ckpt at the final step,
    split BN in place) or one line naming the hook and ``super()``."""
    cls = subclass(METHODS[name][0], hook)
    if hook == "configure_callbacks" or (hook == "on_train_batch_end" and name in AFTER_STEP):
        with pytest.raises(ConfigError, match=rf"{hook}.*super\(\)") as error:
            fit(name, cls, tmp_path / "straight")
        assert "\n" not in str(error.value)
        return
    seed_everything(0, verbose=False)
    before = build(name).state_dict()
    straight = fit(name, cls, tmp_path / "straight")
    assert straight.global_step == 8
    last = torch.load(tmp_path / "straight" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 8 and "moco_lightning" in last  # the run's last step, the library's entry
    copies = [k for k in before if k.startswith(("key_", "target_"))]
    assert all(not torch.equal(before[k], straight.state_dict()[k]) for k in copies if k.endswith("weight"))
    resumed = fit(name, cls, tmp_path / "resumed", ckpt_path=tmp_path / "straight" / "step=3.ckpt")
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_a_setup_override_keeps_split_batchnorm_on(tmp_path):
    """Finding 3: shuffle BN on one device is split BN in both encoders during the fit, whatever ``setup`` does."""
    from lightning.pytorch import Callback

    from moco_lightning.modules.split_bn import SplitBatchNorm2d

    seen = []

    class Count(Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append(sum(isinstance(m, SplitBatchNorm2d) for m in pl_module.modules()))

    model = build("moco_v2", subclass(ml.MoCo, "setup"))
    cpu_trainer(max_steps=1, callbacks=[Count()], limit_val_batches=0).fit(model, tiny_data())
    assert seen == [4]  # 2 BatchNorm layers in each encoder


def test_the_momentum_guard_fires_between_periodic_saves_too(tmp_path):
    """Finding 1 with ``ModelCheckpoint(every_n_train_steps=3)`` (a save finishes its step): still one line."""
    with pytest.raises(ConfigError, match=r"UserMoCo\.on_train_batch_end overrides .* super\(\)"):
        fit("moco_v2", subclass(ml.MoCo, "on_train_batch_end"), tmp_path)


def test_a_users_own_run_callback_replaces_the_modules_and_run_callbacks_false_is_a_plain_run(tmp_path):
    class MyNanStop(run.NanStop):
        pass

    mine = MyNanStop()
    trainer = cpu_trainer(max_steps=2, callbacks=[mine], limit_val_batches=0)
    trainer.fit(tiny_moco(), tiny_data())
    stops = [c for c in trainer.callbacks if isinstance(c, run.NanStop)]
    assert stops == [mine]
    assert {type(c) for c in trainer.callbacks} >= set(run.PRETRAINING) - {run.NanStop} | {run.FitSetup}

    plain = cpu_trainer(max_steps=2, limit_val_batches=0)
    model = tiny_moco(run_callbacks=False)
    plain.fit(model, tiny_data())
    ours = {type(c) for c in plain.callbacks if type(c).__module__.startswith("moco_lightning.run")}
    assert ours == {run.FitSetup} and model.global_step == 2
    assert not model.nan_guard._pending  # nothing recorded that nobody reads


def test_lr_find_suggests_the_lr_the_fit_trains_at(tmp_path):
    """Finding 2: ``Tuner.lr_find(update_attr=True)`` writes its suggestion (an optimizer lr) through ``optimizer_lr``:
    ``hparams.lr`` becomes the suggestion × 256 / global batch, and the fit's optimizer runs at the suggestion."""
    from lightning.pytorch.tuner import Tuner

    model = tiny_moco(lr_schedule="constant")
    trainer = cpu_trainer(max_steps=1, max_epochs=-1, limit_val_batches=0, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        finder = Tuner(trainer).lr_find(model, datamodule=tiny_data(), num_training=24, min_lr=1e-3, max_lr=1.0,
                                        early_stop_threshold=None)  # fmt: skip
    suggestion = finder.suggestion()
    assert suggestion is not None
    assert model.hparams.lr == pytest.approx(suggestion * 256 / 16)
    assert not [w for w in caught if "checkpoint holds" in str(w.message) or "resumed" in str(w.message)]
    trainer.fit(model, tiny_data())
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(suggestion)
    with pytest.raises(ConfigError, match=r"attr_name='lr'.*per 256 images.*optimizer_lr"):
        Tuner(cpu_trainer(max_steps=1, default_root_dir=tmp_path)).lr_find(
            tiny_moco(), datamodule=tiny_data(), num_training=4, attr_name="lr"
        )


@pytest.mark.parametrize("how", ["scale_batch_size", "BatchSizeFinder"])
def test_the_batch_size_tuners_restore_a_fresh_model_without_resume_messages(how, tmp_path):
    """The tuners save the module and restore it after their trials: not a resumed run, nothing said of one."""
    from lightning.pytorch.callbacks import BatchSizeFinder
    from lightning.pytorch.tuner import Tuner

    dm = tiny_data(batch_size=4)
    finder = dict(mode="power", steps_per_trial=1, init_val=4, max_trials=2)
    callbacks = [BatchSizeFinder(**finder)] if how == "BatchSizeFinder" else []
    trainer = cpu_trainer(max_steps=2, limit_val_batches=0, default_root_dir=tmp_path, callbacks=callbacks)
    model = tiny_moco()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "scale_batch_size":
            Tuner(trainer).scale_batch_size(model, datamodule=dm, **finder)
        trainer.fit(model, datamodule=dm)
    said = [str(w.message) for w in caught if "checkpoint" in str(w.message) or "resumed" in str(w.message)]
    assert not said and dm.batch_size > 4 and model.global_step == 2


def test_a_changing_gradient_accumulation_is_refused_at_fit_start():
    """Finding 5: the schedules are planned over one accumulation's optimizer steps."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    model = tiny_moco()
    trainer = cpu_trainer(max_epochs=2, callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})])
    with pytest.raises(ConfigError, match=r"GradientAccumulationScheduler.*accumulate_grad_batches=2"):
        trainer.fit(model, tiny_data())
    assert model.global_step == 0
    constant = cpu_trainer(max_epochs=1, callbacks=[GradientAccumulationScheduler({0: 2})], limit_val_batches=0)
    constant.fit(tiny_moco(), tiny_data())  # one accumulation all run long: planned right
    assert constant.global_step == 2


def test_a_partial_last_batch_under_split_bn_is_named_at_fit_start():
    """Finding 6: a user's loader with drop_last=False whose last batch cannot split: refused before any step."""
    from torch.utils.data import DataLoader, TensorDataset

    views = TensorDataset(torch.randn(20, 1, 28, 28), torch.randn(20, 1, 28, 28), torch.zeros(20))
    loader = DataLoader(views, batch_size=8, collate_fn=lambda b: ([torch.stack([x[0] for x in b]),
                        torch.stack([x[1] for x in b])], torch.zeros(len(b))))  # fmt: skip
    model = tiny_moco(shuffle_bn="split", bn_splits=4)
    with pytest.raises(ConfigError, match=r"drop_last=False.*batch of 4.*bn_splits=4.*set drop_last=True"):
        cpu_trainer(max_epochs=1).fit(model, loader)
    assert model.global_step == 0


def test_the_datamodules_own_loaders_alone_are_named_with_datamodule_dm():
    """Finding 7 (fit) and 8 (predict): the loaders of a moco-lightning datamodule give raw images that the datamodule
    turns into views / normalises on the device; the remedy is ``datamodule=dm``."""
    dm = tiny_data()
    dm.setup("fit")
    with pytest.raises(ConfigError, match=r"datamodule=dm"):
        cpu_trainer(max_steps=1).fit(tiny_moco(), dm.train_dataloader())
    model = tiny_moco()
    with pytest.raises(ConfigError, match=r"predict_step: the images are torch.uint8.*datamodule=dm\) or") as error:
        cpu_trainer().predict(model, dataloaders=dm.val_dataloader())
    assert "\n" not in str(error.value)
    features = cpu_trainer().predict(model, datamodule=tiny_data())
    assert features[0].shape == (16, 16) and features[0].dtype == torch.float32


def test_a_checkpoint_saved_by_a_subclass_without_on_save_checkpoint_super_loads():
    """Finding 9: the entry is written by a callback; the checkpoint loads as the class that wrote it."""
    import tempfile

    model = build("moco_v2", subclass(ml.MoCo, "on_save_checkpoint"))
    trainer = cpu_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(model, tiny_data())
    with tempfile.TemporaryDirectory() as folder:
        trainer.save_checkpoint(f"{folder}/run.ckpt")
        loaded = type(model).load_from_checkpoint(f"{folder}/run.ckpt", backbone=tiny_backbone())
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key


@pytest.mark.parametrize("name", ["moco_v2", "byol", "moco_v3"])
def test_unfreeze_keeps_the_momentum_copies_frozen(name):
    """Finding 10: ``freeze(); unfreeze()`` trains what the optimizer trains, never the momentum copy."""
    model = build(name)
    model.freeze()
    model.unfreeze()
    copies = set(model.momentum_copies().values())
    for child_name, child in model.named_children():
        assert all(p.requires_grad != (child_name in copies) for p in child.parameters()), child_name


def test_unfreeze_keeps_a_linear_evaluations_backbone_frozen():
    from moco_lightning.downstream.linear_eval import LinearClassifier

    classifier = LinearClassifier(backbone=tiny_backbone(), feature_dim=16, num_classes=3)
    classifier.freeze()
    classifier.unfreeze()
    assert not any(p.requires_grad for p in classifier.backbone.parameters())
    assert all(p.requires_grad for p in classifier.head.parameters())


@pytest.mark.slow  # two processes
def test_freeze_unfreeze_then_ddp_spawn_trains():
    """Finding 10 through the entry point it was found in: both ranks train (DDP found no unused parameters)."""
    model = tiny_moco()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.freeze()
    model.unfreeze()
    trainer = cpu_trainer(max_steps=2, devices=2, strategy="ddp_spawn", limit_val_batches=0)
    trainer.fit(model, tiny_data())  # raised "unused parameters" on both ranks when unfreeze() thawed the key encoder
    assert trainer.state.finished
    moved = [k for k, v in model.state_dict().items() if k.endswith("weight") and not torch.equal(v, before[k])]
    assert any(k.startswith("backbone.") for k in moved) and any(k.startswith("key_") for k in moved)


def test_module_backbones_refuse_width_and_stem():
    with pytest.raises(ConfigError, match=r"width=0.5.*module \(Sequential\)"):
        tiny_moco(width=0.5)
    with pytest.raises(ConfigError, match=r"stem='cifar'"):
        tiny_moco(stem="cifar")


@pytest.mark.parametrize("name,queue", [("moco_v2", True), ("moco_v3", False), ("byol", False)])
def test_half_precision_refusals_speak_of_a_queue_only_where_there_is_one(name, queue):
    model = build(name)
    with pytest.raises(ConfigError) as error:
        cpu_trainer(max_steps=1, precision="bf16-true").fit(model, tiny_data())
    assert ("queue" in str(error.value)) == queue


def test_the_preemption_message_names_how_python_resumes(tmp_path, capsys):
    import signal

    from lightning.pytorch import Callback

    class Term(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                signal.raise_signal(signal.SIGTERM)

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    trainer = cpu_trainer(max_steps=4, callbacks=[Term()], limit_val_batches=0, default_root_dir=tmp_path)
    with pytest.raises(SIGTERMException):  # Lightning's clean exit of a terminated run (the CLI exits with 0)
        trainer.fit(tiny_moco(), tiny_data())
    err = capsys.readouterr().err
    assert "ckpt_path=" in err and "--ckpt_path last" in err and trainer.global_step == 2


@pytest.mark.parametrize("feature", ["monitor", "EarlyStopping", "StochasticWeightAveraging", "Timer"])
def test_the_trainer_features_a_project_uses_run(feature, tmp_path):
    """ModelCheckpoint on a metric, EarlyStopping, SWA and Timer: each runs to its end beside the run callbacks."""
    from lightning.pytorch.callbacks import EarlyStopping, StochasticWeightAveraging, Timer

    callbacks = {
        "monitor": [ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", mode="min", save_top_k=1)],
        "EarlyStopping": [EarlyStopping(monitor="val/loss", patience=0, min_delta=10.0)],
        "StochasticWeightAveraging": [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)],
        "Timer": [Timer(duration="00:00:10:00")],
    }[feature]
    trainer = cpu_trainer(max_epochs=3, callbacks=callbacks, enable_checkpointing=feature == "monitor",
                          limit_val_batches=1)  # fmt: skip
    model = tiny_moco()
    trainer.fit(model, tiny_data())
    assert trainer.state.finished
    if feature == "EarlyStopping":  # stopped after epoch 2: val/loss did not fall by 10
        assert trainer.global_step == 8
    elif feature != "StochasticWeightAveraging":  # SWA adds its BatchNorm pass
        assert trainer.global_step == 12
    if feature == "monitor":
        assert torch.load(callbacks[0].best_model_path, weights_only=True)["moco_lightning"]["module"].endswith("MoCo")


def test_swav_names_an_on_after_backward_override_that_leaves_the_prototypes_unfrozen():
    """SwAV's prototypes stay frozen in the first epochs by dropping their gradient in ``on_after_backward``: an
    override without ``super()`` is one line at the next step (after the frozen epochs, nothing to say)."""
    user = type("UserSwAV", (ml.SwAV,), {"on_after_backward": lambda self: None, "__module__": __name__})
    with pytest.raises(ConfigError, match=r"UserSwAV\.on_after_backward overrides .* super\(\)"):
        cpu_trainer(max_steps=2, limit_val_batches=0).fit(tiny(user, freeze_prototypes_epochs=1.0), tiny_data())
    unfrozen = tiny(user, freeze_prototypes_epochs=0.0)
    cpu_trainer(max_steps=2, limit_val_batches=0).fit(unfrozen, tiny_data())
    assert unfrozen.global_step == 2
