"""fp32 against bf16 autocast per stem, on this machine: what ``trainer.precision: auto`` chooses, and why.

    python -m benchmarks.precision                        # step time per stem and precision (a few minutes)
    python -m benchmarks.precision --qe 1 --split val      # and the quality of each at the same training wall time
    python -m benchmarks.precision --speed                # the shipped stem: precision x memory format x compile

The quickstart's model (``configs/quickstart.yaml``: ResNet-18 x0.5 on 28-px images, batch 128) with each stem
(``imagenet``: 7x7 maps, ``cifar_stride2``: 14x14, ``cifar``: 28x28): one training step (forward, loss, backward,
SGD step; no data loading) timed under fp32 and under bf16 autocast, interleaved (A, B, then B, A; the median of
``--repeats``), and the ratio. ``auto`` picks bf16-mixed only where bf16 is native (a CUDA GPU with bf16, a CPU with
AMX), and the table says what it picked here. ``--qe Q``: each stem and precision also trains for Q quickstart-epoch
equivalents of wall time (``quality.py``'s procedure: the steps that time affords at the measured speed) and is
evaluated (kNN, linear, 1 %-label linear) on ``--split``. ``--speed``: the same step of the shipped stem
(``cifar_stride2``) in every combination of fp32 / bf16 autocast, contiguous / channels-last and eager /
``torch.compile`` (the model's ``compile: true``: its encoders and heads, compiled in place; compilation is the
warm-up, untimed), each against the shipped setting (``precision: auto``'s pick, channels-last, eager).
"""

from __future__ import annotations

import time

import torch

from benchmarks._common import config_path, footer, forward_context, from_config, header, parser, print_table, quiet
from benchmarks.timing import interleaved, paired_ratio, spread

STEMS = ("imagenet", "cifar_stride2", "cifar")
PRECISIONS = ("32-true", "bf16-mixed")


def step_timer(stem: str, precision: str, batch: int, steps: int, channels_last: bool = True, compiled: str = ""):
    """A callable timing ``steps`` training steps of the quickstart model with ``stem`` (warm-up steps first: one,
    three when ``compiled``, the name of a torch.compile backend)."""
    model, _ = from_config(config_path("quickstart"), f"--model.stem={stem}")
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model.train().to(memory_format=layout)
    if compiled:
        for module in model.compiled_modules():
            module.compile(backend=compiled)
    opt = torch.optim.SGD([p for m in model.trained_modules() for p in m.parameters()], lr=0.01, momentum=0.9)
    views = [torch.randn(batch, 1, 28, 28).contiguous(memory_format=layout) for _ in range(2)]
    cast = forward_context(precision)

    def step() -> None:
        with cast():
            out = model.views_loss(views)
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3 if compiled else 1):
        step()

    def measure() -> float:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t) / steps

    return measure


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stems", nargs="+", choices=STEMS, default=list(STEMS))
    p.add_argument("--qe", type=float, default=None, help="also train each for this many QE and evaluate it")
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--speed", action="store_true", help="precision x channels-last x compile, the shipped stem")
    p.add_argument("--compile-backend", default="inductor", help="--speed: torch.compile's backend (the tests: eager)")
    args = p.parse_args(argv)
    quiet()
    t0 = time.perf_counter()
    if args.speed:
        return speed(args, t0)
    header("fp32 vs bf16 autocast per stem", args)
    from moco_lightning.training.precision import auto_precision

    auto = auto_precision("cpu")
    rows = []
    for stem in args.stems:
        cases = {prec: step_timer(stem, prec, args.batch, args.steps) for prec in PRECISIONS}
        times = interleaved(cases, args.repeats)
        fp32, bf16 = (sorted(times[p])[len(times[p]) // 2] for p in PRECISIONS)
        rows.append([stem, f"{1e3 * fp32:.0f}", f"{1e3 * bf16:.0f}", f"{fp32 / bf16:.2f}x", auto,
                     "faster" if (auto == "bf16-mixed") == (bf16 < fp32) else "slower"])  # fmt: skip
        print(f"  {stem}: fp32 {1e3 * fp32:.0f} ms/step, bf16 autocast {1e3 * bf16:.0f} ms/step", flush=True)
    print()
    print_table(rows, ["stem", "fp32 ms/step", "bf16 ms/step", "bf16 speed-up", "auto picks", "auto's choice is"])
    if args.qe:
        from benchmarks.quality import Splits, System, quickstart_epoch_seconds, run_system

        args.override, args.curve_points, args.probe_epochs, args.replan_at = [], 1, 20, 0.1
        args.timing_warmup, args.timing_steps = 3, 8
        splits = Splits(args.split, None, 10000, 2000)
        budget = args.qe * quickstart_epoch_seconds(args, splits)
        quality = []
        for stem in args.stems:
            for prec in PRECISIONS:
                args.precision = prec
                system = System(f"{stem}/{prec}", args, splits, "quickstart", (f"--model.stem={stem}",))
                r = run_system(system, budget, 1)
                quality.append([stem, prec, str(r["steps"]), f"{100 * r['knn_top1']:.2f}",
                                f"{100 * r['probe_top1']:.2f}", f"{100 * r['low_label_top1']:.2f}"])  # fmt: skip
        print_table(quality, ["stem", "precision", f"steps in {args.qe:g} QE", "kNN %", "linear %", "1 %-label %"])
    footer(t0)


def speed(args, t0: float) -> None:
    """Every combination of precision, memory format and compile for ``cifar_stride2``, interleaved, each against the
    shipped setting: the ratio of the shipped step's time to its own (above 1: faster than shipped)."""
    from moco_lightning.training.precision import auto_precision

    header("step time: precision x memory format x torch.compile (cifar_stride2)", args)
    shipped = (auto_precision("cpu"), True, False)
    combos = [(p, cl, c) for p in PRECISIONS for cl in (False, True) for c in (False, True)]
    name = lambda p, cl, c: f"{p}, {'channels-last' if cl else 'contiguous'}, {'compiled' if c else 'eager'}"  # noqa: E731
    cases = {}
    for combo in combos:
        t = time.perf_counter()
        backend = args.compile_backend if combo[2] else ""
        cases[name(*combo)] = step_timer("cifar_stride2", combo[0], args.batch, args.steps, combo[1], backend)
        print(f"  {name(*combo)}: built and warmed up in {time.perf_counter() - t:.0f} s", flush=True)
    times = interleaved(cases, args.repeats)
    base = times[name(*shipped)]
    rows = []
    for combo in combos:
        v = times[name(*combo)]
        ratio = paired_ratio(base, v)
        rows.append([*name(*combo).split(", "), spread(v), f"{ratio:.2f}x", "shipped" if combo == shipped else ""])
    print()
    print_table(rows, ["precision", "memory format", "compile", "ms/step median [min-max]", "vs shipped", ""])
    footer(t0)


if __name__ == "__main__":
    main()
