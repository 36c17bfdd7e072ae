"""The optimizers: MoCo v3's LARS rule against a float64 reference of the formula, no host reads, the parameter
groups of each recipe (the schedules: test_plan.py, test_momentum.py)."""

import pytest
import torch
from lightly.utils.lars import LARS as LightlyLARS
from torch import nn

from moco_lightning.modules.optim import LARS, build_optimizer


def reference_lars_step(params, grads, bufs, lr, momentum, weight_decay, tc):
    """moco-v3's ``moco/optimizer.py`` rule, one parameter at a time, in float64 (written from the formula)."""
    out = []
    for p, g, mu in zip(params, grads, bufs):
        d = g.clone()
        if p.ndim > 1:
            d = d + weight_decay * p
            pn, dn = p.norm().item(), d.norm().item()
            q = tc * pn / dn if pn > 0 and dn > 0 else 1.0
            d = d * q
        mu.mul_(momentum).add_(d)
        out.append(p - lr * mu)
    return out


def params_and_grads(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 4), (8,), (3, 3, 2, 2), (5,), (6, 2), (4, 4)]
    params = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    params[4].zero_()  # zero weights (ndim 2): no adaptation, q = 1
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) for s in shapes] for _ in range(4)]
    for step in grads:
        step[5].zero_()  # a zero gradient on a matrix: with weight decay d = wd·p, without d = 0 (q = 1)
    return params, grads


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_lars_is_moco_v3s_rule_step_for_step(momentum, weight_decay):
    """Catches lightly's rule (‖g‖ + wd·‖p‖ in the denominator, skipped on a zero gradient, no adaptation when
    weight_decay=0) and decay or adaptation of 1-d parameters."""
    params, grads = params_and_grads(0)
    ours = [p.clone().requires_grad_() for p in params]
    ref, bufs = [p.clone() for p in params], [torch.zeros_like(p) for p in params]
    opt = LARS([{"params": ours, "weight_decay": weight_decay}], lr=0.3, momentum=momentum, trust_coefficient=0.02)
    for step in grads:
        for p, g in zip(ours, step):
            p.grad = g.clone()
        opt.step()
        ref = reference_lars_step(ref, step, bufs, 0.3, momentum, weight_decay, 0.02)
        for p, r in zip(ours, ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-12, atol=1e-12)
    # 1-d parameters: plain SGD with momentum (no decay, no adaptation)
    expected_1d, buf = params[1].clone(), torch.zeros_like(params[1])
    for step in grads:
        buf = momentum * buf + step[1]
        expected_1d -= 0.3 * buf
    torch.testing.assert_close(ours[1].detach(), expected_1d, rtol=1e-12, atol=1e-12)


def test_lars_without_weight_decay_still_adapts_unlike_lightly():
    """With weight_decay=0 lightly's LARS is plain SGD; moco-v3's scales the update to tc·‖p‖ per layer."""
    p = torch.full((4, 4), 2.0, requires_grad=True)
    p.grad = torch.full((4, 4), 5.0)
    LARS([p], lr=1.0, momentum=0.0, trust_coefficient=0.001).step()
    # update = tc·‖p‖/‖g‖ · g: its norm is tc·‖p‖ = 0.001·8
    torch.testing.assert_close((torch.full((4, 4), 2.0) - p.detach()).norm(), torch.tensor(0.008))
    q = torch.full((4, 4), 2.0, requires_grad=True)
    q.grad = torch.full((4, 4), 5.0)
    LightlyLARS([q], lr=1.0, momentum=0.0).step()
    assert (torch.full((4, 4), 2.0) - q.detach()).norm() > 100 * 0.008


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


def small_net():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))


def test_parameter_groups_of_each_optimizer():
    """The official v1/v2 SGD decays everything; decay_norm_bias=False spares norms and biases; LARS gets one group
    (its rule decides by ndim, as moco-v3 passes model.parameters())."""
    net = small_net()
    n = len(list(net.parameters()))
    sgd_all = build_optimizer("sgd", [net], 0.1, 1e-4, 0.9, decay_norm_bias=True)
    assert [len(g["params"]) for g in sgd_all.param_groups] == [n] and sgd_all.param_groups[0]["weight_decay"] == 1e-4
    sgd = build_optimizer("sgd", [net], 0.1, 1e-4, 0.9, decay_norm_bias=False)
    decayed, free = sgd.param_groups
    assert all(p.ndim > 1 for p in decayed["params"]) and all(p.ndim == 1 for p in free["params"])
    assert free["weight_decay"] == 0.0 and len(decayed["params"]) + len(free["params"]) == n
    for flag in (True, False):
        lars = build_optimizer("lars", [net], 0.1, 1e-6, 0.9, decay_norm_bias=flag)
        assert isinstance(lars, LARS) and len(lars.param_groups) == 1 and len(lars.param_groups[0]["params"]) == n
