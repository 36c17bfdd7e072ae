"""The optimizers: LARS equals lightly's update step for step, without reading any device value on the host."""

import pytest
import torch
from lightly.utils.lars import LARS as LightlyLARS

from moco_lightning.optim import LARS


def params_and_grads(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 4), (8,), (3, 3, 2, 2), (5,)]
    params = [torch.randn(s, generator=g) for s in shapes]
    params[3].zero_()  # a zero parameter: no adaptation (lightly's p_norm != 0 test)
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    for step in grads:
        step[1].zero_()  # a zero gradient: no adaptation (lightly's g_norm != 0 test)
    return params, grads


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_lars_equals_lightly_step_for_step(momentum):
    params, grads = params_and_grads(0)
    ours = [p.clone().requires_grad_() for p in params]
    theirs = [p.clone().requires_grad_() for p in params]

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 1e-2}, {"params": ps[2:], "weight_decay": 0.0}]

    opt_ours = LARS(groups(ours), lr=0.3, momentum=momentum, trust_coefficient=0.02)
    opt_theirs = LightlyLARS(groups(theirs), lr=0.3, momentum=momentum, trust_coefficient=0.02)
    for step in grads:
        for p, q, g in zip(ours, theirs, step):
            p.grad, q.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours[0], params[0])


def test_lars_step_reads_no_value_on_the_host(monkeypatch):
    """lightly's ``if p_norm != 0 and g_norm != 0`` converts device tensors to Python booleans; ours never does."""
    params, grads = params_and_grads(1)
    ps = [p.clone().requires_grad_() for p in params]
    for p, g in zip(ps, grads[0]):
        p.grad = g
    opt = LARS([{"params": ps, "weight_decay": 1e-2}], lr=0.1, momentum=0.9)

    def refuse(self):
        raise AssertionError("a tensor was read on the host")

    monkeypatch.setattr(torch.Tensor, "__bool__", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    opt.step()
    opt.step()
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="read on the host"):
        monkeypatch.setattr(torch.Tensor, "__bool__", refuse)
        LightlyLARS([{"params": ps, "weight_decay": 1e-2}], lr=0.1).step()
