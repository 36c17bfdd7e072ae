"""The online linear probe: it learns, it never moves the backbone, and its state survives a resume."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from moco_lightning.callbacks import LinearProbe

from callback_toys import RecordingLogger, TinyNet, ToyData, trainer


def backbone_state(net: TinyNet) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.backbone.state_dict().items()}


def test_probe_learns_without_touching_backbone_weights_or_bn_statistics(seeded):
    net = TinyNet(train_backbone=False)  # the module never runs its backbone: only the probe does
    before = backbone_state(net)
    assert any("running_mean" in k for k in before)
    data = ToyData()
    probe = LinearProbe(lr=0.5)  # num_classes from the datamodule
    logger = RecordingLogger()
    trainer(max_epochs=3, logger=logger, callbacks=[probe]).fit(net, datamodule=data)

    after = backbone_state(net)
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights, running stats, num_batches_tracked
    assert all(p.grad is None for p in net.backbone.parameters())
    assert net.training and all(m.training for m in net.modules())  # modes restored after each probe forward
    assert probe.classifier.out_features == data.num_classes == 3
    assert net.forward_calls == 3 * 6 + 3 * 3  # 6 training batches and 3 validation batches per epoch

    train_acc = logger.series("train/probe_acc1")
    assert len(train_acc) == 18 and all(0.0 <= v <= 1.0 for _, v in train_acc)
    val_acc = logger.series("val/probe_acc1")
    assert len(val_acc) == 3
    assert val_acc[-1][1] >= 0.9  # 3 well-separated patterns: a linear probe on random conv features learns them


def test_probe_uses_training_step_features_when_returned(seeded):
    net = TinyNet(return_features=True)
    probe = LinearProbe(every_n_epochs=0)
    trainer(max_epochs=1, callbacks=[probe]).fit(net, datamodule=ToyData())
    assert net.forward_calls == 0  # never ran the module: it took outputs["features"]
    assert probe.classifier.in_features == 16


def test_probe_state_survives_checkpoint_and_resume(seeded, tmp_path):
    data = ToyData()
    net = TinyNet(return_features=True)
    probe = LinearProbe()
    t = trainer(max_epochs=1, callbacks=[probe])
    t.fit(net, datamodule=data)
    path = tmp_path / "run.ckpt"
    t.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"]["LinearProbe"]
    assert torch.equal(saved["classifier"]["weight"], probe.classifier.weight)
    assert saved["optimizer"]["state"]  # the momentum buffers are saved too

    class Capture(Callback):
        def on_train_start(self, trainer, pl_module):
            self.weight = resumed.classifier.weight.detach().clone()
            self.buffer = resumed.optimizer.state_dict()["state"][0]["momentum_buffer"].clone()

    resumed, capture = LinearProbe(), Capture()
    trainer(max_epochs=2, callbacks=[resumed, capture]).fit(
        TinyNet(return_features=True), datamodule=data, ckpt_path=path
    )
    assert torch.equal(capture.weight, probe.classifier.weight.detach())
    assert torch.equal(capture.buffer, probe.optimizer.state_dict()["state"][0]["momentum_buffer"])
    assert not torch.equal(resumed.classifier.weight, probe.classifier.weight)  # and it kept training

    fresh = LinearProbe()
    fresh.load_state_dict(probe.state_dict())
    assert torch.equal(fresh.classifier.bias, probe.classifier.bias)


def test_probe_rejects_bad_arguments():
    with pytest.raises(ValueError, match="lr > 0"):
        LinearProbe(lr=0)


def test_unlabelled_targets_are_ignored_not_an_error(seeded):
    """STL-10's unlabelled split has target -1: the probe learns from the labelled images only (on a GPU a -1
    class index is a device-side assert; masking the batch by indexing would stall the device every step)."""

    class HalfUnlabelled(ToyData):
        def _views(self, items):
            views, y, idx = super()._views(items)
            return views, torch.where(idx % 2 == 0, y, torch.full_like(y, -1)), idx

    probe = LinearProbe(lr=0.5, every_n_epochs=1)
    logger = RecordingLogger()
    trainer(max_epochs=3, logger=logger, callbacks=[probe]).fit(
        TinyNet(return_features=True), datamodule=HalfUnlabelled()
    )
    assert all(0.0 <= v <= 1.0 for _, v in logger.series("train/probe_acc1"))
    assert logger.series("val/probe_acc1")[-1][1] >= 0.9
