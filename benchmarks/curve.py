"""A run's learning curve from its TensorBoard events: kNN, the online linear probe and the pretext accuracy
against epochs, as a table and a PNG.

    python -m benchmarks.curve runs/quickstart/version_0 --out benchmarks/results/quickstart_curve.png
    python -m benchmarks.curve runs/fashion_mnist_long/version_0 --checkpoints     # + the 1 %-label linear curve

Reads the scalars the shipped configs log (``val/knn_acc1`` of the ``KNNMonitor``, ``val/probe_acc1`` of the
``LinearProbe``, the pretext ``train/acc1``, and the raw pixels' ``val/knn_acc1_pixels`` as a level line); the
x-axis is the training epoch at which each value was logged (Lightning logs ``epoch`` beside every metric; the
``KNNMonitor``'s value at step 0 is the random-init encoder, epoch 0). Several runs in a row (a run resumed with
``--ckpt_path last`` logs into the same folder) are read in step order; the pretext accuracy, logged every few
steps, is averaged per epoch.

``--checkpoints``: also the **1 %-label linear** top-1 (``moco-lightning evaluate``'s column: a linear classifier on
the frozen features of 1 % of each class) of every ``epoch=*.ckpt`` the run kept (``ModelCheckpoint(every_n_epochs=N,
save_top_k=-1)``, as ``configs/fashion_mnist_long.yaml``), on the datamodule ``evaluate`` uses by default.
"""

from __future__ import annotations

import bisect
from pathlib import Path

from benchmarks._common import parser, print_table

CURVES = {
    "val/knn_acc1": "kNN top-1 (k 200)",
    "val/probe_acc1": "online linear probe",
    "train/acc1": "pretext top-1 (InfoNCE, epoch mean)",
    "low_label": "1 %-label linear (frozen)",
}
LEVEL = "val/knn_acc1_pixels"


def read(run: str | Path) -> dict[str, list[tuple[float, float]]]:
    """{tag: [(epoch, value), ...]} of the curves (and the pixel level) found in the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    if "val/knn_acc1" not in tags:
        raise SystemExit(f"{run}: no val/knn_acc1 scalar here: give a run folder of a fit with a KNNMonitor")
    epochs = sorted((e.step, e.value) for e in events.Scalars("epoch")) if "epoch" in tags else []
    steps = [s for s, _ in epochs]

    def epoch_at(step: int) -> float:
        """The epoch logged at this step (the last one logged at or before it; 0 before any)."""
        i = bisect.bisect_right(steps, step) - 1
        return float(epochs[i][1]) if i >= 0 and step > 0 else 0.0

    out = {}
    for tag in [*CURVES, LEVEL]:
        if tag in tags:
            # an epoch-end value is logged at the epoch's last step: it belongs to the end of that epoch
            out[tag] = [(epoch_at(e.step) + (1.0 if e.step > 0 else 0.0), e.value) for e in events.Scalars(tag)]
    if "train/acc1" in out:  # logged every few steps: the mean of each epoch, at the epoch's end
        by_epoch: dict[float, list[float]] = {}
        for x, v in out["train/acc1"]:
            by_epoch.setdefault(x, []).append(v)
        out["train/acc1"] = [(x, sum(v) / len(v)) for x, v in sorted(by_epoch.items())]
    return out


def low_label_curve(run: str | Path, fraction: float = 0.01, datamodule=None) -> list[tuple[float, float]]:
    """[(epoch, 1 %-label linear top-1), ...] of the run's ``checkpoints/epoch=E-step=S.ckpt`` files (epoch E + 1
    done), with ``moco-lightning evaluate``'s linear column only; ``datamodule``: a function returning the
    datamodule to evaluate on (default ``evaluate``'s own, Fashion-MNIST)."""
    import re

    from moco_lightning.downstream.evaluate import evaluate

    found = []
    for path in Path(run, "checkpoints").glob("epoch=*.ckpt"):
        match = re.match(r"epoch=(\d+)-step=\d+", path.stem)
        if match:
            found.append((int(match[1]) + 1, path))
    if not found:
        raise SystemExit(f"{run}/checkpoints: no epoch=*.ckpt files: keep some with ModelCheckpoint(save_top_k=-1)")
    out = []
    for epoch, path in sorted(found):
        dm = datamodule() if datamodule is not None else None
        result = evaluate(str(path), dm, fractions=(fraction,), ks=(200,), full_linear=False, fine_tune=False,
                          scratch=False, pixels=False, progress=lambda line: None)  # fmt: skip
        out.append((float(epoch), result["fractions"][f"{fraction:g}"]["linear"]))
    return out


def plot(curves: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for tag, label in CURVES.items():
        if tag in curves:
            x, y = zip(*curves[tag])
            ax.plot(x, [100 * v for v in y], marker="o" if len(x) < 60 else None, label=label)
    if LEVEL in curves:
        ax.axhline(100 * curves[LEVEL][0][1], color="grey", linestyle="--", label="raw pixels, kNN (k 200)")
    ax.set_xlabel("epoch")
    ax.set_ylabel("top-1 (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("run", help="a run folder with TensorBoard event files (runs/<name>/version_<n>)")
    p.add_argument("--out", default=None, help="the PNG (default: <run>/curve.png)")
    p.add_argument("--checkpoints", action="store_true", help="also the 1 %%-label linear of each epoch checkpoint")
    args = p.parse_args(argv)
    curves = read(args.run)
    if args.checkpoints:
        curves["low_label"] = low_label_curve(args.run)
    rows = []
    for tag, label in CURVES.items():
        if tag in curves:
            rows += [[label, f"{x:.2f}", f"{100 * v:.2f}"] for x, v in curves[tag]]
    if LEVEL in curves:
        rows.append(["raw pixels, kNN (k 200)", "-", f"{100 * curves[LEVEL][0][1]:.2f}"])
    print_table(rows, ["curve", "epoch", "top-1 %"])
    out = Path(args.out) if args.out else Path(args.run) / "curve.png"
    plot(curves, out, f"learning curve: {Path(args.run).parent.name}/{Path(args.run).name}")
    print(f"curve: {out}")


if __name__ == "__main__":
    main()
