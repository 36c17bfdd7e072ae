import pytest
import torch
import torch.nn.functional as F

from moco_lightning.modules.memory_bank import MemoryBank


def test_update_moves_exactly_the_batch_rows_with_the_momentum_formula(seeded):
    bank = MemoryBank(10, 4)
    before = bank.features.clone()
    index = torch.tensor([7, 2, 5])
    q = F.normalize(torch.randn(3, 4), dim=1)
    bank.update(index, q, momentum=0.3)  # not 0.5, where swapping m and 1 - m would give the same rows
    expected = before.clone()
    expected[index] = F.normalize(0.3 * before[index] + 0.7 * q, dim=1)
    torch.testing.assert_close(bank.features, expected, rtol=0, atol=1e-7)
    untouched = [i for i in range(10) if i not in (7, 2, 5)]
    assert torch.equal(bank.features[untouched], before[untouched])
    assert torch.allclose(bank.features.norm(dim=1), torch.ones(10))


def test_positives_sample_and_bad_index(seeded):
    bank = MemoryBank(6, 3)
    assert torch.equal(bank.positives(torch.tensor([4, 0])), bank.features[[4, 0]])
    negatives = bank.sample(50)
    assert negatives.shape == (50, 3) and not negatives.requires_grad
    assert all(any(torch.equal(n, row) for row in bank.features) for n in negatives)
    with pytest.raises(IndexError, match="index 6 is outside the bank of 6 rows; set memory_bank_size"):
        MemoryBank(6, 3).positives(torch.tensor([6]))  # checked on the first call (later ones: no host read, #53)
    assert "features" in bank.state_dict()  # persistent: saved in checkpoints (lightly's is not)
