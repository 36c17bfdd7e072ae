"""What the contrastive methods share: the loss inside the module, the dictionaries through the Trainer, multi-crop,
precision, compile, and what a user's own datamodule may hand over."""

import pytest
import torch
import torch.nn.functional as F
from helpers.data import tiny_data
from helpers.models import tiny_moco
from helpers.resume import assert_states_equal, key_state
from helpers.trainers import cpu_trainer
from lightning.pytorch import Callback, seed_everything

from moco_lightning import EndToEnd, MemoryBankMoCo, MoCo
from moco_lightning.modules.dictionary import InBatch


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


def test_multi_crop_key_encoder_never_sees_a_local_view_and_only_global_keys_are_enqueued(seeded):
    model = tiny_moco(queue_size=64)
    seen = []
    model.key_backbone.register_forward_hook(lambda m, inputs, out: seen.append(tuple(inputs[0].shape[-2:])))
    data = tiny_data(local_views=2, local_size=14, local_scale=(0.3, 0.6))
    cpu_trainer(max_steps=2, limit_val_batches=0).fit(model, data)
    assert seen and set(seen) == {(28, 28)}
    assert model.dictionary.ptr.item() == 2 * 16 and int((model.dictionary.enqueued_at >= 1).sum()) == 2 * 16


@pytest.mark.slow  # torch.compile: seconds of compiling
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
    from moco_lightning.modules.split_bn import check_bn_splits

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


def test_queue_size_zero_uses_in_batch_negatives(seeded):
    model = tiny_moco(queue_size=0)
    cpu_trainer(limit_val_batches=0, max_steps=2).fit(model, tiny_data())
    assert isinstance(model.dictionary, InBatch)  # no queue: nothing stored, no buffer
    assert not any(k.startswith("dictionary.") for k in model.state_dict()) and model.dictionary_buffers() == []
    out = model.views_loss([torch.randn(8, 1, 28, 28), torch.randn(8, 1, 28, 28)])
    assert out["sims"].shape == (8, 8) and out["labels"].tolist() == list(range(8))


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
