"""moco_lightning.downstream.features: the loop every feature computation runs."""

import multiprocessing
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from moco_lightning.datamodules.loading import ResumableDataLoader
from moco_lightning.downstream.features import embed


class _BrokenAt(Dataset):
    """Eight (image, label) samples, the fourth of which cannot be read."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        if i == 3:
            raise OSError(f"sample {i}: cannot be read")
        return torch.full((4,), float(i)), i % 2


@pytest.mark.parametrize("kind", [DataLoader, ResumableDataLoader])  # a plain loader and the datamodules' training one
@pytest.mark.parametrize("workers", [0, 1])
def test_a_samples_error_reaches_the_caller_at_once_and_leaves_no_worker(workers, kind):
    """A worker's error was re-raised with the loader's iterator caught in its traceback's cycle: the garbage collector
    shut the worker down later, and slowly (5 s). Now the worker is gone when the error reaches the caller."""
    loader = kind(_BrokenAt(), batch_size=2, num_workers=workers)
    start = time.perf_counter()
    with pytest.raises(OSError, match="sample 3: cannot be read"):
        embed(nn.Identity(), loader, torch.device("cpu"))
    assert multiprocessing.active_children() == []
    assert time.perf_counter() - start < 4  # the 5 s wait of torch's shutdown is not taken


def test_the_features_of_every_sample_in_order_and_no_worker_left():
    loader = DataLoader(torch.utils.data.TensorDataset(torch.eye(6), torch.arange(6)), batch_size=4, num_workers=1)
    features, targets = embed(nn.Identity(), loader, torch.device("cpu"))
    assert torch.equal(features, torch.eye(6)) and torch.equal(targets, torch.arange(6))
    assert multiprocessing.active_children() == []
