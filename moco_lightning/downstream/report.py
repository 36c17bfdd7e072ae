"""The report of :func:`moco_lightning.downstream.evaluate.evaluate`'s figures: its Markdown tables, a name for a
checkpoint's results and the label-efficiency plot (what ``moco-lightning evaluate`` writes)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def markdown(result: dict) -> str:
    """The two tables: kNN and full-label linear (encoder beside raw pixels); the label fractions."""
    pct = lambda v: "-" if v is None else f"{100 * v:.2f} %"  # noqa: E731
    others = list(result.get("baselines") or {})
    lines = [
        f"Encoder `{result['ckpt']}`: {result['train_images']} training images, {result['eval_images']} evaluated.",
        "",
        "| | encoder | raw pixels |" + "".join(f" {name} |" for name in others),
        "|---|---|---|" + "---|" * len(others),
        *(
            f"| {name} | {pct(v['encoder'])} | {pct(v.get('pixels'))} |"
            + "".join(f" {pct(v.get(o))} |" for o in others)
            for name, v in result["rows"].items()
        ),  # fmt: skip
    ]
    if result["fractions"]:
        extra = "".join(f" linear, {o} | fine-tuned, {o} |" for o in others)
        lines += [
            "",
            "| labels | linear, frozen | linear, raw pixels | fine-tuned | from scratch | fine-tuned − scratch |"
            + extra,
            "|---|---|---|---|---|---|" + "---|---|" * len(others),
        ]
        for key, r in result["fractions"].items():
            gap = r.get("fine_tuned_minus_scratch")
            gap = "-" if gap is None else f"{100 * gap:+.2f}"
            budget = f"{key.split('/')[0]} per class" if "/" in key else f"{100 * float(key):g} %"
            if "/" not in key and abs(r.get("share", float(key)) - float(key)) > 0.1 * float(key):  # few images
                budget += f" asked, {100 * r['share']:.3g} % given"
            lines.append(
                f"| {budget} ({r['labels']}) | {pct(r['linear'])} | {pct(r.get('linear_pixels'))} | "
                f"{pct(r.get('fine_tuned'))} | {pct(r.get('from_scratch'))} | {gap} |"
                + "".join(f" {pct(r.get(f'linear {o}'))} | {pct(r.get(f'fine_tuned {o}'))} |" for o in others)
            )
    for name, about in (result.get("baselines") or {}).items():
        arch = ", ".join(f"{k} {v}" for k, v in about["architecture"].items() if k != "image_size")
        lines += ["", f"{name}: `{about['source']}`: {arch}; {about['preprocessing']}."]
    match = result.get("labels_to_match")
    if match:
        said = (f"{match['labels']} labels ({match['times']:.1f}x)" if match["labels"] is not None
                else f"more than the {match['beyond']} labels measured")  # fmt: skip
        lines += ["", f"From scratch needs {said} to reach the fine-tuned encoder's {pct(match['fine_tuned'])} "
                      f"with {match['fine_tuned_labels']} labels."]  # fmt: skip
    return "\n".join(lines)


def run_name(ckpt: str) -> str:
    """A name for a checkpoint's results: its path without ``runs/``, ``checkpoints/`` and the suffix
    (``runs/quickstart/version_0/checkpoints/last.ckpt`` -> ``quickstart_version_0_last``)."""
    parts = [p for p in Path(ckpt).with_suffix("").parts if p not in ("runs", "checkpoints", "/", ".", "..")]
    return "_".join(parts[-4:])


def plot(result: dict, path: Path) -> Optional[Path]:
    """The label-efficiency curve: top-1 against the number of labels (log scale), one line per column, the raw pixels
    dashed; the full-label linear at the whole training split; and the labels from scratch needs to match the
    fine-tuned encoder at the fewest labels (``labels_to_match``), drawn as an arrow. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows, n_train = result["fractions"].values(), result["train_images"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = (("fine_tuned", "fine-tuned", "o-"), ("from_scratch", "from scratch", "s-"),
             ("linear", "linear, frozen", "^-"), ("linear_pixels", "linear, raw pixels", "v--"))  # fmt: skip
    for key, label, style in lines:
        if any(key not in r for r in rows):
            continue
        points = sorted((r["labels"], 100 * r[key]) for r in rows)
        if key.startswith("linear") and "linear, all labels" in result["rows"] and points[-1][0] < n_train:
            points.append(
                (n_train, 100 * result["rows"]["linear, all labels"]["encoder" if key == "linear" else "pixels"])
            )
        ax.plot(*zip(*points), style, label=label, ms=5)
    match = result.get("labels_to_match")
    if match and match["labels"] is not None:
        y = 100 * match["fine_tuned"]
        ax.annotate("", xy=(match["labels"], y), xytext=(match["fine_tuned_labels"], y),
                    arrowprops=dict(arrowstyle="->", color="gray", linestyle=":"))  # fmt: skip
        ax.text(match["labels"], y, f"  from scratch: {match['labels']} labels ({match['times']:.1f}x)",
                va="bottom", fontsize=8, color="dimgray")  # fmt: skip
    ticks = sorted({r["labels"] for r in rows} | {n_train})
    ax.set_xscale("log")
    ax.set_xticks(ticks, [f"{n}\n{100 * n / n_train:.3g} %" for n in ticks], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("labelled training images (and share of the training split)")
    ax.set_ylabel(f"top-1, {result.get('split', 'evaluation')} split (%)")
    ax.set_title(run_name(result["ckpt"]))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
