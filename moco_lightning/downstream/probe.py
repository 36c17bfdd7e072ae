"""The offline linear probe: a linear classifier trained on frozen, standardised features (what the benchmarks and
``evaluate`` report as "linear, all labels"; the same for every system compared)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def probe_accuracy(
    train_features: Tensor,
    train_targets: Tensor,
    test_features: Tensor,
    test_targets: Tensor,
    num_classes: int,
    epochs: int = 20,
    lr: float = 1e-3,
    batch_size: int = 256,
    seed: int = 0,
) -> float:
    """Top-1 on ``test_features`` of a linear classifier trained on frozen ``train_features`` (offline, fast).

    The features are standardised with the train split's statistics; Adam, cosine lr over ``epochs`` epochs,
    minibatches of ``batch_size`` drawn from ``seed`` (the global RNG is left alone). What the benchmarks report as
    "linear probe": cheaper than :class:`~moco_lightning.downstream.linear_eval.LinearClassifier` (which runs the
    backbone on augmented images every epoch) and the same for every system compared.
    """
    mean, std = train_features.mean(0), train_features.std(0) + 1e-6
    train, test = (train_features - mean) / std, (test_features - mean) / std
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        classifier = nn.Linear(train.shape[1], num_classes)
    steps = max(1, epochs * -(-len(train) // batch_size))
    optimizer = torch.optim.Adam(classifier.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(len(train), generator=g)
            for i in range(0, len(train), batch_size):
                idx = order[i : i + batch_size]
                loss = F.cross_entropy(classifier(train[idx]), train_targets[idx])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
    with torch.no_grad():
        return (classifier(test).argmax(1) == test_targets).float().mean().item()
