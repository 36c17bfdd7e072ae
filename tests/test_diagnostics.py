"""Alignment / uniformity by hand, and the key-encoder drift and queue age on a module whose numbers are known."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.data import ToyData
from helpers.models import TinyNet
from helpers.trainers import RecordingLogger, trainer
from torch import nn

from moco_lightning.callbacks import RepresentationDiagnostics, alignment, mean_queue_age, uniformity


def test_alignment_and_uniformity_by_hand():
    e = torch.eye(3)
    assert float(alignment(e, e)) == 0.0
    assert float(alignment(e[:2], e[[1, 0]])) == pytest.approx(2.0)  # ||e0 - e1||² = 2
    # pairs of {e0, e1, -e0}: squared distances 2, 4, 2
    x = torch.stack([e[0], e[1], -e[0]])
    assert float(uniformity(x)) == pytest.approx(math.log((2 * math.exp(-4) + math.exp(-8)) / 3))
    assert float(uniformity(torch.stack([e[0], e[0]]))) == pytest.approx(0.0)  # collapsed: log 1


def test_mean_queue_age():
    assert mean_queue_age(torch.tensor([5, 5, 2, -1]), 6) == (2.0, 0.75)  # ages 1, 1, 4; one slot never written
    age, filled = mean_queue_age(torch.full((4,), -1), 3)
    assert math.isnan(age) and filled == 0.0


class FakeQueue(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.register_buffer("enqueued_at", torch.full((size,), -1, dtype=torch.long))
        self.ptr = 0


class MoCoLike(TinyNet):
    """Not MoCo, but with its two hooks: a key encoder shrunk by 0.9 and 2 queue slots written per step,
    both in the module's ``on_train_batch_end`` (which Lightning runs after the callbacks' hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.key_backbone = nn.Linear(4, 4).requires_grad_(False)
        self.dictionary = FakeQueue(8)

    def momentum_copies(self) -> dict[str, str]:
        return {"backbone": "key_backbone"}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for p in self.key_backbone.parameters():
                p.mul_(0.9)
        for _ in range(2):
            self.dictionary.enqueued_at[self.dictionary.ptr] = self.global_step
            self.dictionary.ptr = (self.dictionary.ptr + 1) % 8


def test_diagnostics_on_a_plain_module_with_known_numbers(seeded):
    net, logger = MoCoLike(), RecordingLogger()
    trainer(max_steps=6, logger=logger, callbacks=[RepresentationDiagnostics(every_n_steps=2)]).fit(
        net, datamodule=ToyData()
    )

    # θ_k(t) = 0.9 θ_k(t-1): a relative change of exactly 0.1 per step
    assert logger.series("diag/key_rel_change") == [
        (2, pytest.approx(0.1)),
        (4, pytest.approx(0.1)),
        (6, pytest.approx(0.1)),
    ]
    # at the callback of step g the slots hold the write steps 1..g-1 (2 per step, 8 slots):
    # g=2: [1,1] -> age 1; g=4: [1,1,2,2,3,3] -> ages 3,3,2,2,1,1 -> 2; g=6: [5,5,2,2,3,3,4,4] -> 2.5
    assert logger.series("diag/queue_age") == [(2, 1.0), (4, 2.0), (6, 2.5)]
    assert logger.series("diag/queue_filled") == [(2, 0.25), (4, 0.75), (6, 1.0)]
    # alignment / uniformity of the very q, k that training_step returned at those steps (batch g-1)
    for step, value in logger.series("diag/alignment"):
        out = net.outputs[step - 1]
        assert value == pytest.approx(float(alignment(out["q"], out["k"])), rel=1e-5)
    for step, value in logger.series("diag/uniformity"):
        assert value == pytest.approx(float(uniformity(net.outputs[step - 1]["q"])), rel=1e-5)
        assert -8.0 <= value <= 0.0
    assert [s for s, _ in logger.series("diag/q_std")] == [2, 4, 6]


def test_diagnostics_on_moco(seeded):
    from helpers.data import tiny_data
    from helpers.models import tiny_moco

    moco, logger = tiny_moco(queue_size=32), RecordingLogger()
    trainer(max_steps=4, logger=logger, callbacks=[RepresentationDiagnostics(every_n_steps=2)]).fit(
        moco, datamodule=tiny_data()
    )
    changes = [v for _, v in logger.series("diag/key_rel_change")]
    assert len(changes) == 2 and all(0.0 < v < 1.0 for v in changes)  # m = 0.9: the key encoder moves, slowly
    # 16 keys per step into 32 slots, written at steps 1, 2, 3: at step 2 one batch (age 1), at step 4 the
    # queue holds steps 2 and 3 -> ages 2 and 1
    assert logger.series("diag/queue_age") == [(2, 1.0), (4, 1.5)]
    assert all(0.0 <= v <= 4.0 for _, v in logger.series("diag/alignment"))


def test_key_drift_works_with_channels_last_weights():
    from helpers.data import tiny_data
    from helpers.models import tiny_moco
    from helpers.trainers import cpu_trainer

    from moco_lightning.callbacks import RepresentationDiagnostics

    def drift(m):
        model = tiny_moco(backbone="resnet18", width=0.25, hidden_dim=16, channels_last=True, momentum=m)
        logger = RecordingLogger()
        diag = RepresentationDiagnostics(every_n_steps=1)
        cpu_trainer(max_steps=3, callbacks=[diag], limit_val_batches=0, logger=logger, log_every_n_steps=1).fit(
            model, tiny_data()
        )
        assert model.key_backbone.conv1.weight.is_contiguous(memory_format=torch.channels_last)
        return [r["diag/key_rel_change"] for _, r in logger.records if "diag/key_rel_change" in r]

    moving, frozen = drift(0.9), drift(1.0)  # the logged drift is read: it moves with m, and is 0 when f_k is fixed
    assert moving and all(math.isfinite(v) and 0 < v < 1 for v in moving)
    assert frozen and all(v == 0.0 for v in frozen)


def test_diagnostics_see_byols_target_network_and_its_embeddings(seeded):
    """BYOL's momentum copy is its target network: the drift and the embeddings' health are logged as MoCo's."""
    from helpers.data import tiny_data
    from helpers.models import tiny

    from moco_lightning import BYOL

    model, logger = tiny(BYOL, momentum=0.9, momentum_schedule="constant"), RecordingLogger()
    trainer(max_steps=4, logger=logger, callbacks=[RepresentationDiagnostics(every_n_steps=2)]).fit(
        model, datamodule=tiny_data()
    )
    changes = [v for _, v in logger.series("diag/key_rel_change")]
    assert len(changes) == 2 and all(0.0 < v < 1.0 for v in changes)
    assert [s for s, _ in logger.series("diag/alignment")] == [2, 4]
    assert all(0.0 <= v <= 4.0 for _, v in logger.series("diag/alignment"))
    assert not logger.series("diag/queue_age")  # no dictionary
