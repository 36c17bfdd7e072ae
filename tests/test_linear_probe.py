"""The online linear probe: it learns, it never moves the backbone, and its state survives a resume."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.data import ToyData
from helpers.models import TinyNet
from helpers.trainers import RecordingLogger, trainer
from lightning.pytorch import Callback, LightningModule
from torch.utils.data import DataLoader, TensorDataset

from moco_lightning.callbacks import LinearProbe
from moco_lightning.callbacks.linear_probe import probe_accuracy


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
    saved = torch.load(path, weights_only=True)["callbacks"]["LinearProbe"]
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


# --- under DDP, and the offline probe of the benchmarks -------------------------------------------------------
class Features(LightningModule):
    """A module whose ``forward(x)`` returns ``x``: the probe's inputs are the features themselves."""

    def forward(self, x):
        return x

    def log_dict(self, *args, **kwargs):
        pass


def probe_case():
    g = torch.Generator().manual_seed(0)
    feats, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
    val = TensorDataset(torch.randn(11, 5, generator=g), torch.randint(0, 3, (11,), generator=g))
    return feats, y, DataLoader(val, batch_size=4)


def train_probe(rank: int, world: int) -> dict:
    """Three probe steps on this rank's half of a global batch of 8, then the validation accuracy."""
    feats, y, val = probe_case()
    probe, module = LinearProbe(num_classes=3, lr=0.5, val_dataloader=val), Features()
    mine = slice(8 // world * rank, 8 // world * (rank + 1))
    for step in range(3):
        probe.on_train_batch_end(None, module, {"features": feats[mine]}, ([feats[mine]], y[mine]), step)
    return {"weight": probe.classifier.weight.detach(), "acc": probe.evaluate(None, module)}


def _ddp_probe_worker(rank: int, port: str, out_dir: str) -> None:
    from helpers.distributed import gloo_rank

    with gloo_rank(rank, port):
        torch.save(train_probe(rank, 2), os.path.join(out_dir, f"probe{rank}.pt"))


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_ddp_probe_averages_gradients_and_sums_validation_counts(tmp_path):
    """2 ranks (gloo), each with half of every batch: the probe's weights equal one process's on the whole batch (the
    mean gradient, all-reduced: the same probe on every rank) and the validation accuracy is over the 11 images of
    the split (each rank counts its share, the counts summed), not over one rank's share."""
    from helpers.distributed import free_port, run_ranks

    run_ranks(_ddp_probe_worker, free_port(), str(tmp_path))
    ranks = [torch.load(tmp_path / f"probe{r}.pt") for r in (0, 1)]
    alone = train_probe(0, 1)
    assert torch.equal(ranks[0]["weight"], ranks[1]["weight"])
    torch.testing.assert_close(ranks[0]["weight"], alone["weight"], rtol=1e-5, atol=1e-6)
    assert ranks[0]["acc"] == ranks[1]["acc"] == alone["acc"]
    acc1 = alone["acc"]["val/probe_acc1"]
    assert 0 < acc1 < 1 and round(acc1 * 11) == pytest.approx(acc1 * 11)  # a count out of 11: not one rank's 5 or 6


def test_probe_accuracy_separates_blobs_is_chance_on_noise_and_leaves_the_global_rng_alone():
    """The offline probe every benchmark reports: near 1 on separable features, near chance on random labels,
    features standardised with the train split's statistics (a shift and scale of both splits changes nothing), the
    same result for the same seed, and the global RNG untouched."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 16, generator=g) * 4
    y_train, y_test = torch.randint(0, 3, (300,), generator=g), torch.randint(0, 3, (300,), generator=g)
    train = centres[y_train] + torch.randn(300, 16, generator=g)
    test = centres[y_test] + torch.randn(300, 16, generator=g)
    state = torch.get_rng_state()
    separable = probe_accuracy(train, y_train, test, y_test, 3, epochs=20, lr=1e-2)
    assert torch.equal(torch.get_rng_state(), state)
    assert separable >= 0.97
    assert probe_accuracy(train * 100 + 7, y_train, test * 100 + 7, y_test, 3, epochs=20, lr=1e-2) == separable
    noise = probe_accuracy(torch.randn(300, 16, generator=g), y_train, torch.randn(300, 16, generator=g), y_test, 3)
    assert 0.2 <= noise <= 0.48
