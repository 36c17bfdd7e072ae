import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers.data import tiny_data
from helpers.models import tiny_moco
from helpers.trainers import cpu_trainer
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from moco_lightning import EndToEnd, MemoryBankMoCo, MoCo, MoCoV3
from moco_lightning.errors import ConfigError
from moco_lightning.negatives import InBatch


def key_state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if k.startswith(("key_", "dictionary."))}


def assert_states_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


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


# --- the loss inside the module ------------------------------------------------------------
def test_positive_key_is_never_among_the_negatives(seeded):
    """The negatives the loss used (``sims[:, 1:]``) are exactly q against the queue as it was before the step, and
    ``contrast`` leaves the queue alone: enqueueing k before the loss fails both."""
    model = tiny_moco(queue_size=64)
    cpu_trainer(max_steps=2, limit_val_batches=0).fit(model, tiny_data())  # a queue holding real keys
    model.train()
    x1, x2 = torch.randn(8, 1, 28, 28), torch.randn(8, 1, 28, 28)
    before = model.dictionary.keys.clone()
    out = model.views_loss([x1, x2])
    assert torch.equal(model.dictionary.keys, before)
    torch.testing.assert_close(out["sims"][:, 1:], out["q"] @ before.T, rtol=0, atol=1e-6)
    torch.testing.assert_close(out["sims"][:, 0], (out["q"] * out["k"]).sum(1), rtol=0, atol=1e-6)
    assert (out["k"] @ before.T).max() < 1 - 1e-4  # this step's keys are not among its negatives


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
    from moco_lightning.loss import info_nce

    _, q1 = model.query(x1)
    _, q2 = model.query(x2)
    expected = info_nce(q1, model.key(x2), queue, 0.2)[0] + info_nce(q2, model.key(x1), queue, 0.2)[0]
    assert torch.allclose(out["loss"], expected, atol=1e-6)
    assert out["stored"][0].shape == (16, 8)
    model2 = tiny_moco(symmetric=True)
    cpu_trainer(limit_val_batches=0, max_steps=1).fit(model2, tiny_data())
    assert model2.dictionary.ptr.item() == 32 % 32 and (model2.dictionary.enqueued_at == 1).sum() == 32


def test_queue_size_zero_uses_in_batch_negatives(seeded):
    model = tiny_moco(queue_size=0)
    cpu_trainer(limit_val_batches=0, max_steps=2).fit(model, tiny_data())
    assert isinstance(model.dictionary, InBatch)  # no queue: nothing stored, no buffer
    assert not any(k.startswith("dictionary.") for k in model.state_dict()) and model.dictionary_buffers() == []
    out = model.views_loss([torch.randn(8, 1, 28, 28), torch.randn(8, 1, 28, 28)])
    assert out["sims"].shape == (8, 8) and out["labels"].tolist() == list(range(8))


# --- lr ------------------------------------------------------------------------------------
def test_lr_is_per_256_images_and_scaled_by_the_batch(seeded):
    model = tiny_moco(lr=0.03, lr_schedule="constant", warmup_epochs=1)
    trainer = cpu_trainer(limit_val_batches=0, max_epochs=2)
    lrs = []

    class Record(Callback):
        def on_train_batch_start(self, trainer, *args):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer.callbacks.append(Record())
    trainer.fit(model, tiny_data(batch_size=16))
    peak = 0.03 * 16 / 256  # warm-up from 0 as the official v3 code: lr · t / warmup_epochs at t = step / 4
    assert lrs == pytest.approx([peak * s / 4 for s in (0, 1, 2, 3)] + [peak] * 4)


# --- validation never touches the dictionary -----------------------------------------------
def test_validation_leaves_queue_and_key_encoder_untouched(seeded):
    model = tiny_moco()
    dm = tiny_data()
    cpu_trainer(limit_val_batches=0, max_steps=2).fit(model, dm)
    before = key_state(model)
    trainer = cpu_trainer()
    metrics = trainer.validate(model, dm, verbose=False)[0]
    assert_states_equal(before, key_state(model))
    assert metrics["val/loss"] > 0 and 0 <= metrics["val/acc1"] <= 1
    trainer.predict(model, dm.eval_val_dataloader())
    assert_states_equal(before, key_state(model))


# --- checkpoints and exact resume ----------------------------------------------------------
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


def test_two_epochs_equal_one_epoch_resume_one_epoch(tmp_path):
    def run(ckpt_path=None, callbacks=()):
        seed_everything(0, verbose=False)
        model = tiny_moco(momentum_schedule="cosine", lr_schedule="cosine", warmup_epochs=0.5)
        trainer = cpu_trainer(
            max_epochs=2, callbacks=list(callbacks), enable_checkpointing=bool(callbacks), limit_val_batches=1
        )
        trainer.fit(model, tiny_data(), ckpt_path=ckpt_path)
        return model

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    straight = run(callbacks=[checkpoint])
    resumed = run(ckpt_path=tmp_path / "epoch=0.ckpt")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


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


# --- MoCo v3 and the paper's other dictionaries ---------------------------------------------
def test_v3_loss_equals_hand_computation_and_predictor_is_query_only(seeded):
    T = 0.5
    model = tiny_moco(MoCoV3, hidden_dim=16, temperature=T, momentum=0.99, momentum_schedule="cosine", optimizer="lars")
    assert (
        isinstance(model.projection_head.layers[-1], torch.nn.BatchNorm1d)
        and not model.projection_head.layers[-1].affine
    )
    assert not any(n.startswith("key_prediction") for n, _ in model.named_parameters())
    x1, x2 = torch.randn(6, 1, 28, 28), torch.randn(6, 1, 28, 28)
    model.train()
    loss = model.views_loss([x1, x2])["loss"]

    def q_of(x):
        return F.normalize(model.prediction_head(model.projection_head(model.backbone(x))), dim=1)

    def k_of(x):
        with torch.no_grad():
            return F.normalize(model.key_projection_head(model.key_backbone(x)), dim=1)

    labels = torch.arange(6)
    expected = (
        2
        * T
        * (F.cross_entropy(q_of(x1) @ k_of(x2).T / T, labels) + F.cross_entropy(q_of(x2) @ k_of(x1).T / T, labels))
    )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_v3_key_encoder_sees_x1_then_x2_as_the_official_builder(seeded):
    """The official v3 forward computes k1 = f_k(x1), then k2 = f_k(x2): the key encoder's BatchNorm running
    statistics follow that order (the other order, this library before, ends 3.5e-2 away after 4 steps)."""
    model = tiny_moco(MoCoV3, hidden_dim=16, optimizer="lars")
    x1, x2 = torch.randn(6, 1, 28, 28) + 2, torch.randn(6, 1, 28, 28) - 2
    official, swapped = copy.deepcopy(model.key_backbone), copy.deepcopy(model.key_backbone)
    model.train()
    model.views_loss([x1, x2])
    with torch.no_grad():
        official(x1), official(x2)
        swapped(x2), swapped(x1)
    bn = [m for m in model.key_backbone.modules() if isinstance(m, nn.BatchNorm2d)][0]
    bn_official = [m for m in official.modules() if isinstance(m, nn.BatchNorm2d)][0]
    bn_swapped = [m for m in swapped.modules() if isinstance(m, nn.BatchNorm2d)][0]
    torch.testing.assert_close(bn.running_mean, bn_official.running_mean, rtol=0, atol=1e-7)
    assert not torch.allclose(bn.running_mean, bn_swapped.running_mean, rtol=0, atol=1e-4)


def test_symmetric_v2_enqueues_k1_then_k2_as_the_official_cifar_demo(seeded):
    """The official demo's symmetric loss enqueues torch.cat([k1, k2]), k1 = f_k(x1) (not [f_k(x2), f_k(x1)])."""
    model = tiny_moco(symmetric=True)
    x1, x2 = torch.randn(8, 1, 28, 28), torch.randn(8, 1, 28, 28)
    out = model.views_loss([x1, x2])
    torch.testing.assert_close(out["stored"][0], torch.cat([model.key(x1), model.key(x2)]), rtol=0, atol=1e-6)


def test_v3_resnets_start_with_zero_initialised_residual_branches():
    """As the official v3 (torchvision's zero_init_residual=True): the last BN of every block starts at 0, the key
    encoder is a copy; v2 and zero_init_residual=False keep torchvision's init."""
    v3 = MoCoV3(backbone="resnet18", width=0.25, in_channels=1, cifar_stem=True, image_size=28, hidden_dim=16, dim=8)
    blocks = [m for m in v3.backbone.modules() if type(m).__name__ == "BasicBlock"]
    assert len(blocks) == 8 and all(torch.count_nonzero(b.bn2.weight) == 0 for b in blocks)
    assert all(torch.count_nonzero(b.bn1.weight) > 0 for b in blocks)
    for a, b in zip(v3.backbone.state_dict().values(), v3.key_backbone.state_dict().values()):
        assert torch.equal(a, b)
    for model in (
        MoCoV3(backbone="resnet18", width=0.25, hidden_dim=16, dim=8, zero_init_residual=False),
        MoCo(backbone="resnet18", width=0.25, hidden_dim=16, dim=8, queue_size=16),
    ):
        assert all(torch.count_nonzero(m.bn2.weight) > 0 for m in model.backbone.modules() if hasattr(m, "bn2"))


def test_batch_dictionary_has_no_key_encoder_and_gradients_through_both_views(seeded):
    model = tiny_moco(EndToEnd)
    assert not hasattr(model, "key_backbone") and not hasattr(model, "key_projection_head")
    assert not any(k.startswith("key_") for k in model.state_dict())
    x1, x2 = torch.randn(8, 1, 28, 28, requires_grad=True), torch.randn(8, 1, 28, 28, requires_grad=True)
    model.views_loss([x1, x2])["loss"].backward()
    assert x1.grad.abs().sum() > 0 and x2.grad.abs().sum() > 0


def test_memory_bank_step_updates_exactly_the_batch_rows(seeded):
    model = tiny_moco(MemoryBankMoCo, memory_bank_size=20, num_negatives=12, bank_momentum=0.3)
    assert not hasattr(model, "key_backbone")
    before = model.dictionary.features.clone()
    index = torch.tensor([3, 17, 9, 0])
    out = model.views_loss([torch.randn(4, 1, 28, 28), torch.randn(4, 1, 28, 28)], index)
    assert out["sims"].shape == (4, 13)  # the stored positive + 12 sampled negatives
    torch.testing.assert_close(out["sims"][:, 0], (out["q"] * before[index]).sum(1))
    model._stored = out["stored"]
    model.finish_step()
    expected = before.clone()
    expected[index] = F.normalize(0.3 * before[index] + 0.7 * out["q"], dim=1)  # m != 1 - m: a swap fails
    torch.testing.assert_close(model.dictionary.features, expected, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="memory_bank_size = the number of training images"):
        tiny_moco(MemoryBankMoCo)


@pytest.mark.parametrize("dictionary", ["queue", "batch", "memory_bank"])
def test_each_dictionary_trains_through_the_trainer(seeded, dictionary, one_torch_thread):
    cls = {"queue": MoCo, "batch": EndToEnd, "memory_bank": MemoryBankMoCo}[dictionary]
    extra = {"memory_bank_size": 64, "bank_momentum": 0.5} if dictionary == "memory_bank" else {}
    model = tiny_moco(cls, **extra)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cpu_trainer(max_steps=3, limit_val_batches=0).fit(model, tiny_data())
    assert model.global_step == 3
    after = model.state_dict()
    assert not torch.equal(before["backbone.0.weight"], after["backbone.0.weight"])
    if dictionary == "memory_bank":
        changed = (before["dictionary.features"] != after["dictionary.features"]).any(1)
        assert int(changed.sum()) == 3 * 16  # 3 batches of 16 distinct images of the 64


@pytest.mark.parametrize(
    "size,said",
    [
        (40, "memory_bank_size=40, but the training set has 64 images; set memory_bank_size to 64"),
        (100, "memory_bank_size=100, but the training set has 64 images: the rows of no image would stay random"),
    ],
)
def test_memory_bank_of_another_size_than_the_training_set_fails_at_fit_start(seeded, one_torch_thread, size, said):
    """Too small indexes outside the bank; too large serves never-updated random rows as negatives: both refused at
    fit start, before any callback's evaluation."""
    from moco_lightning.callbacks import KNNMonitor

    model = tiny_moco(MemoryBankMoCo, memory_bank_size=size, num_negatives=8, bank_momentum=0.5)
    knn = KNNMonitor(k=3)
    with pytest.raises(ValueError, match=said):
        cpu_trainer(max_steps=1, limit_val_batches=0, callbacks=[knn]).fit(model, tiny_data())
    assert model.global_step == 0 and not knn.measured_at


def test_symmetric_memory_bank_moves_each_row_once_towards_the_mean_query(seeded):
    model = tiny_moco(MemoryBankMoCo, memory_bank_size=10, num_negatives=6, bank_momentum=0.3, symmetric=True)
    before = model.dictionary.features.clone()
    index = torch.tensor([1, 8, 4])
    x1, x2 = torch.randn(3, 1, 28, 28), torch.randn(3, 1, 28, 28)
    out = model.views_loss([x1, x2], index)
    q1, q2 = out["q"], model.query(x2)[1].detach()
    model._stored = out["stored"]
    model.finish_step()
    expected = before.clone()
    expected[index] = F.normalize(0.3 * before[index] + 0.7 * (q1 + q2) / 2, dim=1)
    torch.testing.assert_close(model.dictionary.features, expected, rtol=0, atol=1e-6)


def test_bf16_mixed_trains_with_fp32_logits_queue_and_weights(seeded):
    model = tiny_moco(queue_size=64)
    seen = {}

    class Check(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.update(loss=outputs["loss"].dtype, q=outputs["q"].dtype, k=outputs["k"].dtype)

    cpu_trainer(max_steps=2, limit_val_batches=0, precision="bf16-mixed", callbacks=[Check()]).fit(model, tiny_data())
    assert seen == {"loss": torch.float32, "q": torch.float32, "k": torch.float32}
    assert model.dictionary.keys.dtype == torch.float32 and model.dictionary.ptr.item() == 32
    assert all(p.dtype == torch.float32 for p in model.key_backbone.parameters())


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_half_precision_weights_are_refused_with_the_reason(precision):
    with pytest.raises(ValueError, match=rf"precision='{precision}' stores the key encoder and the queue in half"):
        cpu_trainer(max_steps=1, limit_val_batches=0, precision=precision).fit(tiny_moco(), tiny_data())


def test_no_host_copy_of_the_key_shuffle_permutation(seeded, monkeypatch):
    """The shuffle permutation is drawn on the batch's device: nothing drawn on the CPU is copied over."""
    devices = []
    original = torch.randperm

    def recording(*args, **kwargs):
        devices.append((kwargs.get("device"), kwargs["generator"].device))
        return original(*args, **kwargs)

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            monkeypatch.setattr(torch, "randperm", recording)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            monkeypatch.undo()

    model = tiny_moco(shuffle_bn="split", bn_splits=4)
    cpu_trainer(max_steps=1, limit_val_batches=0, callbacks=[Record()]).fit(model, tiny_data())
    assert devices == [(torch.device("cpu"), torch.device("cpu"))]  # the batch's device (here the CPU), both


def test_split_shuffle_bn_permutes_the_key_batch_before_batchnorm(seeded):
    """Drawing the permutation and not applying it used to pass every test: here the keys must equal the key encoder
    run (split BN, train mode) on the permuted batch, un-permuted, and differ from the unshuffled keys."""
    from moco_lightning.split_bn import convert_split_bn

    model = tiny_moco(shuffle_bn="split", bn_splits=2)
    model._shuffle = "split"
    convert_split_bn(model.key_backbone, 2)
    model.train()
    x = torch.cat([torch.randn(4, 1, 28, 28) + 3, torch.randn(4, 1, 28, 28) - 3])  # the halves are the sub-batches
    k = model.key(x)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(1_000_003 * (0 + 1)))  # global step 0
    assert not torch.equal(perm, torch.arange(8))
    with torch.no_grad():
        shuffled = model._encode_key(x[perm])
        plain = model._encode_key(x)
    torch.testing.assert_close(k, torch.empty_like(shuffled).index_copy_(0, perm, shuffled), rtol=0, atol=1e-6)
    assert (k - plain).abs().max() > 1e-3  # the permutation changed what each sub-batch's BatchNorm saw


def test_after_fit_the_backbone_is_the_users_again_and_extracts_features(seeded):
    """README: ``model.eval(); features = model(images)`` after fit, for any batch size; split BN only while fitting."""
    from moco_lightning.split_bn import SplitBatchNorm2d

    model = tiny_moco(shuffle_bn="split", bn_splits=4)
    types = {name: type(m) for name, m in model.backbone.named_modules()}
    keys = set(model.state_dict())
    cpu_trainer(max_steps=2, limit_val_batches=0).fit(model, tiny_data())
    assert {name: type(m) for name, m in model.backbone.named_modules()} == types
    assert not any(isinstance(m, SplitBatchNorm2d) for m in model.modules())
    assert set(model.state_dict()) == keys
    model.eval()
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    features = model(torch.randn(5, 1, 28, 28))  # 5 does not split into 4 sub-batches
    assert features.shape == (5, 16)
    assert all(torch.equal(before[k], v) for k, v in model.backbone.state_dict().items())  # running stats untouched
    cpu_trainer(max_steps=3, limit_val_batches=0).fit(model, tiny_data())  # and it can be fitted again
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.backbone.modules())


def test_bn_splits_not_dividing_the_batch_fails_at_fit_start_naming_both_fields(seeded):
    from moco_lightning.callbacks import KNNMonitor

    monitor = KNNMonitor()
    with pytest.raises(
        ValueError, match=r"bn_splits=8 does not divide the per-device batch of 20 images .*data.batch_size"
    ):
        cpu_trainer(max_steps=1, limit_val_batches=0, callbacks=[monitor]).fit(
            tiny_moco(shuffle_bn="split", bn_splits=8), tiny_data(batch_size=20)
        )
    assert monitor.history == []  # before the kNN baseline, not after it


# --- multi-crop -----------------------------------------------------------------------------
@pytest.mark.parametrize("symmetric", [False, True])
def test_multi_crop_loss_equals_hand_computation(seeded, symmetric):
    """Every local query against the key of every global view of its image and the queue; loss = G x mean."""
    model = tiny_moco(symmetric=symmetric)
    model.eval()  # BN with running statistics: the formula, not the batch composition (local views go in as one batch)
    g1, g2 = torch.randn(6, 1, 28, 28), torch.randn(6, 1, 28, 28)
    locals_ = [torch.randn(6, 1, 14, 14) for _ in range(3)]
    loss = model.views_loss([g1, g2, *locals_])["loss"]

    def q_of(x):
        return F.normalize(model.projection_head(model.backbone(x)), dim=1)

    def k_of(x):
        with torch.no_grad():
            return F.normalize(model.key_projection_head(model.key_backbone(x)), dim=1)

    queue = model.dictionary.keys

    def ce(q, k):
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue.T], 1) / 0.2
        return -torch.log_softmax(logits, 1)[:, 0].mean()

    keys = [k_of(g2)] + ([k_of(g1)] if symmetric else [])
    terms = [ce(q_of(g1), keys[0])] + ([ce(q_of(g2), keys[1])] if symmetric else [])
    terms += [ce(q_of(lv), k) for lv in locals_ for k in keys]
    expected = len(keys) * torch.stack(terms).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_multi_crop_without_a_queue_gathers_each_global_key_once(seeded, monkeypatch):
    """In-batch negatives (v3) with multi-crop: 2 global + 3 local views, symmetric, are 2 + 6 loss terms over 2
    global keys: 2 all-gathers a step (it was one per term, 8; 14 with 6 local views), and the same loss."""
    from moco_lightning import MoCoV3
    from moco_lightning import loss as loss_module

    model = tiny_moco(MoCoV3)
    model.eval()
    g1, g2 = torch.randn(6, 1, 28, 28), torch.randn(6, 1, 28, 28)
    locals_ = [torch.randn(6, 1, 14, 14) for _ in range(3)]
    calls = []
    real = loss_module._gather_with_grad
    monkeypatch.setattr(loss_module, "_gather_with_grad", lambda x, eq: calls.append(x) or real(x, eq))
    loss = model.views_loss([g1, g2, *locals_])["loss"]
    assert len(calls) == 2
    with torch.no_grad():
        k1, k2 = (F.normalize(model.key_projection_head(model.key_backbone(g)), dim=1) for g in (g1, g2))
    torch.testing.assert_close(calls[0], k2)  # the keys of the first term (q1, k2), then of (q2, k1)
    torch.testing.assert_close(calls[1], k1)
    q = [model.query(x)[1] for x in (g1, g2, *locals_)]
    t = model.hparams.temperature

    def ce(q, k):  # in-batch: the positive of row i is key i
        return F.cross_entropy(q @ k.T / t, torch.arange(len(q)))

    terms = [ce(q[0], k2), ce(q[1], k1)] + [ce(lq, k) for lq in q[2:] for k in (k2, k1)]
    torch.testing.assert_close(
        loss, 2 * torch.stack(terms).mean() * 2 * model.hparams.temperature, rtol=1e-5, atol=1e-6
    )


def test_multi_crop_key_encoder_never_sees_a_local_view_and_only_global_keys_are_enqueued(seeded):
    model = tiny_moco(queue_size=64)
    seen = []
    model.key_backbone.register_forward_hook(lambda m, inputs, out: seen.append(tuple(inputs[0].shape[-2:])))
    data = tiny_data(local_views=2, local_size=14, local_scale=(0.3, 0.6))
    cpu_trainer(max_steps=2, limit_val_batches=0).fit(model, data)
    assert seen and set(seen) == {(28, 28)}
    assert model.dictionary.ptr.item() == 2 * 16 and int((model.dictionary.enqueued_at >= 1).sum()) == 2 * 16


def test_multi_crop_resume_is_bit_equal(tmp_path):
    def run(ckpt_path=None, callbacks=()):
        seed_everything(0, verbose=False)
        model = tiny_moco(symmetric=True, lr_schedule="cosine")
        trainer = cpu_trainer(
            max_epochs=2, callbacks=list(callbacks), enable_checkpointing=bool(callbacks), limit_val_batches=0
        )
        trainer.fit(model, tiny_data(local_views=2, local_size=14), ckpt_path=ckpt_path)
        return model

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    straight = run(callbacks=[checkpoint])
    resumed = run(ckpt_path=tmp_path / "epoch=0.ckpt")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_compiled_encoders_give_the_eager_loss_and_the_momentum_update_moves_the_real_weights(tmp_path):
    """torch.compile (its aot_eager backend here, seconds instead of inductor's minutes on a CPU) for a few steps."""
    losses = {}
    for compiled in (False, True):
        seed_everything(0, verbose=False)
        model = tiny_moco(compile=compiled, compile_backend="aot_eager", shuffle_bn="split", bn_splits=4)
        record = losses.setdefault(compiled, [])

        class Losses(Callback):
            def __init__(self, into):
                self.into = into

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.into.append(outputs["loss"].item())

        before = {k: v.clone() for k, v in model.key_backbone.state_dict().items()}
        cpu_trainer(max_steps=3, limit_val_batches=0, callbacks=[Losses(record)]).fit(model, tiny_data())
        assert set(model.state_dict()) == set(tiny_moco().state_dict())  # no "_orig_mod." keys: plain checkpoints
        assert not torch.equal(before["0.weight"], model.key_backbone.state_dict()["0.weight"])  # the EMA moved it
        assert model.dictionary.ptr.item() == 3 * 16 % 32
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


# --- what a user's own datamodule may hand over -----------------------------------------------------------------
def test_stacked_views_are_taken_as_views_not_unpacked_along_the_batch(seeded):
    """A dataset returning torch.stack([v1, v2]) gives (N, 2, C, H, W) batches: unpacking them along dim 0 used to
    train on x_q = both views of image 0, x_k = image 1 and N − 2 "local views", with a finite loss."""
    model = tiny_moco()
    v1, v2 = torch.randn(8, 1, 28, 28), torch.randn(8, 1, 28, 28)
    views, index = model.split_batch((torch.stack([v1, v2], 1), torch.zeros(8), torch.arange(8)))
    assert len(views) == 2 and torch.equal(views[0], v1) and torch.equal(views[1], v2) and index.tolist() == [*range(8)]

    def train(stack):
        seed_everything(0, verbose=False)
        m = tiny_moco()
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(8, 1, 28, 28, generator=g), torch.randn(8, 1, 28, 28, generator=g)) for _ in range(3)]
        batches = [((torch.stack([a, b], 1) if stack else [a, b]), torch.zeros(8, dtype=torch.long)) for a, b in data]
        cpu_trainer(max_steps=3, limit_val_batches=0).fit(m, train_dataloaders=DataLoaderOf(batches))
        return m

    for a, b in zip(train(True).state_dict().values(), train(False).state_dict().values()):
        assert torch.equal(a, b)


class DataLoaderOf(torch.utils.data.DataLoader):
    """Hands over ready-made batches, with a batch_size (the lr scaling reads it)."""

    def __init__(self, batches):
        super().__init__(batches, batch_size=None)
        self._size = len(batches[0][1])

    @property
    def batch_size(self):
        return self._size

    @batch_size.setter
    def batch_size(self, value):
        pass


@pytest.mark.parametrize(
    "batch,shown",
    [
        ((torch.randn(8, 1, 28, 28), torch.zeros(8)), r"got tuple\[Tensor\(8, 1, 28, 28\), Tensor\(8,\)\]"),
        ({"image": torch.randn(8, 1, 28, 28)}, r"got dict with keys \['image'\]"),
        (([torch.randn(8, 1, 28, 28)], torch.zeros(8)), r"got tuple\[list\[Tensor\(8, 1, 28, 28\)\]"),
        (([torch.randn(8, 1, 28, 28), torch.randn(6, 1, 28, 28)], torch.zeros(8)), "of the same N and C"),
    ],
)
def test_a_wrong_batch_format_is_one_error_saying_what_a_batch_must_be(seeded, batch, shown):
    model = tiny_moco()
    with pytest.raises(ValueError, match=r"MoCo: .*" + shown):
        model.training_step(batch, 0)
    if not isinstance(batch, dict) and len(batch[0]) != 2:
        with pytest.raises(ValueError, match=r"\(\[view_1, view_2, \.\.\.\], target\[, index\]\)"):
            model.training_step(batch, 0)


def test_linear_probe_on_unlabelled_batches_says_what_it_needs(seeded):
    from moco_lightning.callbacks import LinearProbe

    probe = LinearProbe()
    probe.num_classes = 10
    with pytest.raises(ValueError, match=r"LinearProbe trains on the training batches' labels.*got tuple\[list"):
        probe.on_train_batch_end(None, tiny_moco(), {}, ([torch.randn(4, 1, 28, 28)] * 2,), 0)


def test_small_setting_errors_name_the_field_and_the_value_given(seeded):
    from moco_lightning.datamodules import FashionMNISTDataModule
    from moco_lightning.split_bn import check_bn_splits

    with pytest.raises(ValueError, match="sub-batches of 1: BatchNorm needs at least 2 images per sub-batch"):
        check_bn_splits(8, 8)  # divides, but one image per sub-batch: "Expected more than 1 value per channel" later
    with pytest.raises(ValueError, match="num_workers must be >= 0.*got -1"):
        FashionMNISTDataModule(num_workers=-1)
    with pytest.raises(ValueError, match=r"jitter_strength must be >= 0 \(0.4: MoCo's\), got -1"):
        FashionMNISTDataModule(jitter_strength=-1)
    with pytest.raises(ValueError, match="precision='64-true' is not supported"):
        cpu_trainer(max_steps=1, precision="64-true").fit(tiny_moco(), tiny_data())
    three = MoCo(backbone="resnet18", width=0.125, in_channels=3, image_size=28, queue_size=32, hidden_dim=16, dim=8)
    with pytest.raises(ValueError, match=r"model.in_channels=3, but the views have 1 channel\(s\).*in_channels 1"):
        cpu_trainer(max_steps=1, limit_val_batches=0).fit(three, tiny_data())


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
    from moco_lightning.optim import cosine

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
