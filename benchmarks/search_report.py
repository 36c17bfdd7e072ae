"""What :mod:`benchmarks.search` writes of a study: one line per finished trial, ``<study>.csv``, ``<study>.md``
(best first) and ``<study>.png``."""

from __future__ import annotations

import csv
from pathlib import Path


def report(study, trial) -> None:
    """One line per finished trial: its state, objective, rungs and cost."""
    rungs = ", ".join(f"epoch {e + 1}: {100 * v:.2f}" for e, v in sorted(trial.intermediate_values.items()))
    value = f"{100 * trial.value:.2f} %" if trial.value is not None else "-"
    attrs = {k: v for k, v in trial.user_attrs.items()}
    print(f"trial {trial.number} {trial.state.name}: objective {value}; kNN k 20 by epoch: {rungs}; {attrs}; "
          f"{trial.params}", flush=True)  # fmt: skip


def write_results(study, args) -> None:
    """``<study>.csv`` of every trial and ``<study>.png``: the objective per trial, pruned trials at their last rung."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.trial import TrialState

    out = Path(args.results) / args.study
    names = sorted({k for t in study.trials for k in t.params})
    attrs = sorted({k for t in study.trials for k in t.user_attrs})
    with open(f"{out}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["number", "state", "value", "last_rung_knn20", *names, *attrs])
        for t in study.trials:
            rung = t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else ""
            value = t.value if t.value is not None else ""
            params, user = (t.params.get(k, "") for k in names), (t.user_attrs.get(k, "") for k in attrs)
            writer.writerow([t.number, t.state.name, value, rung, *params, *user])
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    write_markdown(study, done, f"{out}.md")
    fig, ax = plt.subplots(figsize=(7, 4))
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED and t.intermediate_values]
    ax.scatter([t.number for t in done], [100 * t.value for t in done], label="objective (held-out split)")
    ax.scatter([t.number for t in pruned], [100 * t.intermediate_values[max(t.intermediate_values)] for t in pruned],
               marker="x", label="pruned: kNN k 20 at its last rung")  # fmt: skip
    ax.set_xlabel("trial")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # trial numbers, not 0.25 steps
    ax.set_ylabel("top-1 (%)")
    ax.set_title(f"study {args.study}: {len(done)} complete, {len(pruned)} pruned")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{out}.png", dpi=120)
    plt.close(fig)


def qe_cell(attrs: dict) -> str:
    """A trial's QE of wall time, with the kNN monitor's seconds where the study measured them."""
    return str(attrs.get("qe", "-")) + (f" (kNN {attrs['knn_s']} s)" if "knn_s" in attrs else "")


def write_markdown(study, done: list, path: str) -> None:
    """``<study>.md``: the complete trials best first (objective and its parts, cost with the kNN monitor's share,
    pretext accuracy, the settings that differ between trials), then the number of pruned and failed ones."""
    names = [k for k in sorted({k for t in done for k in t.params}) if len({t.params.get(k) for t in done}) > 1]
    parts = [("knn20", "kNN k 20"), ("linear_1pct", "1 % linear"), ("finetuned_1pct", "1 % fine-tuned")]
    head = ["trial", "objective", *(label for _, label in parts), "QE", "epochs", "pretext acc1", *names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in sorted(done, key=lambda t: -t.value):
        a = t.user_attrs
        cells = [str(t.number), f"{100 * t.value:.2f}", *(f"{100 * a[k]:.2f}" if k in a else "-" for k, _ in parts),
                 qe_cell(a), str(a.get("epochs", "-")), f"{a.get('train_acc1', float('nan')):.2f}",
                 *(str(t.params.get(k, "-")) for k in names)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    states = [t.state.name for t in study.trials]
    lines.append(f"\n{len(done)} complete, {states.count('PRUNED')} pruned, {states.count('FAIL')} failed trials.")
    Path(path).write_text("\n".join(lines) + "\n")
