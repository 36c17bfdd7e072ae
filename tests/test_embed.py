"""``moco-lightning embed``: a row per image of a folder, the features of the encoder on the evaluation transform,
readable with numpy alone, and an index naming each row's file and class."""

import csv

import numpy as np
import pytest
import torch
from helpers.cli import cli_main
from helpers.data import FIXTURE_CKPT
from helpers.files import write_tree

from moco_lightning.datamodules import load_image
from moco_lightning.datamodules.transforms import eval_transform
from moco_lightning.encoder import load_encoder


@pytest.mark.parametrize("labelled", [True, False])
def test_embed_writes_a_row_per_image_equal_to_the_encoders_features(tmp_path, capsys, labelled):
    root = write_tree(tmp_path / "images", n_per_class=3, splits=("train",)) / "train"
    if not labelled:  # images alone, no class folders
        flat = tmp_path / "flat"
        flat.mkdir()
        images = [p for p in sorted(root.rglob("*")) if p.suffix.lower() in (".jpg", ".png") and p.name[0] != "."]
        for i, path in enumerate(images):
            path.rename(flat / f"{i}{path.suffix}")
        root = flat
    assert cli_main("embed", "--ckpt", FIXTURE_CKPT, "--data", str(root), "--out", str(tmp_path / "out"),
                    "--num_workers", "0") == 0  # fmt: skip
    features = np.load(tmp_path / "out" / "features.npy", mmap_mode="r")
    rows = list(csv.DictReader(open(tmp_path / "out" / "index.csv")))
    backbone, dim = load_encoder(FIXTURE_CKPT)
    assert features.dtype == np.float32 and features.shape == (len(rows), dim) and len(rows) == 6
    assert [int(r["row"]) for r in rows] == list(range(len(rows)))
    assert {r["label"] for r in rows} == ({"cat", "dog"} if labelled else {""})
    backbone.eval()
    transform = eval_transform(28, (0.449,), (0.226,))
    for i in (0, len(rows) - 1):
        x = transform(load_image(rows[i]["path"], 1))[None]
        with torch.no_grad():
            expected = backbone(x)[0].numpy()
        np.testing.assert_allclose(features[i], expected, rtol=1e-5, atol=1e-5)
    assert "wrote" in capsys.readouterr().out


def test_embed_of_a_missing_folder_is_one_line(tmp_path, capsys):
    assert cli_main("embed", "--ckpt", FIXTURE_CKPT, "--data", str(tmp_path / "nope"), "--out", str(tmp_path)) == 2
    assert "--data" in capsys.readouterr().err
