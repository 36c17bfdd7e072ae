"""The schedules' plan: a fit given another length in the middle stretches the rest of its lr and momentum
schedules (continuous at that step, the planned end at the new last step) and stops there."""

import functools
import math
import warnings

import pytest
from helpers.data import tiny_data
from helpers.models import cosine, tiny_moco
from helpers.trainers import cpu_trainer
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from moco_lightning.errors import ConfigError
from moco_lightning.training import plan
from moco_lightning.training.plan import change_length


class Longer(Callback):
    """At optimizer step 3 of a run planned over 8, the run turns out to afford 12: ``change_length``."""

    def __init__(self) -> None:
        self.lrs, self.momenta = {}, {}

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step == 3:
            change_length(module, 12)
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]
        self.momenta[trainer.global_step] = module.momentum_copy.at(module, trainer.global_step)


def test_change_length_stretches_the_schedules_and_stops_at_the_new_end(seeded):
    model = tiny_moco(lr_schedule="cosine", momentum_schedule="cosine", momentum=0.9)
    seen = Longer()
    trainer = cpu_trainer(max_steps=8, max_epochs=-1, callbacks=[seen], limit_val_batches=0)
    trainer.fit(model, tiny_data())
    assert trainer.global_step == 12
    peak = 0.06 * 16 / 256
    for step in range(3, 13):  # position on the planned 8 steps: 3 + (step - 3) * 5 / 9
        position = 3 + (step - 3) * 5 / 9
        assert seen.lrs[step] == pytest.approx(peak * cosine(position, 8, 1.0, 0.0)), step
        assert seen.momenta[step] == pytest.approx(cosine(position, 8, 0.9, 1.0)), step
    assert seen.lrs[12] == pytest.approx(0.0, abs=1e-12) and math.isclose(seen.momenta[12], 1.0)


class _RecordSchedules(Callback):
    def __init__(self) -> None:
        self.lrs, self.momenta = {}, {}

    def on_train_batch_start(self, trainer, module, *args):
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]
        self.momenta[trainer.global_step] = module.momentum_copy.at(module, trainer.global_step)


def _planned_then_resumed(tmp_path, steps_then: int, batch_then: int = 16, resume_at: int = 4):
    """A run planned over 8 steps (cosine lr with a 1-step warm-up, cosine momentum; 4 steps an epoch), and the same
    run resumed from its step-``resume_at`` checkpoint with ``max_steps=steps_then`` and a per-device batch of
    ``batch_then``: the schedules at each step of both, and the resume's warnings."""
    settings = dict(lr_schedule="cosine", momentum_schedule="cosine", warmup_epochs=0.25)

    def fit(steps, batch, callbacks, ckpt_path=None):
        seed_everything(0, verbose=False)
        trainer = cpu_trainer(
            max_steps=steps, max_epochs=-1, callbacks=callbacks, limit_val_batches=0, enable_checkpointing=True
        )
        trainer.fit(tiny_moco(**settings), tiny_data(batch_size=batch), ckpt_path=ckpt_path)

    planned, resumed = _RecordSchedules(), _RecordSchedules()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=resume_at, save_top_k=-1, filename="{step}")
    fit(8, 16, [planned, ckpt])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(steps_then, batch_then, [resumed], tmp_path / f"step={resume_at}.ckpt")
    return planned, resumed, [str(w.message) for w in caught]


@pytest.mark.parametrize("steps_then", [16, 6])
def test_a_resumed_run_of_another_length_follows_the_schedules_of_that_length(tmp_path, steps_then):
    """Resumed at step 4 with max_steps 16 (or 6) instead of 8: from step 4 on, the lr and the momentum are those of
    a run planned for 16 (or 6) steps, as if it had been planned so from the start (warm-up unchanged: 1 step), ending
    at lr 0 and momentum 1 on the last step; the warning names the step the run ends at and the lr it follows."""
    from helpers.models import cosine

    planned, resumed, messages = _planned_then_resumed(tmp_path, steps_then)
    peak = 0.06 * 16 / 256
    assert planned.lrs[0] == 0 and planned.lrs[1] == pytest.approx(peak)  # warm-up from 0 over 1 step
    for t in range(4, steps_then):
        assert resumed.lrs[t] == pytest.approx(peak * cosine(t - 1, steps_then - 1, 1.0, 0.0)), t
        assert resumed.momenta[t] == pytest.approx(cosine(t, steps_then, 0.9, 1.0)), t
    lrs = [resumed.lrs[t] for t in range(4, steps_then)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))  # monotone: no restart of the warm-up
    now = peak * cosine(3, steps_then - 1, 1.0, 0.0)
    assert any(
        f"resumed at step 4, the run now ends at step {steps_then} (the checkpoint's run was planned for 8 steps)" in m
        and f"{now:.4g} now" in m
        for m in messages
    ), messages


def test_a_resumed_run_with_another_batch_rescales_the_lr_and_says_so(tmp_path):
    """Resumed at an epoch's end (step 4) with batch 32 instead of 16: the lr follows the scaling rule (x2) with
    a warning, instead of the old base lr without a word; a resume mid-epoch with another batch is refused (the
    epoch's position is counted in batches of the old size)."""
    planned, resumed, messages = _planned_then_resumed(tmp_path, 8, batch_then=32)
    assert resumed.lrs[4] == pytest.approx(2 * planned.lrs[4])
    assert any("global batch is 32, the checkpoint's run used 16" in m and "rescaled by 2" in m for m in messages)
    with pytest.raises(ConfigError, match=r"mid-epoch .*batch_size 16 then, 32 now"):
        _planned_then_resumed(tmp_path / "mid", 8, batch_then=32, resume_at=2)


def lr_factor(schedule, warmup, total, milestones):
    """The lr multiplier of each step on a plan of ``total`` steps that never changed length."""
    return functools.partial(plan.lr_factor, plan.StepPlan(total, warmup, milestones, 256), schedule)


def test_warmup_then_cosine_is_the_official_v3_formula_at_chosen_steps():
    """moco-v3's adjust_learning_rate at t = step/steps_per_epoch: lr·t/w during warm-up (0 at the first step), then
    lr·(1 + cos(π(t − w)/(E − w)))/2."""
    steps_per_epoch, warmup_epochs, epochs = 10, 2, 10
    f = lr_factor("cosine", warmup_epochs * steps_per_epoch, epochs * steps_per_epoch, [])
    for step in (0, 1, 7, 19, 20, 21, 55, 99):
        t = step / steps_per_epoch
        expected = (
            t / warmup_epochs
            if t < warmup_epochs
            else 0.5 * (1 + math.cos(math.pi * (t - warmup_epochs) / (epochs - warmup_epochs)))
        )
        assert f(step) == pytest.approx(expected, abs=1e-12), step
    assert f(0) == 0.0 and f(20) == 1.0


def test_cosine_without_warmup_and_the_v1_steps_at_chosen_steps():
    f = lr_factor("cosine", 0, 200, [])
    assert [f(s) for s in (0, 50, 100, 150, 200)] == pytest.approx([1.0, (1 + 2**-0.5) / 2, 0.5, (1 - 2**-0.5) / 2, 0])
    v1 = lr_factor("step", 0, 200, [120, 160])  # the v1 paper's ×0.1 at epochs 120 and 160 (1 step per epoch here)
    assert [v1(s) for s in (0, 119, 120, 159, 160, 199)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    assert lr_factor("constant", 3, 100, [])(50) == 1.0 and lr_factor("constant", 3, 100, [])(1) == pytest.approx(1 / 3)
