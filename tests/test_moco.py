import math

import pytest
import torch
import torch.nn.functional as F
from helpers.data import tiny_data
from helpers.models import tiny_moco
from helpers.resume import assert_states_equal, key_state
from helpers.trainers import cpu_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from moco_lightning import MoCo


# --- construction --------------------------------------------------------------------------
def test_forward_returns_backbone_features_and_key_encoder_is_frozen_copy(seeded):
    model = tiny_moco()
    x = torch.randn(4, 1, 28, 28)
    assert model(x).shape == (4, model.feature_dim) == (4, 16)
    for (nq, pq), (nk, pk) in zip(model.backbone.named_parameters(), model.key_backbone.named_parameters()):
        assert nq == nk and torch.equal(pq, pk) and pq.requires_grad and not pk.requires_grad
    assert all(not p.requires_grad for p in model.key_projection_head.parameters())
    assert model.dictionary.keys.shape == (32, 8)


def test_torchvision_backbone_with_small_grayscale_stem():
    model = MoCo(backbone="resnet18", cifar_stem=True, in_channels=1, queue_size=16, dim=8, hidden_dim=16)
    assert model.feature_dim == 512
    assert model.backbone.conv1.in_channels == 1 and model.backbone.conv1.kernel_size == (3, 3)
    assert isinstance(model.backbone.maxpool, torch.nn.Identity)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 512)
    linear = MoCo(backbone="resnet18", head="linear", queue_size=16, dim=8)
    assert sum(isinstance(m, torch.nn.Linear) for m in linear.projection_head.modules()) == 1


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"queue_size": -1}, "queue_size"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"momentum": 1.5}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"head": "conv"}, "head"),
        ({"lr_schedule": "linear"}, "lr_schedule"),
        ({"momentum_schedule": "step"}, "momentum_schedule"),
        ({"lr": 0}, "lr"),
        ({"dim": 0}, "dim"),
    ],
)
def test_bad_arguments_name_the_argument_and_allowed_values(kwargs, name):
    with pytest.raises(ValueError, match=rf"MoCo: {name}=.* not allowed; {name} must be"):
        tiny_moco(**kwargs)


def test_unknown_backbone_lists_the_names():
    with pytest.raises(
        ValueError, match=r"backbone='resnet17' is not a torchvision classification model; use one of \[.*'resnet18'"
    ):
        MoCo(backbone="resnet17")


# --- momentum ------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [0.0, 0.5, 0.999])
def test_momentum_update_follows_the_formula(seeded, m):
    model = tiny_moco()
    with torch.no_grad():
        for p in [*model.backbone.parameters(), *model.projection_head.parameters()]:
            p.add_(torch.randn_like(p))
    q = [p.clone() for p in [*model.backbone.parameters(), *model.projection_head.parameters()]]
    k = [p.clone() for p in [*model.key_backbone.parameters(), *model.key_projection_head.parameters()]]
    model.momentum_copy.update(model, m)
    after = [*model.key_backbone.parameters(), *model.key_projection_head.parameters()]
    for pk, pq, new in zip(k, q, after):
        torch.testing.assert_close(new, pk * m + pq * (1 - m), rtol=0, atol=1e-6)
    if m == 0.0:
        assert all(torch.equal(new, pq) for new, pq in zip(after, q))


class CountUpdates(Callback):
    def __init__(self):
        self.updates, self.batches = 0, 0

    def on_train_start(self, trainer, pl_module):
        original = pl_module.momentum_copy.update  # the one momentum piece (MomentumCopy)

        def counted(owner, m):
            self.updates += 1
            original(owner, m)

        pl_module.momentum_copy.update = counted

    def on_train_batch_end(self, *args):
        self.batches += 1


@pytest.mark.parametrize("accumulate,expected_updates", [(1, 4), (2, 2)])
def test_momentum_applied_once_per_optimizer_step(seeded, accumulate, expected_updates):
    counter = CountUpdates()
    model = tiny_moco(queue_size=128)  # 4 batches of 16 keys move the pointer to 64 (with K 32 it would be back at 0)
    trainer = cpu_trainer(accumulate_grad_batches=accumulate, callbacks=[counter], limit_val_batches=0)
    trainer.fit(model, tiny_data())
    assert counter.batches == 4
    assert counter.updates == expected_updates == trainer.global_step
    assert model.dictionary.ptr.item() == 4 * 16  # every batch's keys are enqueued, micro-batches included


def test_key_encoder_gets_no_gradient_and_no_optimizer_state(seeded):
    model = tiny_moco()
    trainer = cpu_trainer(limit_val_batches=0)
    trainer.fit(model, tiny_data())
    key_params = [*model.key_backbone.parameters(), *model.key_projection_head.parameters()]
    assert all(p.grad is None and not p.requires_grad for p in key_params)
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in key_params}
    assert len(optimized) == len([*model.backbone.parameters(), *model.projection_head.parameters()])
    # as the official main_moco.py (SGD over model.parameters()): every parameter decays, norms and biases included
    groups = trainer.optimizers[0].param_groups
    assert len(groups) == 1 and groups[0]["weight_decay"] == 1e-4 and len(groups[0]["params"]) == len(optimized)
    assert model.hparams.decay_norm_bias is True


def test_decay_norm_bias_false_spares_norms_and_biases(seeded):
    model = tiny_moco(decay_norm_bias=False)
    trainer = cpu_trainer(limit_val_batches=0, max_steps=1)
    trainer.fit(model, tiny_data())
    groups = trainer.optimizers[0].param_groups
    assert groups[0]["weight_decay"] == 1e-4 and groups[1]["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in groups[0]["params"]) and all(p.ndim == 1 for p in groups[1]["params"])


def test_cosine_momentum_schedule_follows_optimizer_steps(seeded):
    model = tiny_moco(momentum=0.9, momentum_schedule="cosine")
    seen = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.append(trainer.callback_metrics["train/momentum"].item())

    trainer = cpu_trainer(max_epochs=2, callbacks=[Record()], limit_val_batches=0)
    trainer.fit(model, tiny_data())
    total = 8  # logged: the m of the update that follows each step, m(j) for j = 1..8 (m(8) = 1)
    expected = [1 - 0.1 * (math.cos(math.pi * s / total) + 1) / 2 for s in range(1, total + 1)]
    assert seen == pytest.approx(expected, abs=1e-6)
    assert seen[-1] == 1.0


def test_key_encoder_after_step_j_is_blended_with_the_official_m_of_j(seeded):
    """The official v3 indexing (moco-v3 main_moco.py: iteration j blends the weights after j steps with m(j)); a
    schedule one step behind (m(j - 1), this library before) fails: 0.99 vs 0.99146 after the first step."""
    flat = lambda modules: torch.cat([p.detach().flatten().clone() for m in modules for p in m.parameters()])  # noqa: E731
    records = []

    class Record(Callback):  # callbacks' on_train_batch_end runs before the module's momentum update
        def on_train_batch_end(self, trainer, pl_module, *args):
            records.append(
                (
                    flat([pl_module.backbone, pl_module.projection_head]),
                    flat([pl_module.key_backbone, pl_module.key_projection_head]),
                )
            )

    model = tiny_moco(momentum=0.99, momentum_schedule="cosine")
    cpu_trainer(max_steps=4, callbacks=[Record()], limit_val_batches=0).fit(model, tiny_data())
    after = [key for _, key in records[1:]] + [flat([model.key_backbone, model.key_projection_head])]
    official = [0.991464466, 0.995, 0.998535534, 1.0]  # 1 − 0.5·(1 + cos(π j/4))·0.01, j = 1..4
    for j, ((query, before), now, m) in enumerate(zip(records, after, official), start=1):
        torch.testing.assert_close(now, m * before + (1 - m) * query, rtol=0, atol=1e-6, msg=f"step {j}")
    assert not torch.allclose(after[0], 0.99 * records[0][1] + 0.01 * records[0][0], rtol=0, atol=1e-6)


def test_training_loss_matches_hand_computation(seeded):
    """The expectation uses a queue snapshot taken before ``contrast``: a contrast that changed the queue (e.g.
    enqueued k before the loss) cannot match itself."""
    model = tiny_moco()
    x1, x2 = torch.randn(8, 1, 28, 28), torch.randn(8, 1, 28, 28)
    queue_before = model.dictionary.keys.clone()
    out = model.views_loss([x1, x2])
    assert torch.equal(model.dictionary.keys, queue_before)
    q = F.normalize(model.projection_head(model.backbone(x1)), dim=1)
    k = F.normalize(model.key_projection_head(model.key_backbone(x2)), dim=1)
    logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue_before.T], 1) / 0.2
    expected = -torch.log_softmax(logits, 1)[:, 0].mean()
    assert torch.allclose(out["loss"], expected, atol=1e-6)


def test_symmetric_loss_and_both_keys_enqueued(seeded):
    model = tiny_moco(symmetric=True)
    x1, x2 = torch.randn(8, 1, 28, 28), torch.randn(8, 1, 28, 28)
    out = model.views_loss([x1, x2])
    queue = model.dictionary.keys
    from moco_lightning.modules.loss import info_nce

    _, q1 = model.query(x1)
    _, q2 = model.query(x2)
    expected = info_nce(q1, model.key(x2), queue, 0.2)[0] + info_nce(q2, model.key(x1), queue, 0.2)[0]
    assert torch.allclose(out["loss"], expected, atol=1e-6)
    assert out["stored"][0].shape == (16, 8)
    model2 = tiny_moco(symmetric=True)
    cpu_trainer(limit_val_batches=0, max_steps=1).fit(model2, tiny_data())
    assert model2.dictionary.ptr.item() == 32 % 32 and (model2.dictionary.enqueued_at == 1).sum() == 32


# --- checkpoints and exact resume ----------------------------------------------------------
@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_checkpoint_round_trip_is_bit_exact(seeded, tmp_path):
    model = tiny_moco(backbone="resnet18", cifar_stem=True, hidden_dim=16)
    trainer = cpu_trainer(limit_val_batches=0, max_steps=2)
    trainer.fit(model, tiny_data())
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    loaded = MoCo.load_from_checkpoint(path)
    assert_states_equal(key_state(model), key_state(loaded))
    assert loaded.dictionary.ptr.item() == 32 % 32 and torch.equal(
        loaded.dictionary.enqueued_at, model.dictionary.enqueued_at
    )
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.load(path, weights_only=True)["global_step"] == 2  # the momentum schedule's clock


def test_step_checkpoints_hold_the_steps_momentum_update_and_keys(seeded, tmp_path):
    """ModelCheckpoint saves in its on_train_batch_end, before the module's: the checkpoint must still be whole."""
    states = {}

    class After(Callback):  # registered after ModelCheckpoint: records what the module ends the step with
        def on_train_batch_start(self, trainer, pl_module, *args):
            if trainer.global_step:
                states[trainer.global_step] = key_state(pl_module)

    model = tiny_moco()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    cpu_trainer(callbacks=[checkpoint, After()], enable_checkpointing=True, limit_val_batches=0).fit(model, tiny_data())
    for step in (1, 2, 3):
        saved = torch.load(tmp_path / f"step={step}.ckpt", weights_only=True)["state_dict"]
        assert saved["dictionary.ptr"].item() == step * 16 % 32 and saved["dictionary.enqueued_at"].max().item() == step
        for name, value in states[step].items():
            assert torch.equal(saved[name], value), (step, name)


def test_symmetric_v2_enqueues_k1_then_k2_as_the_official_cifar_demo(seeded):
    """The official demo's symmetric loss enqueues torch.cat([k1, k2]), k1 = f_k(x1) (not [f_k(x2), f_k(x1)])."""
    model = tiny_moco(symmetric=True)
    x1, x2 = torch.randn(8, 1, 28, 28), torch.randn(8, 1, 28, 28)
    out = model.views_loss([x1, x2])
    torch.testing.assert_close(out["stored"][0], torch.cat([model.key(x1), model.key(x2)]), rtol=0, atol=1e-6)
