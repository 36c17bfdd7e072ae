"""Shuffle BN on one device (split BatchNorm): the key batch permuted before BatchNorm, the user's BatchNorm back after
the fit, the batch checked against bn_splits."""

import math

import pytest
import torch
from helpers.data import tiny_data
from helpers.models import tiny_moco
from helpers.trainers import cpu_trainer
from lightning.pytorch import Callback
from torch import nn


def test_no_host_copy_of_the_key_shuffle_permutation(seeded, monkeypatch):
    """The shuffle permutation is drawn on the batch's device: nothing drawn on the CPU is copied over."""
    devices = []
    original = torch.randperm

    def recording(*args, **kwargs):
        devices.append((kwargs.get("device"), kwargs["generator"].device))
        return original(*args, **kwargs)

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            monkeypatch.setattr(torch, "randperm", recording)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            monkeypatch.undo()

    model = tiny_moco(shuffle_bn="split", bn_splits=4)
    cpu_trainer(max_steps=1, limit_val_batches=0, callbacks=[Record()]).fit(model, tiny_data())
    assert devices == [(torch.device("cpu"), torch.device("cpu"))]  # the batch's device (here the CPU), both


def test_split_shuffle_bn_permutes_the_key_batch_before_batchnorm(seeded):
    """Drawing the permutation and not applying it used to pass every test: here the keys must equal the key encoder
    run (split BN, train mode) on the permuted batch, un-permuted, and differ from the unshuffled keys."""
    from moco_lightning.modules.split_bn import convert_split_bn

    model = tiny_moco(shuffle_bn="split", bn_splits=2)
    model._shuffle = "split"
    convert_split_bn(model.key_backbone, 2)
    model.train()
    x = torch.cat([torch.randn(4, 1, 28, 28) + 3, torch.randn(4, 1, 28, 28) - 3])  # the halves are the sub-batches
    k = model.key(x)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(1_000_003 * (0 + 1)))  # global step 0
    assert not torch.equal(perm, torch.arange(8))

    def encode(x):  # f_k alone, no shuffle
        return torch.nn.functional.normalize(model.key_projection_head(model.key_backbone(x)), dim=1)

    with torch.no_grad():
        shuffled = encode(x[perm])
        plain = encode(x)
    torch.testing.assert_close(k, torch.empty_like(shuffled).index_copy_(0, perm, shuffled), rtol=0, atol=1e-6)
    assert (k - plain).abs().max() > 1e-3  # the permutation changed what each sub-batch's BatchNorm saw


def test_after_fit_the_backbone_is_the_users_again_and_extracts_features(seeded):
    """README: ``model.eval(); features = model(images)`` after fit, for any batch size; split BN only while fitting."""
    from moco_lightning.modules.split_bn import SplitBatchNorm2d

    model = tiny_moco(shuffle_bn="split", bn_splits=4)
    types = {name: type(m) for name, m in model.backbone.named_modules()}
    keys = set(model.state_dict())
    cpu_trainer(max_steps=2, limit_val_batches=0).fit(model, tiny_data())
    assert {name: type(m) for name, m in model.backbone.named_modules()} == types
    assert not any(isinstance(m, SplitBatchNorm2d) for m in model.modules())
    assert set(model.state_dict()) == keys
    model.eval()
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    features = model(torch.randn(5, 1, 28, 28))  # 5 does not split into 4 sub-batches
    assert features.shape == (5, 16)
    assert all(torch.equal(before[k], v) for k, v in model.backbone.state_dict().items())  # running stats untouched
    cpu_trainer(max_steps=3, limit_val_batches=0).fit(model, tiny_data())  # and it can be fitted again
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.backbone.modules())


def test_bn_splits_not_dividing_the_batch_fails_at_fit_start_naming_both_fields(seeded):
    from moco_lightning.callbacks import KNNMonitor

    monitor = KNNMonitor()
    with pytest.raises(
        ValueError, match=r"bn_splits=8 does not divide the per-device batch of 20 images .*data.batch_size"
    ):
        cpu_trainer(max_steps=1, limit_val_batches=0, callbacks=[monitor]).fit(
            tiny_moco(shuffle_bn="split", bn_splits=8), tiny_data(batch_size=20)
        )
    assert monitor.history == []  # before the kNN baseline, not after it


# --- the layer itself: every sub-batch as BatchNorm2d on its own, at the cost of one BatchNorm -------------------
@pytest.fixture(params=[True, False], ids=["fused", "per-split"])
def path(request, monkeypatch):
    """Both ways the layer computes its split, on the CPU: the fused one a GPU runs and the CPU's per-split one."""
    import functools

    from moco_lightning.modules import split_bn

    monkeypatch.setattr(
        split_bn, "batch_norm_splits", functools.partial(split_bn.batch_norm_splits, fused=request.param)
    )
    return request.param


def reference(split, x: torch.Tensor):
    """What SplitBatchNorm2d computes, by definition: a BatchNorm2d (a copy of the layer's state) per contiguous
    sub-batch, the outputs concatenated, the running statistics the average of the copies'."""
    copies = [nn.BatchNorm2d(x.shape[1], **_settings(split)) for _ in range(split.num_splits)]
    outs = []
    for bn, chunk in zip(copies, x.chunk(split.num_splits)):
        bn.load_state_dict(split.state_dict())
        bn.weight, bn.bias = split.weight, split.bias  # the same parameters: their gradients add up
        outs.append(bn(chunk))
    if not split.track_running_stats:
        return torch.cat(outs), None
    running = [torch.stack([getattr(bn, k) for bn in copies]).mean(0) for k in ("running_mean", "running_var")]
    return torch.cat(outs), running


def _settings(bn):
    return dict(eps=bn.eps, momentum=bn.momentum, affine=bn.affine, track_running_stats=bn.track_running_stats)


def _layer(splits: int = 4, c: int = 6, **kwargs):
    from moco_lightning.modules.split_bn import SplitBatchNorm2d

    layer = SplitBatchNorm2d(c, splits, **kwargs)
    if layer.affine:
        with torch.no_grad():
            layer.weight.uniform_(0.5, 2)
            layer.bias.uniform_(-1, 1)
    if layer.track_running_stats:
        layer.running_mean.uniform_(-1, 1)
        layer.running_var.uniform_(0.5, 2)
    return layer


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize(
    "settings", [{}, dict(momentum=None), dict(affine=False), dict(track_running_stats=False)], ids=str
)
def test_forward_backward_and_running_statistics_equal_a_batchnorm_per_sub_batch(seeded, path, memory_format, settings):
    layer = _layer(**settings)
    x = (torch.randn(16, 6, 5, 7) * 3 + 1.5).contiguous(memory_format=memory_format).requires_grad_()
    dy = torch.randn(16, 6, 5, 7)
    ref_layer = _layer(**settings)
    ref_layer.load_state_dict(layer.state_dict())
    x_ref = x.detach().clone().requires_grad_()
    for _ in range(2):  # twice: num_batches_tracked drives momentum=None's cumulative average
        y = layer(x)
        y_ref, running = reference(ref_layer, x_ref)
        if ref_layer.track_running_stats:
            ref_layer.running_mean.copy_(running[0])
            ref_layer.running_var.copy_(running[1])
            ref_layer.num_batches_tracked.add_(1)
    assert y.is_contiguous(memory_format=memory_format) and y.dtype == x.dtype
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    if layer.affine:
        torch.testing.assert_close(layer.weight.grad, ref_layer.weight.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.bias.grad, ref_layer.bias.grad, rtol=1e-5, atol=1e-5)
    if layer.track_running_stats:
        torch.testing.assert_close(layer.running_mean, ref_layer.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer.running_var, ref_layer.running_var, rtol=1e-5, atol=1e-6)
        assert int(layer.num_batches_tracked) == 2
        layer.eval()
        ref_layer.eval()
        torch.testing.assert_close(layer(x), nn.BatchNorm2d.forward(ref_layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_under_bf16_autocast_it_matches_the_per_sub_batch_batchnorm(seeded, path, memory_format):
    """A convolution's bf16 output normalised: output bf16 in the input's layout, within bf16's resolution of the
    per-sub-batch BatchNorm2d under the same autocast; fp32 gradients of the weights."""
    conv = nn.Conv2d(3, 6, 3, padding=1).to(memory_format=memory_format)
    layer = _layer()
    ref_layer = _layer()
    ref_layer.load_state_dict(layer.state_dict())
    x = torch.randn(16, 3, 8, 8).contiguous(memory_format=memory_format)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = conv(x)
        assert h.dtype == torch.bfloat16
        y = layer(h)
        y_ref, running = reference(ref_layer, h)
    assert y.dtype == y_ref.dtype == torch.bfloat16 and y.is_contiguous(memory_format=memory_format)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(layer.running_mean, running[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(layer.running_var, running[1], rtol=1e-3, atol=1e-3)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad((y.float() * dy).sum(), [conv.weight, layer.weight, layer.bias], retain_graph=True)
    ref = torch.autograd.grad((y_ref.float() * dy).sum(), [conv.weight, ref_layer.weight, ref_layer.bias])
    for g, r in zip(grads, ref):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=3e-2, atol=3e-2 * r.abs().max().item())


def split_bn_ops(splits: int, memory_format=torch.channels_last, fused: bool = True) -> int:
    """Kernel operators of one forward + backward of a training-mode layer (``splits`` 0: BatchNorm2d) on
    (128, 64, 8, 8), with the ``.sum().backward()`` around it; ``fused``: the GPU's path."""
    from benchmarks.step_overhead import kernel_ops
    from moco_lightning.modules.split_bn import batch_norm_splits

    layer = nn.BatchNorm2d(64)
    x = torch.randn(128, 64, 8, 8).contiguous(memory_format=memory_format).requires_grad_()
    if not splits:
        return kernel_ops(lambda: layer(x).sum().backward())
    return kernel_ops(lambda: batch_norm_splits(x, layer.weight, layer.bias, splits, 1e-5, fused)[0].sum().backward())


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_its_cost_on_a_gpu_does_not_grow_with_the_splits(memory_format):
    """The per-split loop's operators grew with the splits (a BatchNorm forward and backward per split, a
    concatenation, copies of the running statistics; #53): now the GPU's path runs the same operators for 2, 8
    or 32 splits: the sums and the normalisation over the activations, the backward's sums and dx, and small ones on
    the (splits, C) statistics (benchmarks/step_overhead.py --sections 0 prints the profiler's count beside
    BatchNorm2d's)."""
    counts = {s: split_bn_ops(s, memory_format) for s in (2, 8, 32)}
    assert counts[2] == counts[8] == counts[32] <= 42, counts


def full_size_copies(fused: bool) -> list:
    """The copies (``aten::_to_copy``: a dtype's change) of a (32, 8, 6, 6) tensor the size of the activations in a
    bf16 forward + backward of the split, in the profiler's events (torch's kernels call them below Python)."""
    from torch.profiler import ProfilerActivity, profile

    from moco_lightning.modules.split_bn import batch_norm_splits

    x = torch.randn(32, 8, 6, 6).to(torch.bfloat16).contiguous(memory_format=torch.channels_last).requires_grad_()
    layer = nn.BatchNorm2d(8)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        y = batch_norm_splits(x, layer.weight, layer.bias, 4, 1e-5, fused)[0]
        y.backward(torch.ones_like(y))
    assert y.dtype == x.grad.dtype == torch.bfloat16
    return [e.name for e in prof.events() if e.name == "aten::_to_copy" and math.prod(e.input_shapes[0]) == x.numel()]


def test_on_a_cpu_it_makes_no_float32_copy_of_bf16_activations():
    """The fused path's fp32 sums of bf16 activations copy them to fp32 on a CPU (4 per layer and step: 20 % of the
    demo's step); the CPU's path, BatchNorm's own kernel per sub-batch, accumulates in fp32 without a copy."""
    assert len(full_size_copies(fused=True)) >= 4
    assert full_size_copies(fused=False) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_paths_statistics_equal_float64s(seeded, dtype):
    """The fused path's statistics of the sub-batches (one Welford pass in fp32, sums with an fp32 accumulator for
    bf16), on the CPU: fp32, against float64."""
    from moco_lightning.modules.split_bn import _moments

    x = (torch.randn(16, 6, 5, 7) * 3 + 1.5).contiguous(memory_format=torch.channels_last).to(dtype)
    xs = x.view(4, 4, 6, 5, 7)
    var, mean = _moments(xs)
    ref_var, ref_mean = torch.var_mean(xs.double(), dim=(1, 3, 4), correction=0, keepdim=True)
    assert var.dtype == mean.dtype == torch.float32 and var.shape == (4, 1, 6, 1, 1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the input itself rounded to 8 bits
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(var.double(), ref_var, rtol=tol, atol=tol)


def test_an_inplace_relu_after_it_backpropagates_as_after_batchnorm(seeded, path):
    """torchvision's blocks apply ReLU(inplace=True) to the BatchNorm's output: allowed, and the same gradients."""
    layer, ref_layer = _layer(), _layer()
    ref_layer.load_state_dict(layer.state_dict())
    x = torch.randn(16, 6, 5, 7).contiguous(memory_format=torch.channels_last).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    nn.ReLU(inplace=True)(layer(x)).pow(2).sum().backward()
    nn.ReLU(inplace=True)(reference(ref_layer, x_ref)[0]).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, ref_layer.weight.grad, rtol=1e-5, atol=1e-5)
