"""The training step's shape (docs/training-step.md): one MoCo v2 step, split BN on, runs at most 25 named functions
in at most 8 files of the library, the ones the page lists; the run's callbacks around it are listed there too."""

import re
from pathlib import Path

import pytest
import torch
from helpers.models import tiny, tiny_moco
from helpers.step_trace import StepTrace, by_file
from helpers.trainers import cpu_trainer
from torch.utils.data import DataLoader, TensorDataset

import moco_lightning as ml

PAGE = Path(__file__).resolve().parents[1] / "docs" / "training-step.md"


def listed(section: str) -> dict[str, list[str]]:
    """``{file: [function, ...]}`` of the page's table after the ``<!-- section -->`` marker."""
    text = PAGE.read_text().split(f"<!-- {section} -->", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    return {row.split("`")[1]: sorted(re.findall(r"`([\w.]+)`", row.split("|")[2])) for row in rows}


def traced(model) -> StepTrace:
    """One step (the third) of ``model`` on two-view batches of 16 with dataset indices."""
    x = torch.rand(64, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.flip(-1), torch.zeros(64, dtype=torch.long), torch.arange(64))

    def collate(items):
        v1, v2, y, i = zip(*items)
        return [torch.stack(v1), torch.stack(v2)], torch.stack(y), torch.stack(i)

    trace = StepTrace(batch=2)
    loader = DataLoader(data, batch_size=16, collate_fn=collate, drop_last=True)
    cpu_trainer(callbacks=[trace], max_steps=4, log_every_n_steps=1).fit(model, loader)
    return trace


def test_one_moco_v2_step_runs_the_functions_the_page_lists(seeded, one_torch_thread):
    """At most 25 functions in 8 files, split BN and the cosine schedules on; the page's lists are the measured
    ones, the step's and its callbacks'."""
    model = tiny_moco(shuffle_bn="split", bn_splits=2, lr_schedule="cosine", warmup_epochs=0.1)
    trace = traced(model)
    step = by_file(trace.step)
    assert len(trace.step) <= 25 and len(step) <= 8, step
    assert step == listed("step"), f"docs/training-step.md lists another step; measured: {step}"
    assert by_file(trace.callbacks) == listed("callbacks"), by_file(trace.callbacks)


@pytest.mark.parametrize(
    "method",
    ["MoCoV1", "MoCoSymmetric", "MemoryBankMoCo", "EndToEnd", "MoCoV3", "SimCLR", "BYOL", "SwAV"],
)
def test_every_method_s_step_stays_as_short(method, seeded, one_torch_thread):
    """The other methods' steps, within the same bounds (MoCo v3: its LARS, in-batch gather and v3 heads add files)."""
    models = {
        "MoCoV1": lambda: tiny_moco(head="linear", lr_schedule="step"),
        "MoCoSymmetric": lambda: tiny_moco(symmetric=True, shuffle_bn="split", bn_splits=2),
        "MemoryBankMoCo": lambda: tiny_moco(ml.MemoryBankMoCo, memory_bank_size=64, num_negatives=16),
        "EndToEnd": lambda: tiny_moco(ml.EndToEnd),
        "MoCoV3": lambda: tiny_moco(ml.MoCoV3, shuffle_bn="split", bn_splits=2),
        "SimCLR": lambda: tiny(ml.SimCLR),
        "BYOL": lambda: tiny(ml.BYOL),
        "SwAV": lambda: tiny(ml.SwAV),
    }
    trace = traced(models[method]())
    files = 12 if method == "MoCoV3" else 8
    assert len(trace.step) <= 26 and len(by_file(trace.step)) <= files, by_file(trace.step)
