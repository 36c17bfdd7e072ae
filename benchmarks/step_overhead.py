"""What does a MoCo training step cost on top of the encoder work it contains?

    python benchmarks/step_overhead.py                      # everything, defaults (~5 min on 2 busy CPU cores)
    python benchmarks/step_overhead.py --widths 0.5 --repeats 5
    python benchmarks/step_overhead.py --profile            # + torch.profiler tables of one step of each kind

1. Step vs bare encoder work, per backbone width (default: the quickstart's ResNet-18 at 0.5, and full width):
   - bare encoder work: query forward + backward + key forward under no_grad + SGD step, same backbone and
     MLP head, same batch, same tensors, plain PyTorch (the loss is -mean(q.k), the cheapest one that
     backpropagates through the whole query encoder; no queue, no momentum update, no enqueue);
   - MoCo module step: ``MoCo.contrast`` + backward + SGD step + ``momentum_update`` + ``queue.enqueue``, called
     directly (what Lightning's automatic optimisation runs per step, without Lightning), with the module's own
     single-device setup (``shuffle_bn='auto'`` -> split BatchNorm, 8 splits, and the key-batch shuffle);
   - MoCo under ``Trainer.fit``: the real loop (logging every step, TensorBoard every 10 steps, cosine lr
     scheduler), fed the same tensors by a loader that costs nothing.
   The three are interleaved inside one ``Trainer.fit``: at the start of a cycle a callback times ``--steps``
   steps of the bare work and of the module step (order alternating), then the fit runs ``--steps`` timed steps
   (each case had a warm-up step before the first cycle). Median over ``--repeats`` cycles (``--repeats-other``
   for the other widths); ratios are paired per cycle. Many short cycles rather than a few long ones: on a shared
   machine the noise comes in bursts of seconds, and pairing short measurements cancels more of it.
   Goal: MoCo step / bare <= 1.05 at the quickstart width.
   With ``--attribution`` (on by default for the first width) two more cases split the difference: the module
   step with ``shuffle_bn='off'`` (plain BatchNorm) and a minimal MoCo in plain PyTorch (bare + InfoNCE against a
   K-queue + foreach momentum + slice enqueue).
2. The queue size: the module step and a short ``Trainer.fit`` at K = 4096 vs 65536 (goal <= 5 %), interleaved, and
   the per-step cost of the parts that grow with K: InfoNCE forward+backward, the logged metrics of ``_log_step``
   (computed in ``training_step``, so only under Trainer.fit), the enqueue.
3. The momentum update: ours (``MoCo.momentum_update``, one ``torch._foreach_lerp_``) vs lightly 1.6's ``update_momentum`` (also foreach)
   vs a per-parameter loop (the official MoCo code: ``p_k.data = p_k.data * m + p_q.data * (1 - m)``) vs
   our previous two-pass foreach version (mul_, then add_ of a scaled copy).
4. The enqueue: ``KeyQueue.enqueue`` vs a slice assignment (the official code's ``queue[:, ptr:ptr + n] = k.T``).

Every time is wall-clock on this machine; the tables give the median and [min-max] of the repeats.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    StepClock, add_model_args, describe_model, footer, header, interleaved, moco_kwargs, paired_ratio, print_table,
    quiet, spread, time_per_call, trainer_kwargs,
)


# --- the pieces ---------------------------------------------------------------------------------------------
def views(batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """Two augmented views of real Fashion-MNIST images (the datamodule's BatchViews), float NCHW."""
    from moco_lightning.datamodules import FashionMNISTDataModule

    dm = FashionMNISTDataModule(batch_size=batch_size, train_subset=batch_size, val_subset=1)
    dm.setup()
    images = dm._splits["train"].images[:batch_size]
    x_q, x_k = dm.views(images, torch.Generator().manual_seed(seed))
    return x_q.contiguous(), x_k.contiguous()


def make_moco(args, shuffle_bn: str = "auto", **overrides):
    """A MoCo module set up for one device exactly as ``MoCo.setup('fit')`` does it, without a Trainer."""
    from moco_lightning import MoCo

    model = MoCo(**moco_kwargs(args, shuffle_bn=shuffle_bn, **overrides))
    stub = SimpleNamespace(world_size=1, strategy=SimpleNamespace(_layer_sync=None), global_step=0, training=True)
    model.trainer = stub
    model.setup("fit")
    model.trainer = None
    model.train()
    return model


def module_optimizer(model, args) -> torch.optim.Optimizer:
    """The optimizer ``MoCo.configure_optimizers`` builds (SGD, no decay on norm and bias), at batch-256 lr."""
    from lightly.models.utils import get_weight_decay_parameters

    decay, no_decay = get_weight_decay_parameters([model.backbone, model.projection_head], decay_norm=False, decay_bias=False)
    return torch.optim.SGD([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                           lr=args.lr * args.batch_size / 256, momentum=0.9)


def module_step_fn(model, opt, x_q: Tensor, x_k: Tensor, m: float) -> Callable[[], None]:
    """One MoCo step as Lightning's automatic optimisation runs it (zero_grad, training, backward, step, end hook)."""
    step = [0]

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        out = model.contrast(x_q, x_k)
        out["loss"].backward()
        opt.step()
        step[0] += 1
        model.momentum_update(m)
        model.queue.enqueue(out["keys"], step=step[0])

    return run


class Bare:
    """The encoder work of a MoCo step and nothing else: same backbone, head and optimizer, plain PyTorch.

    ``queue_size > 0`` adds the minimum MoCo itself needs (InfoNCE against a K x dim queue, a foreach momentum
    update, a slice enqueue): the "minimal MoCo" of the attribution rows."""

    def __init__(self, args, queue_size: int = 0) -> None:
        from lightly.models.modules.heads import MoCoProjectionHead

        from moco_lightning.backbones import build_backbone

        self.cl = args.channels_last
        bb, d = build_backbone(args.backbone, args.cifar_stem, 1, 28, args.width)
        head = MoCoProjectionHead(d, args.hidden_dim, args.dim)
        if self.cl:
            bb, head = bb.to(memory_format=torch.channels_last), head.to(memory_format=torch.channels_last)
        self.q = nn.Sequential(bb, head).train()
        self.k = copy.deepcopy(self.q).requires_grad_(False).train()
        self.q_params, self.k_params = list(self.q.parameters()), list(self.k.parameters())
        self.opt = torch.optim.SGD(self.q_params, lr=args.lr * args.batch_size / 256, momentum=0.9, weight_decay=args.weight_decay)
        self.K, self.T, self.m = queue_size, args.temperature, args.momentum
        self.queue = F.normalize(torch.randn(queue_size, args.dim), dim=1) if queue_size else None
        self.ptr = 0

    def _layout(self, x: Tensor) -> Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.cl else x

    def step(self, x_q: Tensor, x_k: Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        q = F.normalize(self.q(self._layout(x_q)), dim=1)
        with torch.no_grad():
            k = F.normalize(self.k(self._layout(x_k)), dim=1)
        if self.queue is None:
            loss = -(q * k).sum(1).mean()
        else:
            logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.T], 1) / self.T
            loss = F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long))
        loss.backward()
        self.opt.step()
        if self.queue is not None:
            with torch.no_grad():
                torch._foreach_lerp_(self.k_params, self.q_params, 1 - self.m)
                n = len(k)
                self.queue[self.ptr:self.ptr + n] = k  # K is a multiple of the batch here
                self.ptr = (self.ptr + n) % self.K


# --- section 1: step vs bare, interleaved inside one Trainer.fit --------------------------------------------
class _SameBatch(Dataset):
    """Yields the same ([x_q, x_k], target, index) batch every time, with no per-item or collate cost."""

    def __init__(self, batch, length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):  # pragma: no cover - __getitems__ is used
        raise NotImplementedError

    def __getitems__(self, indices):
        return self.batch


def _first(x):
    return x


def compare_in_fit(args, width: float, repeats: int, attribution: bool, x_q: Tensor, x_k: Tensor) -> Dict[str, List[float]]:
    import lightning.pytorch as pl

    a = argparse.Namespace(**{**vars(args), "width": width})
    torch.manual_seed(args.seed)
    steps_of: Dict[str, Callable[[], None]] = {}
    bare = Bare(a)
    steps_of["bare encoder work"] = lambda: bare.step(x_q, x_k)
    model = make_moco(a)
    steps_of["MoCo module step"] = module_step_fn(model, module_optimizer(model, a), x_q, x_k, a.momentum)
    if attribution:
        model_off = make_moco(a, shuffle_bn="off")
        steps_of["  same, shuffle_bn='off'"] = module_step_fn(model_off, module_optimizer(model_off, a), x_q, x_k, a.momentum)
        minimal = Bare(a, queue_size=a.queue_size)
        steps_of["  minimal MoCo, plain PyTorch"] = lambda: minimal.step(x_q, x_k)
    for fn in steps_of.values():  # warm-up: first calls allocate optimizer state, pick convolution kernels, ...
        fn()

    results: Dict[str, List[float]] = {name: [] for name in steps_of}
    results["MoCo under Trainer.fit"] = []
    warmup, steps = 2, args.steps

    class Cycle(pl.Callback):
        """At batch warmup + c * steps (c = 0, 1, ...): close the fit's timing of cycle c - 1, time the other cases."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            now = time.perf_counter()
            b = batch_idx - warmup
            if b < 0 or b % steps:
                return
            c = b // steps
            if c > 0:
                results["MoCo under Trainer.fit"].append((now - self.mark) / steps)
            if c < repeats:
                names = list(steps_of) if c % 2 == 0 else list(steps_of)[::-1]
                with torch.enable_grad():
                    for name in names:
                        results[name].append(time_per_call(steps_of[name], steps, warmup=0))
            self.mark = time.perf_counter()

    from moco_lightning import MoCo

    torch.manual_seed(args.seed)
    fit_model = MoCo(**moco_kwargs(a))
    max_steps = warmup + repeats * steps + 1
    batch = ([x_q, x_k], torch.zeros(len(x_q), dtype=torch.long), torch.arange(len(x_q)))
    loader = DataLoader(_SameBatch(batch, max_steps * a.batch_size), batch_size=a.batch_size, collate_fn=_first)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(**trainer_kwargs(max_steps, args.logger, tmp, [Cycle()]))
        trainer.fit(fit_model, train_dataloaders=loader)
    return results


def section1(args, x_q: Tensor, x_k: Tensor) -> None:
    print("== 1. MoCo step vs the bare encoder work it contains ==")
    print(f"model: {describe_model(args)} (width per row)")
    print(f"each cell: seconds per step, median [min-max] over the cycles; a cycle times {args.steps} step(s) of every case, "
          "the order alternating; ratio: median of the per-cycle ratios to the bare encoder work")
    print(f"Trainer.fit: logger={args.logger!r}, log_every_n_steps=10, no progress bar, no validation, no checkpoints\n")
    for i, width in enumerate(args.widths):
        attribution = args.attribution == "all" or (args.attribution == "first" and i == 0)
        repeats = args.repeats if i == 0 else args.repeats_other
        res = compare_in_fit(args, width, repeats, attribution, x_q, x_k)
        base = res["bare encoder work"]
        rows = [[name, spread(v, 1, "{:.3f}"), f"{paired_ratio(v, base):.3f}"] for name, v in res.items()]
        print(f"-- {args.backbone} width {width}: {repeats} cycles --")
        print_table(rows, ["case", "s/step", "ratio to bare"])


# --- section 2: K ------------------------------------------------------------------------------------------
_FIT_MODELS: dict = {}


def fit_seconds_per_step(a, queue_size: int, x_q: Tensor, x_k: Tensor, steps: int, warmup: int = 2) -> float:
    """Seconds per loop iteration of a short ``Trainer.fit`` fed the same tensors (the model is kept between calls)."""
    import lightning.pytorch as pl

    from moco_lightning import MoCo

    if queue_size not in _FIT_MODELS:
        torch.manual_seed(a.seed)
        _FIT_MODELS[queue_size] = MoCo(**moco_kwargs(a, queue_size=queue_size))
    batch = ([x_q, x_k], torch.zeros(len(x_q), dtype=torch.long), torch.arange(len(x_q)))
    loader = DataLoader(_SameBatch(batch, (warmup + steps) * a.batch_size), batch_size=a.batch_size, collate_fn=_first)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        pl.Trainer(**trainer_kwargs(warmup + steps, a.logger, tmp, [clock])).fit(_FIT_MODELS[queue_size], train_dataloaders=loader)
    return clock.seconds(warmup, steps) / steps


def section2(args, x_q: Tensor, x_k: Tensor) -> None:
    small, large = args.queue_sizes
    print(f"== 2. Queue size: K = {small} vs {large} (width {args.widths[0]}) ==")
    print(f"module step: {args.steps} timed step(s) per measurement (after one warm-up step at the start); Trainer.fit: a "
          f"fresh short fit (the same model every time) of 2 warm-up + {max(2, args.steps)} timed steps; {args.repeats_k} interleaved repeats")
    a = argparse.Namespace(**{**vars(args), "width": args.widths[0]})
    cases, models = {}, {}
    for K in (small, large):
        torch.manual_seed(args.seed)
        model = make_moco(a, queue_size=K)
        opt = module_optimizer(model, a)
        models[K] = model
        fn = module_step_fn(model, opt, x_q, x_k, a.momentum)
        fn()
        cases[f"MoCo module step, K={K}"] = (lambda fn=fn: time_per_call(fn, args.steps, warmup=0))
    for K in (small, large):
        cases[f"MoCo under Trainer.fit, K={K}"] = (lambda K=K: fit_seconds_per_step(a, K, x_q, x_k, max(2, args.steps)))
    res = interleaved(cases, args.repeats_k)
    s = res[f"MoCo module step, K={small}"]
    fs = res[f"MoCo under Trainer.fit, K={small}"]
    print_table([[n, spread(v, 1, "{:.3f}"), f"{paired_ratio(v, s if 'module' in n else fs):.3f}"] for n, v in res.items()],
                ["case", "s/step", f"ratio to the same at K={small}"])

    # the parts that grow with K, each alone (per step, ms)
    n, d = args.batch_size, args.dim
    from moco_lightning.loss import info_nce

    parts: Dict[str, Callable[[], float]] = {}
    for K in (small, large):
        model = models[K]
        q0 = F.normalize(torch.randn(n, d), dim=1)
        k = F.normalize(torch.randn(n, d), dim=1)

        def loss_fb(model=model, q0=q0, k=k) -> None:
            q = q0.clone().requires_grad_(True)
            info_nce(q, k, model.queue.keys, a.temperature)[0].backward()

        with torch.no_grad():
            out = model.contrast(x_q, x_k)
        model.log = model.log_dict = lambda *a_, **k_: None  # _log_step's tensor work, without Lightning's logger

        def log_metrics(model=model, out=out) -> None:
            model._log_step("train", out, on_step=True, on_epoch=False)

        def enqueue(model=model, k=k) -> None:
            model.queue.enqueue(k, step=1)

        reps = 10 if K <= 8192 else 3
        parts[f"InfoNCE fwd+bwd, K={K}"] = (lambda f=loss_fb, r=reps: time_per_call(f, r, 1))
        parts[f"_log_step metrics (Trainer.fit only), K={K}"] = (lambda f=log_metrics, r=reps: time_per_call(f, r, 1))
        parts[f"queue.enqueue, K={K}"] = (lambda f=enqueue: time_per_call(f, 50, 5))
    pres = interleaved(parts, 3)
    step_s = statistics.median(s)
    print(f"the parts that grow with K, alone (ms per step, median [min-max] of 3; % of the K={small} module step, {step_s:.3f} s):")
    print_table([[name, spread(v, 1e3, "{:.2f}"), f"{100 * statistics.median(v) / step_s:.1f} %"] for name, v in pres.items()],
                ["part", "ms", "% of step"])
    flops = lambda K: 2 * 2 * n * d * K  # noqa: E731 - q @ queue.T forward and its backward w.r.t. q (the queue has no grad)
    print(f"(q @ queue.T alone is {flops(small) / 1e9:.2f} GFLOP per step (forward + backward) at K={small} and "
          f"{flops(large) / 1e9:.2f} at K={large}, and the softmax runs over {n} x {large + 1} logits: work that any MoCo "
          "with the larger dictionary does)\n")


# --- sections 3 and 4: momentum update and enqueue -------------------------------------------------------
def section3(args) -> None:
    from lightly.models.utils import update_momentum

    print("== 3. Momentum update (backbone + head), per call ==")
    rows = []
    for width in args.widths:
        a = argparse.Namespace(**{**vars(args), "width": width})
        model = make_moco(a)
        m = a.momentum
        q = [*model.backbone.parameters(), *model.projection_head.parameters()]
        k = [*model.key_backbone.parameters(), *model.key_projection_head.parameters()]
        numel = sum(p.numel() for p in q)

        def loop() -> None:
            with torch.no_grad():
                for pk, pq in zip(k, q):
                    pk.data = pk.data * m + pq.data * (1.0 - m)

        def two_pass() -> None:  # what MoCo.momentum_update did before: foreach mul_, then add_ of a scaled copy
            with torch.no_grad():
                torch._foreach_mul_(k, m)
                torch._foreach_add_(k, torch._foreach_mul(q, 1.0 - m))

        def lightly_fn() -> None:
            update_momentum(model.backbone, model.key_backbone, m)
            update_momentum(model.projection_head, model.key_projection_head, m)

        cases = {"ours: MoCo.momentum_update (one torch._foreach_lerp_)": lambda: time_per_call(lambda: model.momentum_update(m), 20, 3),
                 "lightly 1.6 update_momentum x2 (foreach mul_ + add_ alpha)": lambda: time_per_call(lightly_fn, 20, 3),
                 "per-parameter loop (official MoCo code)": lambda: time_per_call(loop, 20, 3),
                 "foreach mul_ + mul + add_ (ours before)": lambda: time_per_call(two_pass, 20, 3)}
        res = interleaved(cases, 5)
        ours = res[list(cases)[0]]
        for name, v in res.items():
            rows.append([f"width {width} ({len(q)} tensors, {numel / 1e6:.2f} M params): {name}", spread(v, 1e3, "{:.2f}"),
                         f"{paired_ratio(v, ours):.2f}"])
    print_table(rows, ["case", "ms/call", "ratio to ours"])


def section4(args) -> None:
    print("== 4. Enqueue, per call (batch of keys = the batch size) ==")
    rows = []
    for K in args.queue_sizes:
        from moco_lightning.queue import KeyQueue

        queue = KeyQueue(K, args.dim)
        keys = F.normalize(torch.randn(args.batch_size, args.dim), dim=1)
        plain = queue.keys.clone()
        ptr = [0]

        def slice_copy() -> None:
            plain[ptr[0]:ptr[0] + len(keys)] = keys
            ptr[0] = (ptr[0] + len(keys)) % K

        cases = {f"K={K}: KeyQueue.enqueue (index_put + step record)": lambda: time_per_call(lambda: queue.enqueue(keys, step=1), 200, 10),
                 f"K={K}: slice assignment": lambda: time_per_call(slice_copy, 200, 10)}
        res = interleaved(cases, 5)
        first = res[list(cases)[0]]
        rows += [[n, spread(v, 1e6, "{:.0f}"), f"{paired_ratio(v, first):.2f}"] for n, v in res.items()]
    print_table(rows, ["case", "us/call", "ratio to KeyQueue"])


def profile(args, x_q: Tensor, x_k: Tensor) -> None:
    from torch.profiler import profile as tprofile

    a = argparse.Namespace(**{**vars(args), "width": args.widths[0]})
    model = make_moco(a)
    fns = {"MoCo module step": module_step_fn(model, module_optimizer(model, a), x_q, x_k, a.momentum)}
    bare = Bare(a)
    fns["bare encoder work"] = lambda: bare.step(x_q, x_k)
    for name, fn in fns.items():
        fn()
        fn()
        with tprofile() as prof:
            fn()
        print(f"== profile: one {name} (width {a.width}) ==")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    add_model_args(p)
    p.add_argument("--widths", type=float, nargs="+", default=[0.5, 1.0], help="backbone widths of section 1")
    p.add_argument("--steps", type=int, default=1, help="timed steps per measurement")
    p.add_argument("--repeats", type=int, default=15, help="section 1, first width: interleaved cycles (median reported)")
    p.add_argument("--repeats-other", type=int, default=7, help="section 1, the other widths: interleaved cycles")
    p.add_argument("--repeats-k", type=int, default=5, help="section 2: interleaved repeats")
    p.add_argument("--queue-sizes", type=int, nargs=2, default=[4096, 65536], help="the two K of section 2")
    p.add_argument("--attribution", choices=["first", "all", "none"], default="first",
                   help="add the shuffle_bn='off' and minimal-MoCo rows to section 1 (first width, all, none)")
    p.add_argument("--logger", choices=["tensorboard", "csv", "none"], default="tensorboard", help="Trainer.fit's logger")
    p.add_argument("--sections", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--profile", action="store_true", help="also print torch.profiler tables of one module step and one bare step")
    args = p.parse_args(argv)
    quiet()
    t0 = time.perf_counter()
    header("MoCo step overhead", args)
    x_q, x_k = views(args.batch_size, args.seed)
    if 1 in args.sections:
        section1(args, x_q, x_k)
    if 2 in args.sections:
        section2(args, x_q, x_k)
    if 3 in args.sections:
        section3(args)
    if 4 in args.sections:
        section4(args)
    if args.profile:
        profile(args, x_q, x_k)
    footer(t0)


if __name__ == "__main__":
    main()
