"""InstDisc's memory bank as MoCo's dictionary: the rows a step updates, the bank's size, the symmetric update."""

import pytest
import torch
import torch.nn.functional as F
from helpers.data import tiny_data
from helpers.models import tiny_moco
from helpers.trainers import cpu_trainer

from moco_lightning import MemoryBankMoCo


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
