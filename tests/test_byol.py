import math

import pytest
import torch
import torch.nn.functional as F
from helpers.data import tiny_data
from helpers.models import tiny
from helpers.trainers import cpu_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from moco_lightning import BYOL
from moco_lightning.modules.loss import normalized_mse


def test_normalized_mse_is_the_squared_distance_of_unit_vectors(seeded):
    p, z = torch.randn(5, 8), torch.randn(5, 8)
    by_hand = ((F.normalize(p, dim=1) - F.normalize(z, dim=1)) ** 2).sum(1).mean()
    torch.testing.assert_close(normalized_mse(p, z), by_hand)


def test_loss_is_symmetrised_online_prediction_of_the_other_views_target(seeded):
    model = tiny(BYOL)
    x0, x1 = torch.randn(4, 1, 28, 28), torch.randn(4, 1, 28, 28)
    out = model.views_loss([x0, x1])
    x = torch.cat([x0, x1])
    p0, p1 = model.prediction_head(model.projection_head(model.backbone(x))).chunk(2)
    z0, z1 = model.target_projection_head(model.target_backbone(x)).chunk(2)
    torch.testing.assert_close(out["loss"], normalized_mse(p0, z1) + normalized_mse(p1, z0))


class Record(Callback):
    """Online weights after each optimizer step and the target before its momentum update (callbacks' hooks run
    before the module's), and the target after it (at the next batch's start and at the end)."""

    def __init__(self):
        self.online, self.target_before, self.target_after = [], [], []

    @staticmethod
    def flat(modules):
        return torch.cat([p.detach().flatten().clone() for m in modules for p in m.parameters()])

    def on_train_batch_start(self, trainer, model, batch, batch_idx):
        if self.online:
            self.target_after.append(self.flat([model.target_backbone, model.target_projection_head]))

    def on_train_batch_end(self, trainer, model, outputs, batch, batch_idx):
        self.online.append(self.flat([model.backbone, model.projection_head]))
        self.target_before.append(self.flat([model.target_backbone, model.target_projection_head]))
        assert all(p.grad is None for p in model.target_backbone.parameters())

    def on_train_end(self, trainer, model):
        self.target_after.append(self.flat([model.target_backbone, model.target_projection_head]))


def test_target_gets_no_gradient_and_moves_only_by_the_cosine_momentum(seeded):
    model = tiny(BYOL, momentum=0.9, momentum_schedule="cosine")
    record = Record()
    cpu_trainer(max_steps=3, callbacks=[record]).fit(model, tiny_data())
    assert all(not p.requires_grad for p in model.target_backbone.parameters())
    assert len(record.target_after) == 3
    # the update after the j-th step uses τ(j), j = 1, 2, 3 (the official MoCo v3 indexing, one for every method)
    for j, (online, before, after) in enumerate(zip(record.online, record.target_before, record.target_after), 1):
        m = 1 - 0.1 * (math.cos(math.pi * j / 3) + 1) / 2
        assert model.momentum_copy.at(model, j) == pytest.approx(m)
        torch.testing.assert_close(after, m * before + (1 - m) * online)
    assert model.momentum_copy.at(model, 0) == 0.9 and model.momentum_copy.at(model, 3) == 1.0


def test_a_step_checkpoint_holds_that_steps_momentum_update(seeded, tmp_path):
    model = tiny(BYOL)
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    cpu_trainer(max_steps=2, callbacks=[saves], enable_checkpointing=True).fit(model, tiny_data())
    saved = torch.load(next(tmp_path.glob("*step=2*.ckpt")), weights_only=True)["state_dict"]
    for name, value in model.state_dict().items():
        if name.startswith("target_"):
            assert torch.equal(saved[name], value), name


def test_refuses_half_precision_weights(seeded):
    with pytest.raises(ValueError, match="target network"):
        cpu_trainer(max_steps=1, precision="bf16-true").fit(tiny(BYOL), tiny_data())


def test_loss_is_fp32_under_bf16_autocast(seeded):
    """Under bf16 autocast the loss is fp32 and equals 2 - 2 cos of the same predictions and targets in float64."""
    model = tiny(BYOL)
    model.train()
    x0, x1 = torch.randn(16, 1, 28, 28), torch.randn(16, 1, 28, 28)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.views_loss([x0, x1])["loss"]
        x = torch.cat([x0, x1])
        p0, p1 = model.prediction_head(model.projection_head(model.backbone(x))).float().chunk(2)
        with torch.no_grad():
            z0, z1 = model.target_projection_head(model.target_backbone(x)).float().chunk(2)

    def by_hand(p, z):
        return (2 - 2 * torch.nn.functional.cosine_similarity(p.double(), z.double(), dim=1)).mean()

    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), by_hand(p0, z1) + by_hand(p1, z0), rtol=1e-5, atol=1e-6)
