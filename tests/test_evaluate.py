"""``moco-lightning evaluate``: kNN (k 20, 200) and linear beside the raw pixels, and per label fraction linear,
fine-tuned and from scratch; a Markdown table, its figures and a plot; the validation split is the held-out end of
the training split, never the test split."""

import json
import shutil

import pytest
from helpers.data import FIXTURE_CKPT

from moco_lightning.cli import main


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_evaluate_prints_the_table_and_writes_its_files(tmp_path, capsys):
    main(["evaluate", "--ckpt", FIXTURE_CKPT, "--fast", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert "| kNN k 20 |" in out and "| kNN k 200 |" in out and "| linear, all labels |" in out
    assert "| 5 % (" in out and "fine-tuned − scratch" in out
    assert "evaluate: 0.05 of the labels" in err  # progress on stderr
    result = json.loads((tmp_path / "evaluate.json").read_text())
    assert result["train_images"] == 2000 and result["eval_images"] == 500 and result["split"] == "test"
    values = [v for row in result["rows"].values() for v in row.values()]
    fraction = result["fractions"]["0.05"]
    values += [fraction[k] for k in ("linear", "linear_pixels", "fine_tuned", "from_scratch")]
    assert all(0.0 <= v <= 1.0 for v in values) and result["rows"]["kNN k 20"]["pixels"] > 0.5  # pixels are strong
    assert 95 <= fraction["labels"] <= 105 and (tmp_path / "evaluate.md").read_text().strip() == out.strip()
    assert (tmp_path / "evaluate.png").stat().st_size > 0


def test_the_validation_split_is_the_held_out_end_of_the_training_split(tmp_path):
    from moco_lightning.cli.evaluate import datamodule_of

    test, val = datamodule_of(None, "test", fast=True), datamodule_of(None, "val", fast=True)
    for dm in (test, val):
        dm.setup("fit")
    assert val.holdout == 500 and test.holdout is None
    val_images, test_images = val.eval_val_dataloader().dataset, test.eval_val_dataloader().dataset
    train_images = test.eval_train_dataloader().dataset
    # the val split's images come from the training split (its end), not from the test split
    full = type(val)(pretrain=False)
    full_train, _ = full.load_split("train")
    assert (val_images.images[0] == full_train[-500]).all() and not (
        val_images.images[0] == test_images.images[0]
    ).all()
    assert len(train_images) == 2000


def test_a_bad_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / "x.ckpt").write_text("nope")
    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", "--ckpt", str(tmp_path / "x.ckpt"), "--fast"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(f"moco-lightning evaluate: error: --ckpt {tmp_path / 'x.ckpt'}")


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_fast_keeps_the_fractions_and_steps_it_is_given(tmp_path, capsys, monkeypatch):
    """--fast shrinks the data; --fractions and --steps given beside it are honoured, not dropped; bad ones are one
    line. The checkpoint is read once for the features and the four classifiers (two budgets, fine-tuned and from
    scratch)."""
    import torch

    reads, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: reads.append(str(f)) or load(f, *a, **k))
    main(["evaluate", "--ckpt", FIXTURE_CKPT, "--fast", "--fractions", "0.02", "0.1", "--steps", "3", "--out",
          str(tmp_path)])  # fmt: skip
    assert reads.count(str(FIXTURE_CKPT)) == 1, reads
    result = json.loads((tmp_path / "evaluate.json").read_text())
    assert list(result["fractions"]) == ["0.02", "0.1"] and result["train_images"] == 2000
    assert [r["steps"] for r in result["fractions"].values()] == [3, 3]
    assert "0.1 of the labels (201): fine tuned, 3 steps" in capsys.readouterr().err  # 10 % of each class, rounded
    for bad, said in ((["--steps", "0"], "--steps 0: give at least 1"), (["--fractions", "1.5"], "each must be in")):
        with pytest.raises(SystemExit) as exit_:
            main(["evaluate", "--ckpt", FIXTURE_CKPT, "--fast", *bad])
        assert exit_.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_an_image_folder_is_evaluated_with_fraction_and_per_class_budgets(tmp_path, capsys):
    """A user's labelled folder (JPEG and PNG, RGB, read as grayscale for the 1-channel fixture encoder): kNN, linear,
    and fine-tuned / from scratch at 50 % of the labels and at 2 images per class (the batch adapts: 4 images);
    --data_dir is the shorthand of a folder with train/ and val/, --config takes any datamodule's class path."""
    import yaml
    from helpers.files import write_tree

    write_tree(tmp_path / "photos", n_per_class=6, classes=("cat", "dog", "fox"))
    args = ["--fractions", "0.5", "--per_class", "2", "--steps", "2", "--k", "3"]
    config = {"data": {"class_path": "moco_lightning.datamodules.ImageFolderDataModule",
                       "init_args": {"data_dir": str(tmp_path / "photos"), "image_size": 28, "in_channels": 1,
                                     "batch_size": 4, "num_workers": 0}}}  # fmt: skip
    (tmp_path / "folder.yaml").write_text(yaml.safe_dump(config))
    main(["evaluate", "--ckpt", FIXTURE_CKPT, "--config", str(tmp_path / "folder.yaml"), *args, "--out",
          str(tmp_path / "out")])  # fmt: skip
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "out" / "evaluate.json").read_text())
    assert result["classes"] == 3 and result["train_images"] == 18 and result["eval_images"] == 18
    assert set(result["fractions"]) == {"0.5", "2/class"} and "| 2 per class (6) |" in out and "| 50 % (9) |" in out
    two = result["fractions"]["2/class"]
    assert two["labels"] == 6 and two["batch"] == 6 and two["steps"] == 2 and two["share"] == pytest.approx(6 / 18)
    assert all(0.0 <= two[k] <= 1.0 for k in ("linear", "fine_tuned", "from_scratch"))
    # --split val: 20 % of train/, each class alike (1 of 6), is the evaluation split; val/ is left for the test
    quick = ["--fractions", "--k", "3", "--data_dir", str(tmp_path / "photos"), "--out", str(tmp_path / "v")]
    main(["evaluate", "--ckpt", FIXTURE_CKPT, "--split", "val", *quick])
    held = json.loads((tmp_path / "v" / "evaluate.json").read_text())
    assert (held["train_images"], held["eval_images"], held["split"]) == (15, 3, "val")
    shutil.rmtree(tmp_path / "photos" / "val")  # a folder without val/: the same held-out split, said
    capsys.readouterr()
    main(["evaluate", "--ckpt", FIXTURE_CKPT, *quick])
    assert "has no val/ folder: 20% of train/ (each class alike) is held out" in capsys.readouterr().err
    assert json.loads((tmp_path / "v" / "evaluate.json").read_text())["eval_images"] == 3


def test_the_fine_tuning_steps_adapt_to_few_labels():
    """30 epochs at least, 600 steps at most unless 30 epochs need more, 200 epochs for a handful of images: the
    Fashion-MNIST budgets keep their steps (600 at 1 %, 2812 at 10 %)."""
    from moco_lightning.downstream.evaluate import finetune_steps

    assert [finetune_steps(n) for n in (600, 6000, 100, 30, 3)] == [600, 2812, 312, 200, 200]
    assert finetune_steps(60_000) == 3000  # all of Fashion-MNIST's labels: 3.2 epochs, not 30 (28125 steps)


def test_curve_measures_the_six_fractions_and_draws_them(tmp_path, monkeypatch, capsys):
    """``--curve`` is the six fractions of the label-efficiency curve; it and ``--fractions`` together: refused."""
    import moco_lightning.cli.evaluate as cli
    from moco_lightning.downstream.evaluate import CURVE

    seen = {}

    def fake(ckpt, dm, fractions, *args, **kwargs):
        seen["fractions"] = fractions
        rows = {f"{f:g}": dict(labels=round(f * 2000), share=f, linear=0.5 + f / 4, fine_tuned=0.7 + f / 5,
                               from_scratch=0.6 + f / 4) for f in fractions}  # fmt: skip
        return {"ckpt": ckpt.source, "train_images": 2000, "eval_images": 500, "classes": 10, "seconds": 1.0,
                "rows": {"linear, all labels": {"encoder": 0.75}}, "fractions": rows,
                "labels_to_match": measure.labels_to_match(rows)}  # fmt: skip

    from moco_lightning.downstream import evaluate as measure

    monkeypatch.setattr(cli, "evaluate", fake)
    main(["evaluate", "--ckpt", FIXTURE_CKPT, "--fast", "--curve", "--out", str(tmp_path)])
    assert seen["fractions"] == list(CURVE) == [0.005, 0.01, 0.02, 0.05, 0.1, 1.0]
    out = capsys.readouterr().out
    assert "| 0.5 % (10) |" in out and "| 100 % (2000) |" in out and "From scratch needs" in out
    assert (tmp_path / "evaluate.png").stat().st_size > 10_000
    with pytest.raises(SystemExit) as e:
        main(["evaluate", "--ckpt", FIXTURE_CKPT, "--curve", "--fractions", "0.1"])
    assert e.value.code == 2 and "--curve is --fractions 0.005 0.01 0.02 0.05 0.1 1" in capsys.readouterr().err


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_all_the_labels_reuse_the_full_label_linear():
    """Fraction 1 is the whole training split: its frozen linear is the full-label linear, not trained twice."""
    from moco_lightning.cli.evaluate import datamodule_of
    from moco_lightning.downstream.evaluate import evaluate

    result = evaluate(FIXTURE_CKPT, datamodule_of(None, "test", True), (0.05, 1.0), (20,), fine_tune=False,
                      scratch=False, progress=lambda line: None)  # fmt: skip
    every, five = result["fractions"]["1"], result["fractions"]["0.05"]
    assert every["labels"] == result["train_images"] == 2000 and 95 <= five["labels"] <= 105
    assert every["linear"] == result["rows"]["linear, all labels"]["encoder"] != five["linear"]
    assert every["linear_pixels"] == result["rows"]["linear, all labels"]["pixels"]


def test_labels_to_match_reads_the_from_scratch_curve_where_it_reaches_the_fine_tuned_encoder():
    """Fine-tuned 0.80 with 60 labels; from scratch 0.70 at 60, 0.76 at 120, 0.84 at 600: it reaches 0.80 half-way
    (in log labels) between 120 and 600, at 120 * 5 ** 0.5 = 268 labels, 4.5x; never reached: None, said so."""
    from moco_lightning.downstream.evaluate import labels_to_match
    from moco_lightning.downstream.report import markdown

    rows = {"0.01": dict(labels=60, fine_tuned=0.80, from_scratch=0.70),
            "0.02": dict(labels=120, fine_tuned=0.85, from_scratch=0.76),
            "0.1": dict(labels=600, fine_tuned=0.90, from_scratch=0.84)}  # fmt: skip
    match = labels_to_match(rows)
    assert match["labels"] == 268 and match["times"] == pytest.approx(268 / 60) and match["fine_tuned_labels"] == 60
    result = {"ckpt": "x.ckpt", "train_images": 6000, "eval_images": 100, "rows": {}, "labels_to_match": match,
              "fractions": {k: dict(r, linear=0.5) for k, r in rows.items()}}  # fmt: skip
    assert "From scratch needs 268 labels (4.5x) to reach the fine-tuned encoder's 80.00 % with 60 labels" in markdown(
        result
    )
    rows["0.1"]["from_scratch"] = 0.79
    assert labels_to_match(rows)["labels"] is None and labels_to_match(rows)["beyond"] == 600
    assert labels_to_match({"0.01": rows["0.01"]}) is None  # one budget: no curve
