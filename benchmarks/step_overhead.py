"""What does a MoCo training step cost on top of the encoder work it contains?

    python -m benchmarks.step_overhead                        # sections 0-3 (~6 min on 2 cores)
    python -m benchmarks.step_overhead --sections 0 1 --repeats 7
    python -m benchmarks.step_overhead --config quickstart --override=--model.width=1.0

The model is a config's (default ``configs/fashion_mnist_moco_v2.yaml``: ResNet-18 at half width, K 4096, split BN).

0. Split BatchNorm's cost, one layer (128, 64, 8, 8), channels-last, forward + backward in training mode: the aten
   operators a profiler lists and the computing operators dispatched (the kernels a GPU would launch; views and
   other metadata operators left out), and the time, for BatchNorm2d, :class:`SplitBatchNorm2d` with 2, 8 and 32
   splits, and the per-split loop it replaced (a BatchNorm per sub-batch, concatenated: #53's "before"). Goal: a
   count independent of the splits, at most twice BatchNorm2d's.
1. Step vs bare encoder work, interleaved inside one ``Trainer.fit``:
   - bare encoder work: query forward + backward + key forward under no_grad + SGD step, same backbone and head,
     same batch, plain PyTorch and BatchNorm (loss -mean(q.k): no queue, no momentum update, no enqueue);
   - MoCo module step: ``MoCo.contrast`` + backward + SGD step + momentum update + enqueue, called directly, with
     the module's one-device setup (split BatchNorm, 8 splits, and the key-batch shuffle);
   - the same module step with plain BatchNorm (``shuffle_bn: off``): what the split itself costs;
   - MoCo under ``Trainer.fit``: the real loop (logging every step, cosine lr), fed the same tensors by a free loader.
   At the start of each cycle a callback times ``--steps`` steps of the bare work and of the module step (order
   alternating), then the fit runs ``--steps`` timed steps. Medians over ``--repeats`` cycles; ratios paired per
   cycle. Goal: module step / bare <= 1.05. Every case runs at ``--precision`` (default ``auto``: what the CLI's
   ``precision: auto`` picks here): the Trainer's ``precision`` for the fit, its plugin's forward context entered
   per step for the direct calls.
2. K 4096 vs 65536: the module step at both (the InfoNCE against the queue grows with K).
3. The momentum update: ours (one ``torch._foreach_lerp_``), lightly's ``update_momentum``, the official
   per-parameter loop.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from benchmarks._common import (
    config_path,
    footer,
    forward_context,
    from_config,
    header,
    parser,
    print_table,
    quiet,
    trainer_kwargs,
)
from benchmarks.timing import interleaved, paired_ratio, spread, time_per_call


def setup_model(args, *overrides: str):
    """(MoCo set up for one device as ``setup('fit')`` does, its datamodule, its optimizer at the config's lr)."""
    from types import SimpleNamespace

    torch.manual_seed(args.seed)
    model, dm = from_config(config_path(args.config), *args.override, *overrides)
    model.trainer = SimpleNamespace(
        world_size=1, strategy=SimpleNamespace(_layer_sync=None), global_step=0, training=True, precision="32-true",
        train_dataloader=SimpleNamespace(batch_size=dm.batch_size), accumulate_grad_batches=1, callbacks=[],  # checks
    )  # fmt: skip
    model.prepare_run("fit")
    model.trainer = None
    model.train()
    lr = model.hparams.lr * dm.batch_size / 256
    return model, dm, torch.optim.SGD([p for m in model.trained_modules() for p in m.parameters()], lr=lr, momentum=0.9)


def views(dm, seed: int) -> tuple[Tensor, Tensor]:
    """Two augmented views of real Fashion-MNIST images (the datamodule's own BatchViews)."""
    images, _ = dm.load_split("train")
    x_q, x_k = dm.views(images[: dm.batch_size], torch.Generator().manual_seed(seed))[:2]
    return x_q.contiguous(), x_k.contiguous()


def module_step(model, opt, x_q: Tensor, x_k: Tensor, cast=contextlib.nullcontext) -> Callable[[], None]:
    """One MoCo step as Lightning's automatic optimisation runs it (zero_grad, step, backward, optimizer, end hook);
    ``cast``: a factory of the forward's precision context (:func:`benchmarks._common.forward_context`)."""

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        with cast():
            out = model.views_loss([x_q, x_k])
        out["loss"].backward()
        opt.step()
        model.momentum_copy.update(model, model.hparams.momentum)
        model.dictionary.enqueue(out["stored"][0])

    return run


def bare_step(model, x_q: Tensor, x_k: Tensor, cast=contextlib.nullcontext) -> Callable[[], None]:
    """The encoder work of the same step in plain PyTorch: copies of the module's backbone and head, plain BN."""
    from moco_lightning.modules.split_bn import revert_split_bn

    q = nn.Sequential(revert_split_bn(copy.deepcopy(model.backbone)), copy.deepcopy(model.projection_head)).train()
    k = copy.deepcopy(q).requires_grad_(False)
    opt = torch.optim.SGD(q.parameters(), lr=0.01, momentum=0.9)
    layout = model.in_layout

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        with cast():
            qq = F.normalize(q(layout(x_q)), dim=1)
            with torch.no_grad():
                kk = F.normalize(k(layout(x_k)), dim=1)
        (-(qq * kk).sum(1).mean()).backward()
        opt.step()

    return run


class SameBatch(Dataset):
    """The same ([x_q, x_k], target, index) batch every time, with no per-item or collate cost."""

    def __init__(self, batch, length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __getitems__(self, indices):
        return self.batch


def section1(args) -> None:
    import lightning.pytorch as pl

    from moco_lightning.training.precision import auto_precision

    precision = auto_precision("cpu", verbose=False) if args.precision == "auto" else args.precision
    cast = forward_context(precision)
    model, dm, opt = setup_model(args)
    plain, _, plain_opt = setup_model(args, "--model.shuffle_bn=off")
    x_q, x_k = views(dm, args.seed)
    cases = {
        "bare encoder work": bare_step(model, x_q, x_k, cast),
        f"MoCo module step, split BN ({model.hparams.bn_splits})": module_step(model, opt, x_q, x_k, cast),
        "MoCo module step, plain BN": module_step(plain, plain_opt, x_q, x_k, cast),
    }
    for fn in cases.values():  # warm-up: optimizer state, kernel choices
        fn()
    results: Dict[str, List[float]] = {name: [] for name in [*cases, "MoCo under Trainer.fit"]}
    warmup, steps = 2, args.steps

    class Cycle(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            now, b = time.perf_counter(), batch_idx - warmup
            if b < 0 or b % steps:
                return
            if b // steps > 0:
                results["MoCo under Trainer.fit"].append((now - self.mark) / steps)
            if b // steps < args.repeats:
                with torch.enable_grad():
                    for name in list(cases) if (b // steps) % 2 == 0 else list(cases)[::-1]:
                        results[name].append(time_per_call(cases[name], steps, warmup=0))
            self.mark = time.perf_counter()

    torch.manual_seed(args.seed)
    fit_model, _ = from_config(config_path(args.config), *args.override)
    max_steps = warmup + args.repeats * steps + 1
    batch = ([x_q, x_k], torch.zeros(len(x_q), dtype=torch.long), torch.arange(len(x_q)))
    loader = DataLoader(SameBatch(batch, max_steps * len(x_q)), batch_size=len(x_q), collate_fn=lambda b: b)
    pl.Trainer(**trainer_kwargs(max_steps, [Cycle()], precision=precision)).fit(fit_model, train_dataloaders=loader)
    cycles = f"{args.repeats} cycles of {steps} steps"
    print(f"== 1. MoCo step vs the bare encoder work ({args.config}, {precision}; {cycles}) ==")
    base = results["bare encoder work"]
    print_table(
        [[n, spread(v, 1, "{:.3f}"), f"{paired_ratio(v, base):.3f}"] for n, v in results.items()],
        ["case", "s/step", "ratio to bare"],
    )


class LoopSplitBatchNorm2d(nn.BatchNorm2d):
    """The split BatchNorm #53 replaced, for comparison: a BatchNorm per contiguous sub-batch, concatenated."""

    def __init__(self, num_features: int, num_splits: int) -> None:
        super().__init__(num_features)
        self.num_splits = num_splits

    def forward(self, x: Tensor) -> Tensor:
        s = self.num_splits
        stats = (self.running_mean.repeat(s, 1), self.running_var.repeat(s, 1))
        y = torch.cat(
            [
                F.batch_norm(c, stats[0][j], stats[1][j], self.weight, self.bias, True, self.momentum, self.eps)
                for j, c in enumerate(x.chunk(s))
            ]
        )
        with torch.no_grad():
            self.running_mean.copy_(stats[0].mean(0))
            self.running_var.copy_(stats[1].mean(0))
        return y


#: operators that only describe a tensor (no kernel on a GPU)
METADATA = {"view", "_unsafe_view", "unsqueeze", "expand", "unbind", "select", "slice", "detach", "as_strided", "alias"}


def kernel_ops(fn: Callable[[], None]) -> int:
    """The aten operators one call of ``fn`` dispatches that compute something: what a GPU launches as kernels,
    views and other metadata operators left out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func.overloadpacket.__name__ not in METADATA
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def operator_counts(fn: Callable[[], None]) -> tuple[int, int]:
    """(aten operators in a profile of one call, :func:`kernel_ops` of one call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")), kernel_ops(fn)


def section0(args) -> None:
    from moco_lightning.modules.split_bn import batch_norm_splits

    x = torch.randn(128, 64, 8, 8).contiguous(memory_format=torch.channels_last).requires_grad_()
    bn = nn.BatchNorm2d(64)
    steps = {"BatchNorm2d": lambda: bn(x).sum().backward()}
    for s in (2, 8, 32):  # the GPU's path (fused), here on the CPU
        steps[f"SplitBatchNorm2d, {s} splits"] = lambda s=s: (
            batch_norm_splits(x, bn.weight, bn.bias, s, 1e-5, True)[0].sum().backward()
        )
    steps["SplitBatchNorm2d on a CPU (per split), 8 splits"] = lambda: (
        batch_norm_splits(x, bn.weight, bn.bias, 8, 1e-5, False)[0].sum().backward()
    )
    loop = LoopSplitBatchNorm2d(64, 8)
    steps["per-split loop (before #53), 8 splits"] = lambda: loop(x).sum().backward()
    counts = {name: operator_counts(fn) for name, fn in steps.items()}
    times = interleaved({n: (lambda f=f: time_per_call(f, 20)) for n, f in steps.items()}, args.repeats)
    base, base_t = counts["BatchNorm2d"][0], times["BatchNorm2d"]
    print("== 0. Split BatchNorm, one layer (128, 64, 8, 8) channels-last, forward + backward ==")
    print_table(
        [
            [
                n,
                str(c[0]),
                f"{c[0] / base:.2f}",
                str(c[1]),
                spread(times[n], 1e3, "{:.2f}"),
                f"{paired_ratio(times[n], base_t):.2f}",
            ]
            for n, c in counts.items()
        ],  # fmt: skip
        ["layer", "aten ops (profiler)", "ratio to BN", "kernel ops", "ms", "time ratio to BN"],
    )


def section2(args) -> None:
    cases = {}
    for k in (4096, 65536):
        model, dm, opt = setup_model(args, f"--model.queue_size={k}")
        x_q, x_k = views(dm, args.seed)
        fn = module_step(model, opt, x_q, x_k)
        fn()
        cases[f"module step, K={k}"] = lambda f=fn: time_per_call(f, args.steps, warmup=0)
    res = interleaved(cases, args.repeats)
    base = res["module step, K=4096"]
    print("== 2. The queue size ==")
    print_table(
        [[n, spread(v, 1, "{:.3f}"), f"{paired_ratio(v, base):.2f}"] for n, v in res.items()],
        ["case", "s/step", "ratio to K=4096"],
    )


def section3(args) -> None:
    from lightly.models.utils import update_momentum

    model, _, _ = setup_model(args)
    q, k = [model.backbone, model.projection_head], [model.key_backbone, model.key_projection_head]

    def loop() -> None:
        with torch.no_grad():
            for mq, mk in zip(q, k):
                for pq, pk in zip(mq.parameters(), mk.parameters()):
                    pk.data = pk.data * 0.99 + pq.data * 0.01

    cases = {
        "ours (one foreach lerp)": lambda: model.momentum_copy.update(model, 0.99),
        "lightly update_momentum": lambda: [update_momentum(a, b, 0.99) for a, b in zip(q, k)],
        "official per-parameter loop": loop,
    }
    res = interleaved({n: (lambda f=f: time_per_call(f, 20)) for n, f in cases.items()}, args.repeats)
    base = res["ours (one foreach lerp)"]
    print("== 3. The momentum update ==")
    print_table(
        [[n, spread(v, 1e3, "{:.2f}"), f"{paired_ratio(v, base):.2f}"] for n, v in res.items()],
        ["case", "ms/call", "ratio to ours"],
    )


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--config", default="fashion_mnist_moco_v2")
    p.add_argument("--override", nargs="*", default=[], help="CLI overrides, e.g. --override=--model.width=1.0")
    p.add_argument("--sections", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=3, help="steps per measurement")
    p.add_argument("--precision", default="auto", help="section 1: auto (the CLI's pick here), 32-true or bf16-mixed")
    p.set_defaults(threads=1)
    args = p.parse_args(argv)
    quiet()
    t0 = time.perf_counter()
    header("MoCo step overhead", args)
    for s in args.sections:
        (section0, section1, section2, section3)[s](args)
    footer(t0)


if __name__ == "__main__":
    main()
