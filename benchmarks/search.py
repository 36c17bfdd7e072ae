"""The recipe search on Optuna: a study stored in SQLite, resumed by running the same command again.

    python -m benchmarks.search --study round4 --space fashion_mnist --epochs 2 4 8 --trials 40   # the search
    python -m benchmarks.search --study round4 --space fashion_mnist --epochs 2 4 8 --trials 40   # again: resumes
    python -m benchmarks.search --study demo_r4 --space demo --budget-qe 6 --epochs 2 6 --trials 40  # demo budget
    python -m benchmarks.search --study long_r4 --space long --config fashion_mnist_long --budget-qe 28 \\
        --epochs 8 20 --knn-every 4 --trials 4 --enqueue '{"min_scale": 1.0, ...}'  # 1/2 of the long budget
    python -m benchmarks.search --study smoke --space tiny --epochs 1 2 --trials 3 --train-subset 512 \\
        --holdout 256 --fast --results /tmp/search                                                 # a smoke run

Selection never reads the test split: each trial pretrains a config of ``configs/`` (``--config``, default the
quickstart) with the trial's overrides on the training split minus its held-out end (the datamodule's ``holdout``:
the last 10 000 images), and is judged on that held-out end:

- **rungs** (``--epochs``): a trial trains for the last rung's epochs; after every epoch its kNN top-1 (k 20, the
  ``KNNMonitor`` on the held-out images) goes to Optuna (optuna-integration's Lightning pruning callback), and from
  the first rung on a trial below the median of the earlier trials at that epoch is pruned (``MedianPruner``; the
  first ``--startup-trials`` are never pruned);
- **objective** of a trial that finishes (:func:`objective_value`): ``--objective mean`` (rounds 1-3), the mean of
  ``moco-lightning evaluate``'s kNN top-1 at k 20, the linear top-1 on frozen features with 1 % of the labels and the
  fine-tuned top-1 with 1 % of the labels, on the held-out split (``--fast``: kNN and linear only);
  ``--objective finetune`` (round 4: "how many labels does pretraining save me?"), the 1 %-label fine-tuned top-1,
  with kNN as a guard, not the target: each point of kNN k 20 below ``--knn-floor`` costs a point. A study keeps
  the objective it was created with;
- **cost**: each trial's training seconds, also in quickstart-epoch equivalents (1 QE: one epoch of
  ``configs/quickstart.yaml``, timed at the same precision when the study is created and kept with it: a
  resumed study keeps its unit), with the kNN monitor's seconds apart (``knn_s``: evaluation, not training), stored
  with the trial, as is the pretext task's last ``train/acc1`` (near 1.0: the views no longer teach);
- **budget** (``--budget-qe B``): every trial gets the same training time, B QE, instead of the same epochs: its step
  and the QE config's are timed in turn, ``--timing-rounds`` times (``--timing-steps`` steps each), and it trains for
  ``B x 468 / ratio`` steps (468: the QE config's steps in one epoch), the ratio being the median of the rounds'
  (cosine schedules over those steps): a symmetric loss or a larger stem costs more per step and gets fewer steps
  (why a median of ratios: benchmarks/README.md, "Planning a budget"). Without ``--budget-qe`` a trial trains for
  the last rung's epochs, whatever they cost;
- **precision** (``--precision``, default ``auto``: :func:`moco_lightning.auto_precision`, bf16 where this machine
  runs it natively) for the QE timing and every trial alike.

The study lives in ``<results>/<study>.db`` (``--results``, default ``benchmarks/results``): run the same command
after an interruption and it goes on (``load_if_exists``); a trial left running by a killed process is marked failed
and its parameters are tried again. After the trials: ``<study>.csv`` (every trial), ``<study>.md`` (the
complete trials, best first) and ``<study>.png`` (the objective per trial, pruned ones at their last rung). Report
the chosen recipe once on the test split with ``moco-lightning evaluate``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks._common import (
    QE_CONFIG,
    QE_IMAGES,
    QE_OVERRIDES,
    ROOT,
    config_path,
    footer,
    from_config,
    header,
    parser,
    quiet,
)
from benchmarks.search_report import report, write_results
from benchmarks.search_spaces import SPACES

D, M = "--data.init_args.", "--model."


def overrides_of(params: dict, space: dict) -> list[str]:
    return [f"{space[name][0]}={value}" for name, value in params.items()]


def config_step_seconds(args, config: str, *overrides: str) -> tuple[float, Any]:
    """(seconds per step, datamodule) of a config with overrides on this machine now: ``args.timing_steps`` steps
    timed after 2 warm-up steps, on a throw-away model, at ``args.precision``."""
    from lightning.pytorch import Trainer

    from benchmarks._common import trainer_kwargs
    from benchmarks.timing import seconds_per_step

    model, data = from_config(config_path(config), *args.data_overrides, *overrides)

    def fit(total: int, callbacks: list) -> None:
        Trainer(**trainer_kwargs(total, callbacks, precision=args.precision)).fit(model, datamodule=data)

    return seconds_per_step(fit, 2, args.timing_steps), data


def qe_seconds(args) -> float:
    """Seconds of one quickstart epoch on this machine now: a few steps timed, scaled to the epoch's steps."""
    step_s, data = config_step_seconds(args, QE_CONFIG, *QE_OVERRIDES)
    epoch_steps = QE_IMAGES // data.batch_size
    seconds = step_s * epoch_steps
    print(f"1 QE = {seconds:.1f} s on this machine now ({QE_CONFIG} {' '.join(QE_OVERRIDES)}, {args.precision}: "
          f"{epoch_steps} steps)",
          flush=True)  # fmt: skip
    return seconds


def study_qe(study, args) -> float:
    """The study's QE in seconds, the unit of each trial's reported cost (``qe``; a budget is planned from step ratios,
    :func:`steps_in_budget`), fixed when the study is created (timed then, or ``--qe-seconds``) and reused when it is
    resumed: the same machine timed 1 QE at 34.2, 46.1 and 63.7 s in one afternoon. ``--qe-seconds`` sets it (a
    study moved to another machine)."""
    stored = study.user_attrs.get("qe_s")
    qe = args.qe_seconds or stored or qe_seconds(args)
    if stored is None or args.qe_seconds:
        study.set_user_attr("qe_s", qe)
    else:
        print(f"1 QE = {qe:.1f} s: the study's unit, timed when it was created (--qe-seconds sets another)", flush=True)
    return qe


def step_ratio(args, overrides: list[str]) -> tuple[float, float, int, list[tuple[float, float]]]:
    """(the trial's step / the QE config's step, the trial's seconds per step, the QE config's steps in 1 QE, the
    timings): both timed in turn, ``--timing-rounds`` times (:func:`config_step_seconds`), the medians, and each round's
    (QE step, trial's step)."""
    rounds = []
    for _ in range(args.timing_rounds):
        reference, qe_data = config_step_seconds(args, QE_CONFIG, *QE_OVERRIDES)
        own, _ = config_step_seconds(args, args.config, *overrides)
        rounds.append((reference, own))
    ratio = statistics.median(own / reference for reference, own in rounds)
    return ratio, statistics.median(own for _, own in rounds), QE_IMAGES // qe_data.batch_size, rounds


def steps_in_budget(args, overrides: list[str]) -> tuple[int, float, float]:
    """(steps, cost ratio, seconds per step) of a trial given ``--budget-qe``: as many steps as B QE (B epochs of
    the QE config) at the trial's cost ratio (:func:`step_ratio`)."""
    from benchmarks.timing import steps_in_budget as planned

    ratio, step_s, qe_steps, _ = step_ratio(args, overrides)
    return planned(args.budget_qe, qe_steps, ratio), ratio, step_s


def plan_check(args, space: dict) -> None:
    """``--plan-check R``: how reproducible a trial's budget is on this machine now. Each ``--enqueue``'d setting's
    budget is planned R times; printed: the steps ``--budget-qe`` gives it each time when planned from seconds (the
    QE unit timed once, at the start, and the setting's own step timed once: how studies were planned before the
    ratio) and from the median ratio of ``--timing-rounds`` rounds (:func:`steps_in_budget`), with each plan's
    largest / smallest, from the same timings."""
    qe = None
    for params in args.enqueue:
        plans: dict[str, list[int]] = {"seconds": [], "ratio": []}
        for _ in range(args.plan_check):
            ratio, _, qe_steps, rounds = step_ratio(args, overrides_of(params, space))
            qe = qe or rounds[0][0] * qe_steps  # the unit: timed once, the first time
            plans["seconds"].append(round(args.budget_qe * qe / rounds[0][1]))
            plans["ratio"].append(round(args.budget_qe * qe_steps / ratio))
            print("timed (QE step, setting's step) ms:", [(round(1000 * a), round(1000 * b)) for a, b in rounds])
        for name, steps in plans.items():
            print(f"{params}: planned from {name}: {steps} steps, largest / smallest {max(steps) / min(steps):.3f}")


def timed_knn(**kwargs):
    """A ``KNNMonitor`` that adds up the seconds of its evaluations in ``seconds`` (a trial's time that is not
    training)."""
    from moco_lightning.callbacks import KNNMonitor

    class TimedKNN(KNNMonitor):
        seconds = 0.0

        def evaluate(self, *args, **kw) -> dict[str, float]:
            t = time.perf_counter()
            try:
                return super().evaluate(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t

    return TimedKNN(**kwargs)


def objective_value(scores: dict, objective: str = "mean", knn_floor: float = 0.0) -> float:
    """A trial's objective from its held-out ``scores`` (``knn20``, ``linear_1pct``, ``finetuned_1pct`` when
    measured): ``mean`` of them, or ``finetune``: ``finetuned_1pct`` less the kNN k 20's shortfall below
    ``knn_floor`` (a guard: a recipe may trade a little kNN for labels, not the representation)."""
    if objective == "mean":
        return sum(scores.values()) / len(scores)
    return scores["finetuned_1pct"] - max(0.0, knn_floor - scores["knn20"])


def objective_of(args, space: dict, qe: float) -> Callable[[Any], float]:
    """One trial: pretrain for the last rung's epochs with the pruning callback, then evaluate on the held-out split."""

    def objective(trial) -> float:
        import torch
        from lightning.pytorch import Trainer, seed_everything

        from moco_lightning.downstream.evaluate import evaluate

        params = {name: trial.suggest_categorical(name, values) for name, (_, values) in space.items()}
        length = dict(max_epochs=args.epochs[-1])
        if args.budget_qe:
            steps, ratio, step_s = steps_in_budget(args, overrides_of(params, space))
            length = dict(max_epochs=-1, max_steps=steps)
            trial.set_user_attr("steps", steps)
            trial.set_user_attr("step_ratio", round(ratio, 4))
            trial.set_user_attr("step_ms", round(1000 * step_s, 1))
        seed_everything(args.seed, verbose=False)
        model, data = from_config(config_path(args.config), *args.data_overrides, *overrides_of(params, space))
        knn = timed_knn(k=20, every_n_epochs=args.knn_every)
        prune = epoch_pruning(trial, knn, "val/knn_acc1")
        folder = Path(args.results) / f"{args.study}_trials" / f"{trial.number}"
        trainer = Trainer(
            accelerator="cpu", precision=args.precision, logger=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False,
            callbacks=[knn, prune], **length,
        )  # fmt: skip
        t = time.perf_counter()
        trainer.fit(model, datamodule=data)
        seconds = time.perf_counter() - t
        trial.set_user_attr("train_s", round(seconds, 1))
        trial.set_user_attr("qe", round(seconds / qe, 2))  # the whole fit, the kNN monitor's share in knn_s
        trial.set_user_attr("knn_s", round(knn.seconds, 1))
        trial.set_user_attr("epochs", round(trainer.global_step / max(1, trainer.num_training_batches), 2))
        trial.set_user_attr("train_acc1", float(trainer.callback_metrics.get("train/acc1", torch.tensor(float("nan")))))
        folder.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(folder / "last.ckpt")
        held_out = from_config(
            config_path(args.config), *args.data_overrides, *overrides_of(params, space),
            f"{D}pretrain=false", f"{D}supervised_min_scale=1.0", f"{D}local_views=0",
        )[1]  # fmt: skip
        columns = dict(scratch=False, full_linear=False, fine_tune=not args.fast, pixels=False)
        result = evaluate(str(folder / "last.ckpt"), held_out, fractions=(0.01,), ks=(20,), steps=args.finetune_steps,
                          seed=args.seed, **columns)  # fmt: skip
        scores = [result["rows"]["kNN k 20"]["encoder"], result["fractions"]["0.01"]["linear"]]
        if not args.fast:
            scores.append(result["fractions"]["0.01"]["fine_tuned"])
        named = dict(zip(("knn20", "linear_1pct", "finetuned_1pct"), scores))
        for name, value in named.items():
            trial.set_user_attr(name, round(value, 4))
        (folder / "last.ckpt").unlink()  # the study keeps the figures, not every trial's weights
        return objective_value(named, args.objective, args.knn_floor)

    return objective


def epoch_pruning(trial, knn, monitor: str):
    """optuna-integration's Lightning pruning callback, reporting at the end of each training epoch at which the
    ``KNNMonitor`` ``knn`` (listed before it) has measured (its ``measured_at``: with ``every_n_epochs`` > 1 the other
    epochs would report a stale value): it reports after validation, which a pretraining run with
    ``limit_val_batches=0`` never runs, and which Lightning runs before the epoch's end hooks."""
    from optuna_integration import PyTorchLightningPruningCallback

    class EpochPruning(PyTorchLightningPruningCallback):
        def on_validation_end(self, trainer, pl_module) -> None:
            pass

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            if knn.measured_at.get(monitor) == trainer.global_step:  # the kNN measured at this epoch's end
                super().on_validation_end(trainer, pl_module)

    return EpochPruning(trial, monitor=monitor)


def open_study(args):
    """The study in ``<results>/<study>.db`` (created, or loaded to go on); trials a killed process left running are
    marked failed and their parameters queued again; ``--enqueue``'d settings not yet in the study are queued."""
    import optuna
    from optuna.trial import TrialState

    Path(args.results).mkdir(parents=True, exist_ok=True)
    # from the first rung on (Lightning's epoch index: epochs done - 1), a trial below the median of the earlier
    # trials at the same epoch stops
    pruner = optuna.pruners.MedianPruner(n_startup_trials=args.startup_trials, n_warmup_steps=args.epochs[0] - 1)
    study = optuna.create_study(
        study_name=args.study, storage=f"sqlite:///{Path(args.results) / args.study}.db", load_if_exists=True,
        direction="maximize", pruner=pruner, sampler=optuna.samplers.TPESampler(seed=args.seed),
    )  # fmt: skip
    chosen = {"objective": args.objective, "knn_floor": args.knn_floor}
    kept = {k: study.user_attrs[k] for k in chosen if k in study.user_attrs}
    if kept and kept != chosen:
        raise SystemExit(f"search: study {args.study} was created with {kept}, not {chosen}: its trials' values would "
                         "not compare; give the same --objective / --knn-floor, or a new --study")  # fmt: skip
    for k, v in chosen.items():
        study.set_user_attr(k, v)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        print(f"trial {trial.number} was left running (an interrupted run): marked failed, its parameters queued again")
        study.tell(trial.number, state=TrialState.FAIL)
        study.enqueue_trial(trial.params, skip_if_exists=False)
    for params in args.enqueue:
        study.enqueue_trial(params, skip_if_exists=True)
    return study


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--study", required=True, help="the study's name: <results>/<study>.db")
    p.add_argument("--space", choices=list(SPACES), default="fashion_mnist")
    p.add_argument("--config", default="quickstart", help="the config every trial starts from")
    p.add_argument(
        "--epochs", type=int, nargs="+", default=[2, 4], help="rungs in epochs; the last is a trial's length"
    )
    p.add_argument("--trials", type=int, default=20, help="complete + pruned trials the study should hold")
    p.add_argument("--holdout", type=int, default=10000, help="the held-out end of the training split (selection)")
    p.add_argument("--train-subset", type=int, default=None, help="smoke runs: the first N training images")
    p.add_argument(
        "--finetune-steps", type=int, default=None, help="default: evaluate's max(30 epochs, min(600, 200 epochs))"
    )
    p.add_argument("--timing-steps", type=int, default=24, help="steps of one timing, after 2 warm-up steps")
    p.add_argument(
        "--timing-rounds", type=int, default=3, help="--budget-qe: trial and QE config timed in turn this many times"
    )
    p.add_argument("--knn-every", type=int, default=1, help="the kNN (and the pruner) every this many epochs")
    p.add_argument(
        "--enqueue", type=json.loads, action="append", default=[], metavar="JSON",
        help='settings to try first, e.g. the shipped recipe: \'{"temperature": 0.2, ...}\' (once per study)',
    )  # fmt: skip
    p.add_argument("--startup-trials", type=int, default=4, help="trials that are never pruned (the median's base)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--fast", action="store_true", help="objective of kNN and linear only (no fine-tuning)")
    p.add_argument(
        "--objective",
        choices=("mean", "finetune"),
        default="mean",
        help="mean of kNN, 1 %% linear, 1 %% fine-tuned; or finetune: 1 %% fine-tuned, kNN as a guard",
    )
    p.add_argument("--knn-floor", type=float, default=0.0,
                   help="--objective finetune: each point of kNN k 20 below it costs a point (e.g. 0.85)")  # fmt: skip
    p.add_argument("--budget-qe", type=float, default=None, help="every trial trains for this many QE of time")
    p.add_argument(
        "--qe-seconds", type=float, default=None, help="the study's QE unit in seconds (default: timed once)"
    )
    p.add_argument("--plan-check", type=int, default=0, metavar="R",
                   help="only time the --enqueue'd settings' budgets R times, planned two ways (no trial)")  # fmt: skip
    p.add_argument("--precision", default="auto", help="auto (moco_lightning.auto_precision), 32-true, bf16-mixed")
    args = p.parse_args(argv)
    if args.objective == "finetune" and args.fast:
        p.error("--objective finetune needs the fine-tuned accuracy: drop --fast")
    for name in ("timing_steps", "timing_rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    args.data_overrides = [f"{D}holdout={args.holdout}", f"{D}val_subset={args.holdout}"]
    if args.train_subset:
        args.data_overrides.append(f"{D}train_subset={args.train_subset}")  # of the images left after holdout
    quiet()
    if args.precision == "auto":
        from moco_lightning import auto_precision

        args.precision = auto_precision("cpu")
    t0 = time.perf_counter()
    header(f"Recipe search (Optuna): study {args.study}", args)
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.plan_check:
        if not (args.budget_qe and args.enqueue):
            p.error("--plan-check needs --budget-qe and the settings to plan (--enqueue)")
        plan_check(args, SPACES[args.space])
        return footer(t0)
    study = open_study(args)
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    left = max(0, args.trials - len(finished))
    print(f"{len(finished)} trials already in the study, {left} to run", flush=True)
    if left:
        qe = study_qe(study, args)
        study.optimize(objective_of(args, SPACES[args.space], qe), n_trials=left, catch=(RuntimeError,),
                       callbacks=[report])  # fmt: skip
    write_results(study, args)
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    if done:
        best = study.best_trial
        print(f"best: trial {best.number}, objective {best.value:.4f}, {best.params}, {best.user_attrs}")
    footer(t0)


if __name__ == "__main__":
    main()
