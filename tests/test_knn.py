"""The kNN monitor: exact accuracies on constructed embeddings, 1 vs 2 ranks, and inside a Trainer."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.data import ToyData
from helpers.distributed import free_port, run_ranks
from helpers.models import TinyNet
from helpers.trainers import RecordingLogger, trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from moco_lightning.callbacks import KNNMonitor, knn_accuracy, knn_counts, knn_scores

D = 6


def cluster(n: int, axis: int, seed: int) -> torch.Tensor:
    """n unit vectors within ~0.01 of the basis vector e_axis."""
    g = torch.Generator().manual_seed(seed)
    x = 0.01 * torch.randn(n, D, generator=g)
    x[:, axis] += 1.0
    return F.normalize(x, dim=1)


def constructed(n0: int = 50, n1: int = 50, m0: int = 10, m1: int = 10):
    """Bank: n0 points at e0 labelled 0, n1 at e1 labelled 1. Queries: m0 at e0 (label 0), m1 at e1 (label 1)."""
    bank = torch.cat([cluster(n0, 0, 1), cluster(n1, 1, 2)])
    bank_y = torch.cat([torch.zeros(n0), torch.ones(n1)]).long()
    val = torch.cat([cluster(m0, 0, 3), cluster(m1, 1, 4)])
    val_y = torch.cat([torch.zeros(m0), torch.ones(m1)]).long()
    return bank, bank_y, val, val_y


def test_two_clusters_exact_then_known_shuffles():
    bank, bank_y, val, val_y = constructed()
    # num_classes=10 although only 2 classes occur: the count comes from the caller, not the labels
    c = knn_counts(val, val_y, bank, bank_y, num_classes=10, k=200, temperature=0.1)
    assert c.tolist() == [20, 20, 20]  # 100 % top-1 and top-5 (k=200 clipped to the 100-sample bank)

    # 1) relabel 3 queries of cluster 0 as class 1 and 2 of cluster 1 as class 0: the predictions do not
    #    change, so exactly those 5 are wrong at top-1: 15/20 = 75 %. Both classes get a positive score,
    #    so top-5 stays 100 %.
    shuffled = val_y.clone()
    shuffled[[0, 1, 2]] = 1
    shuffled[[10, 11]] = 0
    c = knn_counts(val, shuffled, bank, bank_y, num_classes=10)
    assert c.tolist() == [15, 20, 20]

    # 2) relabel 30 of the 50 bank points of cluster 1 as class 2. A query at e1 scores
    #    class 2: 30 exp(~1/0.1) > class 1: 20 exp(~1/0.1) >> class 0: 50 exp(~0/0.1), so every cluster-1
    #    query is predicted 2: top-1 = 10/20 = 50 %, and its true class is 2nd: top-5 = 100 %.
    bank_shuffled = bank_y.clone()
    bank_shuffled[50:80] = 2
    c = knn_counts(val, val_y, bank, bank_shuffled, num_classes=10)
    assert c.tolist() == [10, 20, 20]
    # the same numbers in chunks of 3 queries
    assert knn_counts(val, val_y, bank, bank_shuffled, num_classes=10, chunk_size=3).tolist() == [10, 20, 20]
    # k=1: the nearest neighbour alone decides; a query equal to a relabelled bank row gets its label
    c = knn_counts(bank[55:56], torch.tensor([2]), bank, bank_shuffled, num_classes=3, k=1)
    assert c.tolist() == [1, 1, 1]


def test_scores_match_lightly_knn_predict():
    from lightly.utils.benchmarking import knn_predict  # the reference (InstDisc / MoCo demo vote)

    g = torch.Generator().manual_seed(0)
    bank = F.normalize(torch.randn(300, 16, generator=g), dim=1)
    bank_y = torch.randint(0, 7, (300,), generator=g)
    queries = F.normalize(torch.randn(40, 16, generator=g), dim=1)
    scores = knn_scores(queries, bank, bank_y, 7, k=50, temperature=0.1)
    reference = knn_predict(queries, bank.t(), bank_y, 7, knn_k=50, knn_t=0.1)
    assert torch.equal(scores.argsort(dim=1, descending=True)[:, :3], reference[:, :3])
    # by hand for one query: the weights of its 50 nearest bank rows summed per class
    sim = bank @ queries[0]
    top = sim.topk(50).indices
    by_hand = torch.zeros(7).index_add_(0, bank_y[top], (sim[top] / 0.1).exp())
    torch.testing.assert_close(scores[0], by_hand)


def ddp_case():
    """Uneven everything: 51 + 50 bank points, 11 + 10 queries. Cluster 1 of the bank: the 25 odd dataset
    indices and 5 even ones relabelled 2 (30 of 50), so that with 2 ranks (which embed the even and the odd
    indices) neither rank's own shard gives the global answer: the bank must be gathered. Queries: 3 of
    cluster 0 relabelled 1, 2 of cluster 1 relabelled 0. Expected by hand: cluster-0 queries predicted 0
    (8 of 11 right), cluster-1 queries predicted 2 (30 exp(10) > 20 exp(10); 0 right): 8/21; every true label
    is among the 3 positive scores: top-5 21/21."""
    bank, bank_y, val, val_y = constructed(51, 50, 11, 10)
    bank_y[51:101:2] = 2
    bank_y[[52, 54, 56, 58, 60]] = 2
    assert int((bank_y == 2).sum()) == 30
    val_y[[0, 1, 2]] = 1
    val_y[[11, 12]] = 0
    return bank, bank_y, val, val_y


def loaders(batch_size: int = 7):
    bank, bank_y, val, val_y = ddp_case()
    mk = lambda x, y: DataLoader(TensorDataset(x, y, torch.arange(len(y))), batch_size=batch_size)  # noqa: E731
    return mk(bank, bank_y), mk(val, val_y)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{port}", rank=rank, world_size=world)
    gathered_rows = []
    original = dist.all_gather

    def recording(out, t, *args, **kwargs):  # the rows of every D-dimensional feature tensor gathered
        if t.ndim == 2 and t.is_floating_point() and t.shape[1] == D:
            gathered_rows.append(t.shape[0])
        return original(out, t, *args, **kwargs)

    dist.all_gather = recording
    try:
        bank_loader, val_loader = loaders()
        result = {
            "loader": knn_accuracy(nn.Identity(), bank_loader, val_loader, num_classes=10),
            # a plain iterable (not a DataLoader): sharded by batch instead of by sample
            "iterable": knn_accuracy(nn.Identity(), list(bank_loader), list(val_loader), num_classes=10),
            "limited": knn_accuracy(nn.Identity(), bank_loader, val_loader, num_classes=10, max_bank_size=51),
            "bf16": knn_accuracy(nn.Identity(), bank_loader, val_loader, num_classes=10, bank_dtype=torch.bfloat16),
            "gathered_rows": gathered_rows,
        }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_one_and_two_ranks_give_the_hand_computed_accuracy(tmp_path):
    bank_loader, val_loader = loaders()
    one = knn_accuracy(nn.Identity(), bank_loader, val_loader, num_classes=10)
    assert one["total"] == 21
    assert math.isclose(one["acc1"], 8 / 21) and one["acc5"] == 1.0
    # max_bank_size=51 keeps only cluster 0 (all labelled 0): every query predicted 0; 11 - 3 + 2 = 10 right
    limited = knn_accuracy(nn.Identity(), bank_loader, val_loader, num_classes=10, max_bank_size=51)
    assert math.isclose(limited["acc1"], 10 / 21)

    run_ranks(_worker, 2, free_port(), str(tmp_path))
    for rank in range(2):
        two = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for key in ("loader", "iterable"):  # summed over ranks, not an average of per-rank accuracies
            assert two[key]["total"] == 21
            assert math.isclose(two[key]["acc1"], one["acc1"]) and math.isclose(two[key]["acc5"], one["acc5"])
        assert math.isclose(two["limited"]["acc1"], limited["acc1"])
        assert math.isclose(two["bf16"]["acc1"], one["acc1"])
        # the bank stays sharded (each rank keeps its 50-51 rows): only the queries (<= 14 rows a rank) are gathered
        assert two["gathered_rows"] and max(two["gathered_rows"]) <= 14, two["gathered_rows"]


def test_monitor_in_a_trainer_with_a_plain_module(seeded):
    data = ToyData(num_classes=5)  # only 3 classes occur in the data: num_classes still comes from here
    net = TinyNet()
    net.backbone[1].eval()  # a submodule left in eval mode on purpose must stay so
    modes = {name: m.training for name, m in net.named_modules()}
    monitor = KNNMonitor(k=10)
    logger = RecordingLogger()
    t = trainer(max_epochs=2, logger=logger, callbacks=[monitor])
    t.fit(net, datamodule=data)

    steps = len(data.train_x) // data.batch_size  # 6 optimizer steps per epoch
    assert [s for s, _ in monitor.history] == [0, steps, 2 * steps]
    assert data.eval_train_calls == 3  # the bank always comes from the evaluation view of the train split
    logged = logger.series("val/knn_acc1")
    # step 0 written directly; epoch-end values go through self.log, which Lightning writes at the index of
    # the epoch's last optimizer step (global_step - 1), aligned with that step's training metrics
    assert [s for s, _ in logged] == [0, steps - 1, 2 * steps - 1]
    assert [v for _, v in logged] == pytest.approx([v for _, v in monitor.history])
    assert all(0.0 <= v <= 1.0 for _, v in logged)
    assert logger.series("val/knn_acc5")[-1][1] == 1.0  # 3 classes occur, all within the top 5
    assert float(t.callback_metrics["val/knn_acc1"]) == pytest.approx(monitor.history[-1][1])
    assert {name: m.training for name, m in net.named_modules()} == modes
    assert monitor.state_dict() == {"history": monitor.history}


def test_monitor_leaves_moco_queue_and_key_encoder_alone(seeded):
    from helpers.models import tiny_moco

    moco = tiny_moco()
    before = {k: v.clone() for k, v in moco.state_dict().items()}
    data = ToyData(size=28)
    acc = knn_accuracy(moco, data.eval_train_dataloader(), data.eval_val_dataloader(), num_classes=3)
    assert 0.0 <= acc["acc1"] <= 1.0 and acc["total"] == 24
    after = moco.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # queue, ptr, key encoder, BN statistics
    assert moco.training and moco.key_backbone.training


def test_explicit_loaders_without_datamodule(seeded):
    bank_loader, val_loader = loaders()

    class Passthrough(TinyNet):  # trains on images, but its "features" are its inputs
        def forward(self, x):
            return x.flatten(1)

    monitor = KNNMonitor(
        num_classes=10, bank_dataloader=lambda: bank_loader, val_dataloader=val_loader, every_n_epochs=0
    )
    t = trainer(logger=RecordingLogger(), callbacks=[monitor], max_steps=1)
    t.fit(Passthrough(), train_dataloaders=ToyData().train_dataloader())
    assert monitor.history == [(0, pytest.approx(8 / 21))]  # only the step-0 baseline (every_n_epochs=0)


def test_pixel_baseline_is_logged_once_beside_the_encoder(seeded):
    data = ToyData(num_classes=3)
    monitor = KNNMonitor(k=10, pixel_baseline=True, every_n_epochs=1)
    logger = RecordingLogger()
    t = trainer(max_epochs=1, logger=logger, callbacks=[monitor])
    t.fit(TinyNet(), datamodule=data)
    expected = knn_accuracy(nn.Flatten(), data.eval_train_dataloader(), data.eval_val_dataloader(), num_classes=3, k=10)
    assert logger.series("val/knn_acc1_pixels") == [(0, pytest.approx(expected["acc1"]))]
    assert len(logger.series("val/knn_acc1")) == 2 and len(monitor.history) == 2  # the pixels are not in the history
    assert logger.series("val/knn_acc1_init") == [(0, pytest.approx(monitor.history[0][1]))]  # the random-init encoder
    final = t.callback_metrics  # what the CLI's final table prints: the three side by side
    assert {"val/knn_acc1", "val/knn_acc1_init", "val/knn_acc1_pixels"} <= set(final)
    assert float(final["val/knn_acc1"]) == pytest.approx(monitor.history[1][1])


def test_a_bfloat16_bank_is_never_held_in_float32(monkeypatch):
    """The bank's batches are cast as they are embedded: the concatenation that makes the bank joins bf16 pieces, and
    no float32 tensor of the bank's rows is ever made, so its peak is half the float32 bank's (it was embedded in
    float32, concatenated, then cast: ~2x the float32 bank)."""
    calls = []  # (dtype, rows) of each concatenation of 2-d float tensors
    original = torch.cat

    def recording(tensors, *args, **kwargs):
        floats = [t for t in tensors if t.is_floating_point() and t.ndim == 2]
        if floats:
            calls.append(({t.dtype for t in floats}, sum(t.shape[0] for t in floats)))
        return original(tensors, *args, **kwargs)

    bank_loader, val_loader = loaders()
    rows = len(bank_loader.dataset)
    monkeypatch.setattr(torch, "cat", recording)
    bf16 = knn_accuracy(nn.Identity(), bank_loader, val_loader, num_classes=10, bank_dtype=torch.bfloat16)
    monkeypatch.setattr(torch, "cat", original)
    assert ({torch.bfloat16}, rows) in calls and not [c for c in calls if c[1] == rows and torch.float32 in c[0]]
    fp32 = knn_accuracy(nn.Identity(), bank_loader, val_loader, num_classes=10)
    assert abs(bf16["acc1"] - fp32["acc1"]) <= 1 / fp32["total"]  # the same votes, up to a tie
