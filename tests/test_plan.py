"""The schedules' plan: a fit given another length in the middle stretches the rest of its lr and momentum
schedules (continuous at that step, the planned end at the new last step) and stops there."""

import math

import pytest
from helpers.data import tiny_data
from helpers.models import tiny_moco
from helpers.trainers import cpu_trainer
from lightning.pytorch import Callback

from moco_lightning.optim import cosine
from moco_lightning.plan import change_length


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
