"""Every benchmark script runs end to end at toy sizes, so that none of them can rot unnoticed."""

import os
from pathlib import Path

import pytest
from helpers.cli import run_module_forked

pytestmark = pytest.mark.slow  # benchmark scripts

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str, timeout: int = 300) -> str:
    """``python -m benchmarks.<script>`` from the repository's root, as the README runs them (the module run as
    ``__main__`` in a child forked from this process: the imports done once)."""
    out = run_module_forked(f"benchmarks.{script.removesuffix('.py')}", list(args), cwd=ROOT, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def gpu_check_lines(out: str) -> dict:
    """``{check: its line}`` of a gpu_check run's output."""
    return dict(line.split(": ", 1) for line in out.splitlines()[1:] if ": " in line and not line.startswith(" "))


def test_gpu_check_runs_every_check_on_the_cpu_and_writes_its_summary_as_it_goes(tmp_path):
    """The prepared GPU check, every check at toy sizes in one run (each in a process of its own, forked), ending
    with the summary table, which the summary file holds too: the quick ones (#53: the README's GPU table), DALI's path,
    the multi-GPU path as 2 processes started with spawn (everything pickled into them: module-level classes), gloo."""
    from benchmarks.gpu_check import CHECKS

    summary = tmp_path / "summary.md"
    out = run("gpu_check.py", "--device", "cpu", "--summary", str(summary), timeout=900)
    body, table = out.split("\nsummary (CPU, ")
    lines = gpu_check_lines(body)
    assert set(lines) == set(CHECKS) and not any(v.startswith("FAILED") for v in lines.values()), lines
    assert "queue torch.float32" in lines["fit"] and "ours 0.00e+00" in lines["bf16_logits"]
    assert "DALI decoded on cpu in (c), cpu in (d)" in lines["throughput"]
    assert "recompile limit hit 0x" in lines["compile"]
    assert "2 ranks (spawn, gloo" in lines["ddp"] and "queues identical: True" in lines["ddp"]
    assert "the same accuracy on every rank: True" in lines["ddp"]
    for figure in ("(a) bare encoder", "(b) fit step, split BN 2", "(b) fit step, plain BN", "(d) fit with PIL"):
        assert f"| {figure} |" in table and f"| {figure} |" in summary.read_text()
    rows = [r.split(" | ") for r in table.splitlines() if r.startswith("| ") and not r.startswith("| figure")]
    assert len(rows) >= 14 and not any("fail" in r[-1] for r in rows), table
    verdicts = {r[0].lstrip("| "): r[-1].rstrip(" |") for r in rows}
    assert verdicts["DDP queues identical on every rank"] == "pass"
    assert verdicts["compile: recompilations / limit hits"] == "pass"


def test_gpu_check_quick_is_the_readmes_table_and_a_check_over_its_share_is_killed(monkeypatch):
    """``--quick`` runs the README's GPU table's checks; ``--no-dali`` skips DALI's path, saying so; a check that
    overruns its share is killed with the reason, and the runner goes on (the whole run: above)."""
    import argparse

    from benchmarks import gpu_check, gpu_checks_data, gpu_harness

    ran = []
    monkeypatch.setattr(gpu_check, "run_in_process", lambda args, check, s: ran.append(check) or ("ok", []))
    assert gpu_check.main(["--device", "cpu", "--quick", "--summary", os.devnull]) == 0
    assert ran == list(gpu_check.QUICK) and set(gpu_check.QUICK) < set(gpu_check.CHECKS)
    monkeypatch.setattr(gpu_harness, "NO_DALI", True)
    assert gpu_checks_data.dali_missing() == "--no-dali"
    monkeypatch.undo()
    for size, seconds in (("full", 0.5), ("toy", 0.05)):  # a new interpreter (the GPU's way), a fork (toy sizes)
        args = argparse.Namespace(device="cpu", size=size, no_dali=True)
        line, rows = gpu_check.run_in_process(args, "fit", seconds)  # less than start-up / than building the model
        assert line.startswith("FAILED: did not finish within its share, 0 s: killed") and rows[0].ok is False


def test_quality_compares_configs_and_the_reference(tmp_path):
    out = run(
        "quality.py",
        "--qe",
        "0.015",
        "--systems",
        "fashion_mnist_moco_v2",
        "reference",
        "--eval-subset",
        "400",
        "--probe-epochs",
        "1",
        "--curve-points",
        "1",
        "--curve-bank",
        "200",
        "--curve-queries",
        "100",
        "--ref-workers",
        "0",
        "--timing-warmup",
        "1",
        "--timing-steps",
        "1",
        "--replan-at",  # the re-plan at step 1, which every run reaches however fast or slow the machine is
        "0.001",
        "--threads",
        "1",
        "--out",
        str(tmp_path / "q.png"),
    )
    assert "raw pixels (normalised)" in out and "fashion_mnist_moco_v2" in out and "reference" in out
    qe = float(out.split("1 QE = ")[1].split(" s")[0])  # the budget unit, timed in the same run
    assert qe > 0 and "1 %-label linear %" in out
    assert out.count("re-plan at step 1:") == 2  # both systems re-planned from their own speed
    assert (tmp_path / "q.png").is_file() and "final" in (tmp_path / "q.csv").read_text()


def test_ablations_runs_its_overrides(tmp_path):
    out = run(
        "ablations.py",
        "--steps",
        "2",
        "--eval-subset",
        "400",
        "--probe-epochs",
        "1",
        "--threads",
        "1",
        "--runs",
        "m 0.9",
        "end-to-end (batch)",
        "--out",
        str(tmp_path / "a.png"),
    )
    assert "m 0.9" in out and "end-to-end (batch)" in out and (tmp_path / "a.csv").is_file()


def test_step_overhead_sections():
    out = run("step_overhead.py", "--repeats", "1", "--steps", "1", "--threads", "1")
    assert "MoCo under Trainer.fit" in out and "module step, K=65536" in out and "lightly update_momentum" in out
    assert "MoCo module step, split BN (8)" in out and "MoCo module step, plain BN" in out
    cells = [[c.strip() for c in line.split("|")] for line in out.splitlines() if "|" in line]
    counts = {c[0]: int(c[1]) for c in cells if "BatchNorm2d" in c[0] or c[0].startswith("per-split loop")}
    # the split's operators do not grow with the splits; the loop's did
    assert counts["SplitBatchNorm2d, 2 splits"] == counts["SplitBatchNorm2d, 32 splits"], counts
    assert counts["per-split loop (before #53), 8 splits"] > 2 * counts["SplitBatchNorm2d, 8 splits"], counts


def test_step_overhead_enters_the_precision_context_once_per_step():
    """Each timed step enters its own autocast, as Lightning's precision plugin does: one context held over many
    steps keeps its bf16 copies of weights that the optimizer has since changed (a stale, faster step)."""
    import contextlib
    from types import SimpleNamespace

    import torch
    from torch import nn

    from benchmarks.step_overhead import bare_step

    entered = []

    @contextlib.contextmanager
    def cast():
        entered.append(torch.is_grad_enabled())
        yield

    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    model = SimpleNamespace(backbone=net, projection_head=nn.Linear(4, 8), in_layout=lambda x: x)
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    step = bare_step(model, x, x.flip(0), cast)
    for _ in range(3):
        step()
    assert entered == [True, True, True]


def test_data_throughput_paths():
    out = run(
        "data_throughput.py",
        "--batches",
        "1",
        "--workers",
        "0",
        "--kornia",
        "1",
        "--folder-images",
        "16",
        "--folder-size",
        "32",
        "--folder-batch-size",
        "8",
        "--train-steps",
        "1",
        "--threads",
        "1",
    )
    assert "BatchViews" in out and "kornia" in out and "DALI (CPU pipeline)" in out and "DALI / best PIL" in out
    assert "DALI fused decode-crop" in out
    assert out.count("s/step, waiting") == 4  # PIL workers, PIL + batched colour, DALI, DALI fused


def test_ddp_queue_broadcast_runs_two_processes():
    out = run("ddp_queue_broadcast.py", "--steps", "2", "--queue-size", "1024")
    import re

    rows = dict(re.findall(r"queue (excluded|broadcast) .*?([0-9.]+) ms/step", out))
    assert set(rows) == {"excluded", "broadcast"} and all(float(v) > 0 for v in rows.values()), out
    assert "queue 1024 x 128 fp32" in out and "x1.00" in out  # the excluded queue is the reference


def test_the_search_keeps_its_study_and_goes_on_after_an_interruption(tmp_path):
    """A tiny Optuna study in SQLite: 2 trials, then a run killed with a trial left running (simulated: a trial asked
    and never told), then the same command again: the stale trial is failed and its parameters retried, the study
    reaches 3 finished trials, and the CSV and the plot are written from it."""
    import optuna

    args = ("--study", "tiny", "--space", "tiny", "--epochs", "1", "1", "--train-subset", "160", "--holdout", "64",
            "--fast", "--timing-steps", "1", "--threads", "1", "--results", str(tmp_path))  # fmt: skip
    out = run("search", *args, "--trials", "2", timeout=600)
    assert "0 trials already in the study, 2 to run" in out and "best: trial" in out
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    first = study.trials[0]
    assert 0 <= first.value <= 1 and {"knn20", "linear_1pct", "qe", "train_s"} <= set(first.user_attrs)
    assert list(first.intermediate_values) == [0] and 0 < first.intermediate_values[0] <= 1  # the epoch's kNN k 20
    assert first.value == pytest.approx((first.user_attrs["knn20"] + first.user_attrs["linear_1pct"]) / 2, abs=1e-3)
    qe = study.user_attrs["qe_s"]  # the study's unit, timed once when it was created
    assert f"1 QE = {qe:.1f} s on this machine now" in out
    stale = study.ask({"temperature": optuna.distributions.CategoricalDistribution([0.1, 0.2, 0.5]),
                       "erase_prob": optuna.distributions.CategoricalDistribution([0.0, 0.5])})  # fmt: skip
    out = run("search", *args, "--trials", "3", timeout=600)
    assert f"trial {stale.number} was left running" in out and "2 trials already in the study, 1 to run" in out
    assert f"1 QE = {qe:.1f} s: the study's unit" in out and "on this machine now" not in out  # not timed again
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    states = [t.state.name for t in study.trials]
    assert states == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE"]
    assert study.trials[3].params == stale.params  # the interrupted configuration, tried again
    assert (tmp_path / "tiny.csv").read_text().count("\n") == 1 + 4 and (tmp_path / "tiny.png").stat().st_size > 0
    table = (tmp_path / "tiny.md").read_text().splitlines()  # the 3 complete trials, best first
    objectives = [float(line.split("|")[2]) for line in table[2:5]]
    assert objectives == sorted(objectives, reverse=True) and table[-1] == "3 complete, 0 pruned, 1 failed trials."


def test_the_search_gives_every_trial_the_same_training_time_with_a_budget(tmp_path):
    """``--budget-qe``: each trial's steps come from its step timed against the QE config's (a trial whose step costs
    more gets fewer steps): steps x cost ratio = the budget (0.01 QE of 468 steps), both stored with the trial, and
    the kNN monitor's seconds apart from the training's."""
    import optuna

    out = run("search", "--study", "budget", "--space", "tiny", "--epochs", "1", "2", "--train-subset", "160",
              "--holdout", "64", "--fast", "--timing-steps", "2", "--timing-rounds", "1", "--threads", "1",
              "--results", str(tmp_path), "--trials", "2", "--budget-qe", "0.01", "--precision", "32-true",
              timeout=600)  # fmt: skip
    # the unit of the reported cost: the quickstart with the ImageNet stem of rounds 1-3, whatever the shipped one has
    assert "s on this machine now (quickstart --model.stem=imagenet, 32-true: 468 steps)" in out
    study = optuna.load_study(study_name="budget", storage=f"sqlite:///{tmp_path / 'budget.db'}")
    for t in study.trials:
        a = t.user_attrs
        assert t.state.name == "COMPLETE" and a["steps"] >= 1 and a["step_ms"] > 0 and a["step_ratio"] > 0
        assert abs(a["steps"] * a["step_ratio"] - 0.01 * 468) <= a["step_ratio"] / 2 + 0.01  # the nearest whole step
        assert a["epochs"] == a["steps"]  # 160 images: one batch of 128 per epoch
        assert 0 < a["knn_s"] < a["train_s"]  # a kNN every epoch, inside the fit's time


def test_a_budget_is_planned_from_the_median_ratio_of_interleaved_timings(monkeypatch, capsys):
    """``step_ratio`` times the QE config and the trial in turn and takes the median of the per-round ratios, so one
    slow timing of either moves nothing; ``--plan-check`` prints both plans from the same timings."""
    from benchmarks import search

    timings = iter([0.1, 0.2, 0.3, 0.2, 0.1, 0.25, 0.1, 0.4, 0.1, 0.2, 0.1, 0.2])  # (QE, trial) in turn
    calls = []

    def fake(args, config, *overrides):
        calls.append(config)
        return next(timings), type("Data", (), dict(batch_size=128))()  # the quickstart's batch: 468 steps in 1 QE

    monkeypatch.setattr(search, "config_step_seconds", fake)
    args = type("Args", (), dict(timing_rounds=3, budget_qe=2, config="fashion_mnist_long"))()
    steps, ratio, step_s = search.steps_in_budget(args, [])
    assert calls == ["quickstart", "fashion_mnist_long"] * 3
    assert ratio == 2.0 and step_s == 0.2 and steps == round(2 * 468 / 2.0)  # ratios 2, 0.67, 2.5: the median
    search.main(["--study", "plan", "--space", "tiny", "--config", "fashion_mnist_long", "--budget-qe", "2",
                 "--timing-rounds", "3", "--plan-check", "1", "--enqueue", '{"temperature": 0.2}',
                 "--threads", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert "timed (QE step, setting's step) ms: [(100, 400), (100, 200), (100, 200)]" in out
    # from seconds: 2 QE of 0.1 s x 468 over the first, slow 0.4 s step; from the ratios 4, 2, 2: their median
    assert "planned from seconds: [234] steps" in out and "planned from ratio: [468] steps" in out
    with pytest.raises(SystemExit):
        search.main(["--study", "plan", "--space", "tiny", "--plan-check", "1", "--threads", "1"])  # nothing to plan
    assert "--plan-check needs --budget-qe and the settings to plan (--enqueue)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        search.main(["--study", "plan", "--space", "tiny", "--budget-qe", "2", "--timing-rounds", "0"])  # no timing
    assert "--timing-rounds must be at least 1, got 0" in capsys.readouterr().err


def test_the_search_tries_enqueued_settings_first_and_measures_knn_every_n_epochs(tmp_path):
    """``--enqueue`` (the shipped recipe as the first trial, queued once per study) and ``--knn-every 2`` over 3
    epochs: the kNN, and so the pruner, sees epoch 2 only (no stale value reported at epochs 1 and 3)."""
    import optuna

    shipped = '{"temperature": 0.5, "erase_prob": 0.0}'
    args = ("--study", "queued", "--space", "tiny", "--epochs", "1", "3", "--train-subset", "160", "--holdout", "64",
            "--fast", "--timing-steps", "1", "--threads", "1", "--results", str(tmp_path), "--knn-every", "2",
            "--enqueue", shipped)  # fmt: skip
    run("search", *args, "--trials", "1", timeout=600)
    run("search", *args, "--trials", "1", timeout=600)  # again: nothing left to run, nothing queued twice
    study = optuna.load_study(study_name="queued", storage=f"sqlite:///{tmp_path / 'queued.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE"]
    assert study.trials[0].params == {"temperature": 0.5, "erase_prob": 0.0}
    assert list(study.trials[0].intermediate_values) == [1]  # Lightning's epoch index 1: the second epoch


def test_curve_reads_a_runs_knn_and_probe_against_epochs(tmp_path):
    """A 2-epoch fit logging to TensorBoard: the curve has the kNN at epochs 0 (random init), 1 and 2, the online
    probe at epochs 1 and 2, the values the callbacks logged, the 1 %-label linear of each kept checkpoint, and a
    PNG."""
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    from benchmarks.curve import low_label_curve, read
    from moco_lightning import MoCo
    from moco_lightning.callbacks import KNNMonitor, LinearProbe
    from moco_lightning.datamodules import FashionMNISTDataModule

    torch.manual_seed(0)
    moco = MoCo(backbone="resnet18", width=0.125, in_channels=1, image_size=28, queue_size=64, hidden_dim=16, dim=8)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    keep = ModelCheckpoint(every_n_epochs=1, save_top_k=-1)  # runs/run/version_0/checkpoints/epoch=E-step=S.ckpt
    callbacks = [keep, KNNMonitor(k=5, pixel_baseline=True), LinearProbe()]
    trainer = Trainer(accelerator="cpu", max_epochs=2, logger=logger, enable_progress_bar=False, log_every_n_steps=1,
                      limit_val_batches=1, callbacks=callbacks)  # fmt: skip
    trainer.fit(moco, FashionMNISTDataModule(batch_size=32, train_subset=96, val_subset=32))
    curves = read(logger.log_dir)
    tiny = lambda: FashionMNISTDataModule(pretrain=False, supervised_min_scale=1.0, train_subset=200, val_subset=50)  # noqa: E731
    low = low_label_curve(logger.log_dir, fraction=0.5, datamodule=tiny)
    assert [x for x, _ in low] == [1.0, 2.0] and all(0 <= v <= 1 for _, v in low)
    assert [x for x, _ in curves["val/knn_acc1"]] == [0.0, 1.0, 2.0]
    assert curves["val/knn_acc1"][-1][1] == pytest.approx(float(trainer.callback_metrics["val/knn_acc1"]))
    assert [x for x, _ in curves["val/probe_acc1"]] == [1.0, 2.0]
    assert 0 <= curves["val/knn_acc1_pixels"][0][1] <= 1
    out = run("curve", logger.log_dir, "--out", str(tmp_path / "c.png"))
    assert "kNN top-1 (k 200)" in out and (tmp_path / "c.png").stat().st_size > 0


def test_the_reference_moco_gets_the_stem_of_the_systems_it_is_compared_with():
    """quality.py's lightly-style reference is built with the stem of the first library system (the same
    architecture for every system compared); ``--override``s count."""
    import argparse

    from benchmarks._common import from_config, make_reference
    from benchmarks.quality import System

    args = argparse.Namespace(systems=["quickstart", "reference"], override=[])
    assert System("reference", args, None).stem() == "cifar_stride2"  # configs/quickstart.yaml's
    args.override = ["--model.stem=imagenet"]
    assert System("reference", args, None).stem() == "imagenet"
    hp = from_config(ROOT / "configs" / "fashion_mnist_moco_v2.yaml", "--model.stem=cifar_stride2")[0].hparams
    conv1 = make_reference(hp, 128).backbone.conv1
    assert conv1.kernel_size == (3, 3) and conv1.stride == (2, 2)


def test_methods_measures_quality_memory_and_the_seeds_verdicts(tmp_path):
    out = run(
        "methods.py",
        *("--minutes", "0.02", "--methods", "MoCo", "BYOL", "--negatives", "64", "128"),
        *("--eval-subset", "400", "--probe-epochs", "1", "--curve-points", "1"),
        *("--curve-bank", "200", "--curve-queries", "100", "--timing-warmup", "1", "--timing-steps", "1"),
        *("--threads", "1", "--out", str(tmp_path / "m.png")),
    )
    memory = (tmp_path / "m_memory.csv").read_text().splitlines()
    assert memory[0].startswith("method,batch,negatives") and len(memory) == 1 + 2 * 2
    simclr = [line.split(",") for line in memory[1:] if line.startswith("SimCLR")]
    assert [int(r[2]) for r in simclr] == [64, 128] and all(float(r[5]) > 0 for r in simclr)  # 2N - 2 negatives
    moco = [line.split(",") for line in memory[1:] if line.startswith("MoCo")]
    assert [int(r[2]) for r in moco] == [64, 128] and all(float(r[5]) > 0 for r in moco)  # K = the queue's size
    assert (tmp_path / "m_memory.png").is_file() and (tmp_path / "m.png").is_file()
    assert "BYOL's hardware need is medium" in out and "accuracy is roughly the same" in out


def test_low_label_compares_linear_fine_tuned_scratch_and_pixels(tmp_path):
    import torch
    from lightning.pytorch import Trainer

    from moco_lightning import MoCo
    from moco_lightning.datamodules import FashionMNISTDataModule

    torch.manual_seed(0)
    moco = MoCo(backbone="resnet18", width=0.125, in_channels=1, image_size=28, queue_size=64, hidden_dim=16, dim=8)
    t = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    t.fit(moco, FashionMNISTDataModule(batch_size=32, train_subset=64, val_subset=32))
    t.save_checkpoint(tmp_path / "moco.ckpt")
    out = run(
        "low_label.py",
        *("--ckpt", str(tmp_path / "moco.ckpt"), "--names", "tiny", "--fractions", "0.01", "--steps", "3"),
        *("--train-subset", "8000", "--eval-subset", "300", "--threads", "1"),
    )
    assert "### tiny" in out and "| kNN k 20 |" in out and "| linear, all labels |" in out
    row = next(line for line in out.splitlines() if line.startswith("| 1 % ("))
    cells = [c.strip() for c in row.strip("|").split("|")]
    labelled = int(cells[0].split("(")[1].rstrip(")"))
    assert 70 <= labelled <= 90  # 1 % of each class of the first 8000 training images
    values = [float(c.rstrip(" %")) for c in cells[1:5]]
    assert all(0 <= v <= 100 for v in values) and values[1] > 10  # real accuracies in percent (pixels: > chance)
    assert cells[5] == f"{values[2] - values[3]:+.2f}"


def test_benchmarks_are_a_package_on_the_public_api():
    """No sys.path tricks and no private names of the library (a leading underscore in a module or a name)."""
    import ast
    import re

    for path in (ROOT / "benchmarks").glob("*.py"):
        text = path.read_text()
        assert "sys.path.insert" not in text, path.name
        private = re.findall(r"moco_lightning(?:\.\w+)*\._\w+|from moco_lightning[.\w]* import [^\n]*\b_\w+", text)
        assert not private, (path.name, private)
        # nor a private attribute of the library's objects (dm._splits, model._resume): a benchmark's own objects
        # (self._x) and torch's debugging modules (torch._dynamo, torch._logging) aside
        accessed = [
            ast.unparse(node)
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Attribute)
            and re.fullmatch(r"_[a-z]\w*", node.attr)
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "torch"))
        ]
        assert not accessed, (path.name, accessed)


def test_precision_times_each_stem_under_fp32_and_bf16_and_says_what_auto_picks():
    out = run("precision", "--steps", "1", "--repeats", "1", "--batch", "8", "--stems", "imagenet", "cifar_stride2")
    rows = [line.split("|") for line in out.splitlines() if line.strip().startswith(("imagenet ", "cifar_stride2 "))]
    assert len(rows) == 2 and all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
    assert "moco-lightning: precision auto:" not in out  # that line goes to stderr
    assert all(r[4].strip() in ("32-true", "bf16-mixed") for r in rows)


def test_precision_speed_times_every_combination_against_the_shipped_step():
    """``--speed``: fp32 / bf16 x contiguous / channels-last x eager / compiled, each a ratio to the shipped one (the
    test compiles with the eager backend: the wiring, in seconds; the measurement uses inductor)."""
    out = run("precision", "--speed", "--steps", "1", "--repeats", "1", "--batch", "8", "--compile-backend", "eager")
    rows = [
        [c.strip() for c in line.split("|")]
        for line in out.splitlines()
        if line.strip().startswith(("32-true ", "bf16-mixed "))
    ]
    assert len(rows) == 8 and {tuple(r[:3]) for r in rows} == {
        (p, f, c)
        for p in ("32-true", "bf16-mixed")
        for f in ("contiguous", "channels-last")
        for c in ("eager", "compiled")
    }
    shipped = [r for r in rows if r[5] == "shipped"]
    assert len(shipped) == 1 and shipped[0][1:3] == ["channels-last", "eager"] and shipped[0][4] == "1.00x"
    assert all(float(r[4].rstrip("x")) > 0 for r in rows)


def test_the_round_4_objective_is_the_fine_tuned_accuracy_with_knn_as_a_guard(tmp_path):
    """``--objective finetune``: the 1 %-label fine-tuned top-1, less the kNN's shortfall below ``--knn-floor``
    (a guard, not a target); ``mean`` keeps rounds 1-3's value; a study refuses to go on under another objective."""
    import optuna

    from benchmarks import search

    scores = {"knn20": 0.84, "linear_1pct": 0.70, "finetuned_1pct": 0.83}
    assert search.objective_value(scores) == pytest.approx((0.84 + 0.70 + 0.83) / 3)
    assert search.objective_value(scores, "finetune", knn_floor=0.80) == pytest.approx(0.83)  # above the floor
    assert search.objective_value(scores, "finetune", knn_floor=0.86) == pytest.approx(0.81)  # 2 points below
    assert {"min_scale", "translate", "erase_prob", "local_views", "symmetric", "queue_size", "temperature"} <= set(
        search.SPACES["long_views"]
    )
    optuna.create_study(study_name="r4", storage=f"sqlite:///{tmp_path / 'r4.db'}").set_user_attr("objective", "mean")
    with pytest.raises(SystemExit, match="was created with .*'mean'.*not .*'finetune'"):
        search.main(["--study", "r4", "--space", "long_views", "--objective", "finetune", "--knn-floor", "0.85",
                     "--results", str(tmp_path), "--trials", "0", "--qe-seconds", "1"])  # fmt: skip
    with pytest.raises(SystemExit):  # the fine-tuned accuracy is what --fast leaves out
        search.main(["--study", "r5", "--objective", "finetune", "--fast", "--results", str(tmp_path)])


def test_supervised_baseline_writes_a_plain_state_dict_that_evaluate_reads(tmp_path):
    from moco_lightning.downstream.baseline import read_baseline

    out = run("supervised_baseline.py", "--epochs", "1", "--train-subset", "128", "--test-subset", "256",
              "--out", str(tmp_path / "sup.pt"))  # fmt: skip
    assert "test top-1" in out
    import torch

    state = torch.load(tmp_path / "sup.pt", weights_only=True)
    assert not hasattr(state, "_metadata") and "conv1.weight" in state  # no description: as a downloaded file
    encoder, how = read_baseline(tmp_path / "sup.pt", 1, 28, arch="resnet18,stem=cifar_stride2")
    assert encoder.architecture["width"] == 0.5 and "--baseline_arch" in how


def test_every_mutant_of_the_mutation_check_applies_to_todays_code_once():
    """scripts/mutation_check.py refuses to run a mutant whose original text is gone: a refactoring that moves the
    code it mutates fails here, in every CI run, not at the next release."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation_check"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    counts = {m.name: (ROOT / m.file).read_text().count(m.old) for m in module.MUTANTS}
    assert len(counts) >= 20 and all(n == 1 for n in counts.values()), {k: n for k, n in counts.items() if n != 1}
    assert all((ROOT / t).is_file() for m in module.MUTANTS for t in m.tests)
