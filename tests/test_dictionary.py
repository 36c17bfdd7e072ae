"""The dictionary (moco_lightning.modules.dictionary): the queue, the memory bank, the own-key warning."""

import re

import pytest
import torch
import torch.nn.functional as F

from moco_lightning.modules.dictionary import KeyQueue, MemoryBank


def sequential_reference(initial: torch.Tensor, batches: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The FIFO semantics written the slow, obvious way: one key at a time."""
    keys, ptr = initial.clone(), 0
    for batch in batches:
        for row in batch:
            keys[ptr] = row
            ptr = (ptr + 1) % len(keys)
    return keys, ptr


def test_wrap_around_partial_and_oversized_batches():
    torch.manual_seed(0)
    queue = KeyQueue(10, 3)
    initial = queue.keys.clone()
    batches = [torch.arange(4 * 3, dtype=torch.float).view(4, 3) + 100 * i for i in range(3)]
    for b in batches:
        queue.enqueue(b)
    # 12 keys into K=10: slots 0-3 batch 0, 4-7 batch 1, 8-9 and 0-1 batch 2
    assert queue.ptr.item() == 2
    assert torch.equal(queue.keys[8], batches[2][0]) and torch.equal(queue.keys[9], batches[2][1])
    assert torch.equal(queue.keys[0], batches[2][2]) and torch.equal(queue.keys[1], batches[2][3])
    assert torch.equal(queue.keys[2:4], batches[0][2:4]) and torch.equal(queue.keys[4:8], batches[1])
    partial = torch.full((3, 3), -1.0)
    queue.enqueue(partial)  # a partial last batch: nothing dropped
    assert queue.ptr.item() == 5 and torch.equal(queue.keys[2:5], partial)
    big = torch.arange(13 * 3, dtype=torch.float).view(13, 3) + 1000  # larger than K
    queue.enqueue(big)
    expected, ptr = sequential_reference(initial, batches + [partial, big])
    assert torch.equal(queue.keys, expected)
    assert queue.ptr.item() == ptr == 8


@pytest.mark.parametrize("size,batch", [(7, 3), (12, 5), (5, 5), (4, 9)])
def test_matches_sequential_reference_for_any_size(size, batch):
    torch.manual_seed(1)
    queue = KeyQueue(size, 2)
    initial = queue.keys.clone()
    batches = [torch.randn(batch, 2) for _ in range(5)] + [torch.randn(max(batch - 2, 1), 2)]
    for step, b in enumerate(batches):
        queue.enqueue(b, step=step)
    expected, ptr = sequential_reference(initial, batches)
    assert torch.equal(queue.keys, expected)
    assert queue.ptr.item() == ptr
    assert queue.enqueued_at.max().item() == len(batches) - 1


def test_initial_keys_normalised_and_seeded():
    torch.manual_seed(3)
    a = KeyQueue(16, 8)
    torch.manual_seed(3)
    b = KeyQueue(16, 8)
    assert torch.equal(a.keys, b.keys)
    assert torch.allclose(a.keys.norm(dim=1), torch.ones(16))
    assert (a.enqueued_at == -1).all()


def test_queue_is_persistent_state():
    queue = KeyQueue(4, 2)
    assert set(queue.state_dict()) == {"keys", "ptr", "enqueued_at"}


def test_a_queue_holds_at_least_one_key():
    with pytest.raises(ValueError, match="at least one key"):
        KeyQueue(0, 4)


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.8, 1.0, 1.4, 2.0, 3.0])
def test_the_own_key_share_is_what_a_shuffled_queue_holds(ratio):
    """``own_key_share``: the share of steps at which a FIFO queue of K keys holds the image's key of the previous
    epoch, against a simulation of shuffled epochs (E = 200 keys an epoch, batches of one)."""
    import random

    from moco_lightning.modules.dictionary import own_key_share

    n, size, rng = 200, int(200 * ratio), random.Random(0)
    queue, held, seen = [], 0, 0
    for epoch in range(40):
        order = list(range(n))
        rng.shuffle(order)
        for image in order:
            if epoch:
                held, seen = held + (image in queue[-size:]), seen + 1
            queue.append(image)
    assert held / seen == pytest.approx(own_key_share(size, n), abs=0.02)


@pytest.mark.parametrize(
    "method,kwargs,said",
    [
        ("MoCo", dict(queue_size=16), None),  # a quarter of the 64 images: nothing to say
        ("MoCo", dict(queue_size=48), r"queue_size=48 against 64 training images: the queue holds more than half an "
         r"epoch of keys: an image's previous key is among its own negatives at 28% of its steps.*at most 32"),
        ("MoCo", dict(queue_size=64, symmetric=True), None),  # 2 keys per image: half of the epoch's 128
        ("MoCo", dict(queue_size=128), r"queue_size=128 against 64 .*every image's previous key is always among"),
        ("MemoryBankMoCo", dict(memory_bank_size=64, num_negatives=64),
         r"num_negatives=64 against 64 .*own stored feature is among its 64 sampled negatives at 64%"),
    ],
)  # fmt: skip
def test_a_dictionary_as_large_as_the_data_is_warned_at_fit_start(method, kwargs, said):
    """The queue (a memory bank's negatives) compared with the training images the datamodule serves: one warning
    naming both numbers and the fix."""
    import warnings

    from helpers.data import tiny_data
    from helpers.models import tiny_moco
    from helpers.trainers import cpu_trainer

    import moco_lightning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu_trainer(max_steps=1, limit_val_batches=0).fit(tiny_moco(getattr(moco_lightning, method), **kwargs),
                                                          tiny_data())  # fmt: skip
    found = [str(w.message) for w in caught if "training images" in str(w.message)]
    if said is None:
        assert not found
    else:
        assert len(found) == 1 and re.search(said, found[0]), found


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
