"""The fixtures and the process settings of every test; what the tests share otherwise is in :mod:`helpers`."""

from __future__ import annotations

import logging
import os
import warnings

import lightning.pytorch  # noqa: F401  (its log handlers bound to the session's stderr, not to one test's capsys)
import pytest
import torch

os.environ.setdefault("PL_DISABLE_FORK", "1")
# one thread per pytest-xdist worker (scripts/test.sh runs two on two cores), else two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")


@pytest.fixture(autouse=True)
def lightning_log_levels():
    """Lightning's log levels as each test found them: a test that quiets Lightning (the benchmarks' ``quiet``) does
    not silence the tests after it in its worker, nor the runs they fork (``helpers.cli.run_forked``)."""
    names = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning")
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture
def one_torch_thread():
    """Small tensor ops on a shared, busy machine are far slower with 2 OpenMP threads than with 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def seeded():
    from lightning.pytorch import seed_everything

    seed_everything(0, verbose=False)
    return 0


def pytest_collection_modifyitems(config, items):
    """The slow tests (subprocesses, several processes, benchmark scripts: 5-120 s each) first, the rest in file order:
    pytest-xdist hands tests out in collection order, and a 2-minute test picked up last keeps one worker busy alone
    while the other has finished (longest first balances the two workers)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
