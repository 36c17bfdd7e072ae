"""The momentum copy (moco_lightning.modules.momentum): m(j) of MoCo v3's cosine at the official values."""

from types import SimpleNamespace

import pytest

from moco_lightning.modules.momentum import MomentumCopy
from moco_lightning.training.plan import StepPlan


def owner(steps):
    """What MomentumCopy.at reads of its module: the step plan of a run of ``steps`` optimizer steps."""
    return SimpleNamespace(step_plan=StepPlan(steps, 0, [], 256))


def momentum(m0, schedule, steps):
    return MomentumCopy(owner(steps), "key_", (), m0, schedule, "the key encoder")


def test_cosine_momentum_is_m_of_j_after_the_j_th_step():
    """The official v3 values of a 4-step run: m(1..4) = 0.99146, 0.995, 0.99854, 1 (m(0) = m₀ is the no-op update
    on identical encoders that the official code makes before its first step)."""
    got = [momentum(0.99, "cosine", 4).at(owner(4), j) for j in range(5)]
    assert got == pytest.approx([0.99, 0.991464466, 0.995, 0.998535534, 1.0], abs=1e-9)
    assert momentum(0.99, "constant", 4).at(owner(4), 3) == 0.99
