"""STL-10 datamodule on fixture binaries written in the real format; nothing is downloaded."""

from pathlib import Path

import pytest
import torch
from helpers.cli import built
from helpers.data import training
from helpers.files import write_stl10

from moco_lightning.datamodules import STL10DataModule
from moco_lightning.datamodules.stl10 import read_stl10_images

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_splits_orientation_and_labels(tmp_path):
    images = write_stl10(tmp_path)
    dm = STL10DataModule(str(tmp_path), batch_size=8)
    dm.setup()
    train, val, pre = dm._splits["train"], dm._splits["val"], dm._splits["pretrain"]
    assert (
        train.images.shape == (20, 3, 96, 96)
        and val.images.shape == (12, 3, 96, 96)
        and train.images.dtype == torch.uint8
    )
    assert torch.equal(train.images, torch.from_numpy(images["train"]))  # (C, H, W), not transposed
    assert train.targets.tolist() == [i % 10 for i in range(20)]  # 1..10 on disk -> 0..9
    # pretraining: unlabelled (target -1) then labelled train
    assert len(pre) == 50 and torch.equal(pre.images[:30], torch.from_numpy(images["unlabeled"]))
    assert pre.targets[:30].eq(-1).all() and torch.equal(pre.targets[30:], train.targets)
    assert len(dm.train_dataloader().dataset) == 50
    assert len(dm.eval_train_dataloader().dataset) == 20 and len(dm.eval_val_dataloader().dataset) == 12
    assert dm.num_classes == 10 and dm.image_size == 96 and dm.in_channels == 3


@pytest.mark.parametrize("subset, expected", [(7, 27), (0, 20), (1000, 50)])
def test_unlabeled_subset(tmp_path, subset, expected):
    write_stl10(tmp_path)
    dm = STL10DataModule(str(tmp_path), batch_size=8, unlabeled_subset=subset)
    dm.setup()
    assert len(dm._splits["pretrain"]) == expected


def test_unlabelled_file_not_needed_without_pretraining_or_with_subset_zero(tmp_path):
    write_stl10(tmp_path)
    (tmp_path / "stl10_binary" / "unlabeled_X.bin").unlink()
    STL10DataModule(str(tmp_path), batch_size=8, unlabeled_subset=0).setup()
    dm = training(STL10DataModule(str(tmp_path), batch_size=8, pretrain=False))
    dm.setup()
    x, y, idx = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
    assert x.shape == (8, 3, 96, 96) and (y >= 0).all()
    with pytest.raises(FileNotFoundError, match=r"missing: unlabeled_X.bin"):
        STL10DataModule(str(tmp_path), batch_size=8).setup()


def test_views_seeded_blurred_at_96_px_and_eval_not_augmented(tmp_path):
    write_stl10(tmp_path)

    def views(seed):
        dm = training(STL10DataModule(str(tmp_path), batch_size=8, seed=seed, image_size=64))
        dm.setup()
        return dm, dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)

    dm, ((v1, v2), targets, index) = views(0)
    assert v1.shape == v2.shape == (8, 3, 64, 64) and (v1 - v2).abs().mean() > 0.1
    assert torch.equal(targets, dm._splits["pretrain"].targets[index])
    _, ((w1, _), _, _) = views(0)
    assert torch.equal(v1, w1)
    assert STL10DataModule(str(tmp_path)).views.blur_prob == (0.5, 0.5)
    x, y, idx = next(iter(dm.eval_val_dataloader()))
    assert x.shape == (8, 3, 64, 64) and idx.tolist() == list(range(8))  # resized to image_size, in order
    full = STL10DataModule(str(tmp_path), batch_size=8)
    full.setup()
    x, _, _ = next(iter(full.eval_train_dataloader()))
    mean, std = torch.tensor(full.mean).view(1, 3, 1, 1), torch.tensor(full.std).view(1, 3, 1, 1)
    assert torch.allclose(x, (full._splits["train"].images[:8].float() / 255 - mean) / std, atol=1e-6)


def test_missing_root_says_where_and_how(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere/stl10_binary.*train_X.bin.*download=true"):
        STL10DataModule(str(tmp_path / "nowhere")).setup()


def test_truncated_binary_and_label_mismatch_are_named(tmp_path):
    write_stl10(tmp_path)
    path = tmp_path / "stl10_binary" / "test_X.bin"
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError, match=r"test_X.bin: .* not a whole number of 3x96x96 images"):
        STL10DataModule(str(tmp_path), batch_size=8).setup()
    write_stl10(tmp_path)
    (tmp_path / "stl10_binary" / "train_y.bin").write_bytes(bytes([1] * 19))
    with pytest.raises(ValueError, match=r"train_y.bin: 19 labels for 20 images"):
        STL10DataModule(str(tmp_path), batch_size=8).setup()


def test_chunked_read_into_a_preallocated_tensor(tmp_path):
    images = write_stl10(tmp_path)
    out = torch.zeros(40, 3, 96, 96, dtype=torch.uint8)
    got = read_stl10_images(tmp_path / "stl10_binary" / "unlabeled_X.bin", limit=25, out=out, chunk=7)
    assert got.shape == (25, 3, 96, 96) and torch.equal(got, torch.from_numpy(images["unlabeled"][:25]))
    assert out[25:].eq(0).all()


def test_download_goes_through_torchvision_only_when_missing(tmp_path, monkeypatch):
    import torchvision.datasets

    calls = []

    class FakeSTL10:
        def __init__(self, root, split="train", download=False):
            calls.append((root, split, download))
            write_stl10(Path(root))

    monkeypatch.setattr(torchvision.datasets, "STL10", FakeSTL10)
    dm = STL10DataModule(str(tmp_path), download=True, batch_size=8)
    dm.prepare_data()
    dm.prepare_data()
    assert calls == [(str(tmp_path), "test", True)]
    dm.setup()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unlabeled_subset"):
        STL10DataModule(str(tmp_path), unlabeled_subset=-1)
    write_stl10(tmp_path)
    with pytest.raises(ValueError, match=r"batch_size=64 is larger than the 50 pretraining images"):
        STL10DataModule(str(tmp_path), batch_size=64).setup()


def test_stl10_config_instantiates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = built(ROOT / "configs" / "stl10.yaml")
    model, datamodule = cli.model, cli.datamodule
    assert isinstance(datamodule, STL10DataModule) and datamodule.image_size == 96
    assert model.hparams.image_size == 96 and model.hparams.queue_size == 8192
