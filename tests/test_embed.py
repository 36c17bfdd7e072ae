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
from moco_lightning.downstream.encoder import load_encoder


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


def test_embed_shows_neighbours_and_writes_the_projector(tmp_path, capsys):
    """--neighbours 3: a picture of up to 8 query rows by 1 + 3 thumbnails, in which an image's nearest neighbour is
    its own copy (cosine 1); --projector: TensorBoard's projector files, a metadata row and a sprite cell per image."""
    import shutil

    from PIL import Image

    from moco_lightning.downstream.pictures import nearest

    root = write_tree(tmp_path / "images", n_per_class=3, splits=("train",)) / "train"
    first = root / "cat" / "0.jpg"
    shutil.copy(first, root / "dog" / f"copy{first.suffix}")  # 7 images, one the copy of another
    assert cli_main("embed", "--ckpt", FIXTURE_CKPT, "--data", str(root), "--out", str(tmp_path / "out"),
                    "--num_workers", "0", "--neighbours", "3", "--projector") == 0  # fmt: skip
    assert "neighbours.png projector/" in capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "out" / "index.csv")))
    features = torch.from_numpy(np.load(tmp_path / "out" / "features.npy"))
    original = next(int(r["row"]) for r in rows if r["path"] == str(first))
    copy = next(int(r["row"]) for r in rows if r["path"].endswith(f"copy{first.suffix}"))
    indices, cosines = nearest(features, [original], 3)
    assert indices[0, 0] == copy and cosines[0, 0] == pytest.approx(1.0, abs=1e-5) and original not in indices[0]
    with Image.open(tmp_path / "out" / "neighbours.png") as picture:
        assert picture.size == (96 * 4 + 8, (96 + 14) * 7)  # 7 images: each a query row, 3 neighbours each
    projected = next((tmp_path / "out" / "projector").rglob("metadata.tsv")).parent
    assert (tmp_path / "out" / "projector" / "projector_config.pbtxt").is_file()
    metadata = (projected / "metadata.tsv").read_text().splitlines()
    assert metadata[0] == "label\tpath" and len(metadata) == 8 and metadata[original + 1].startswith("cat\t")
    with Image.open(projected / "sprite.png") as sprite:
        assert sprite.size == (32 * 3, 32 * 3)  # 7 thumbnails in a 3 x 3 grid
    assert len((projected / "tensors.tsv").read_text().splitlines()) == 7
    assert cli_main("embed", "--ckpt", FIXTURE_CKPT, "--data", str(root), "--out", str(tmp_path / "o2"),
                    "--neighbours", "0") == 2  # fmt: skip
    assert "--neighbours 0" in capsys.readouterr().err
