"""Shuffle BN on one device (split BatchNorm): the key batch permuted before BatchNorm, the user's BatchNorm back after
the fit, the batch checked against bn_splits."""

import pytest
import torch
from helpers.data import tiny_data
from helpers.models import tiny_moco
from helpers.trainers import cpu_trainer
from lightning.pytorch import Callback
from torch import nn


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
