"""CIFAR-10/100 datamodules on fixture files written in the real format (python pickles); nothing is downloaded."""

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.cli import built
from helpers.data import training
from helpers.files import write_cifar10, write_cifar100

from moco_lightning.datamodules import CIFAR10DataModule, CIFAR100DataModule
from moco_lightning.datamodules.cifar import read_cifar_pickle

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("bytes_keys", [False, True])
def test_reads_the_pickles_in_channel_first_order(tmp_path, bytes_keys):
    written = write_cifar10(tmp_path, bytes_keys=bytes_keys)
    dm = CIFAR10DataModule(str(tmp_path), batch_size=8)
    dm.setup()
    train, val = dm._splits["train"], dm._splits["val"]
    assert train.images.shape == (120, 3, 32, 32) and val.images.shape == (24, 3, 32, 32)
    assert train.images.dtype == torch.uint8 and train.targets.dtype == torch.int64
    data, labels = written["data_batch_2"]
    i = 24 + 5  # 6th image of the second batch
    assert train.targets[i].item() == labels[5]
    # data rows are the 1024 red, then green, then blue pixels, row-major
    assert train.images[i, 0, 0, 1].item() == data[5, 1] and train.images[i, 1, 0, 0].item() == data[5, 1024]
    assert train.images[i, 2, 31, 31].item() == data[5, 3071]
    assert dm.num_classes == 10 and dm.in_channels == 3 and dm.image_size == 32 and len(dm.mean) == len(dm.std) == 3


def test_data_dir_may_be_the_batches_folder_itself(tmp_path):
    write_cifar10(tmp_path)
    dm = CIFAR10DataModule(str(tmp_path / "cifar-10-batches-py"), batch_size=8)
    dm.setup()
    assert len(dm._splits["train"]) == 120


def test_cifar100_fine_labels(tmp_path):
    write_cifar100(tmp_path)
    dm = CIFAR100DataModule(str(tmp_path), batch_size=8)
    dm.setup()
    assert dm.num_classes == 100 and dm._splits["train"].targets[0].item() == 99
    assert dm._splits["val"].images.shape == (40, 3, 32, 32)


def test_two_views_differ_are_seeded_and_eval_views_are_not_augmented(tmp_path):
    write_cifar10(tmp_path)

    def first(seed):
        dm = training(CIFAR10DataModule(str(tmp_path), batch_size=16, seed=seed))
        dm.setup()
        raw = next(iter(dm.train_dataloader()))
        return dm, raw, dm.on_after_batch_transfer(raw, 0)

    dm, raw, ((v1, v2), targets, index) = first(0)
    assert v1.shape == v2.shape == (16, 3, 32, 32) and v1.dtype == torch.float32
    assert (v1 - v2).abs().mean() > 0.1
    assert torch.equal(targets, dm._splits["train"].targets[index])
    assert sorted(index.tolist()) != list(range(16))  # shuffled
    _, raw_again, ((w1, w2), _, _) = first(0)
    assert torch.equal(raw[0], raw_again[0]) and torch.equal(w1, v1) and torch.equal(w2, v2)
    _, _, ((o1, _), _, _) = first(1)
    assert not torch.equal(o1, v1)
    loader = dm.train_dataloader()
    assert loader.drop_last and len(loader) == 120 // 16
    x, y, idx = next(iter(dm.eval_train_dataloader()))
    mean, std = torch.tensor(dm.mean).view(1, 3, 1, 1), torch.tensor(dm.std).view(1, 3, 1, 1)
    assert torch.allclose(x, (dm._splits["train"].images[:16].float() / 255 - mean) / std, atol=1e-6)
    assert idx.tolist() == list(range(16))
    assert len(dm.eval_val_dataloader().dataset) == 24 and not dm.eval_val_dataloader().drop_last


def test_presets_reach_the_views(tmp_path):
    v3 = CIFAR10DataModule(str(tmp_path), preset="moco_v3")
    assert v3.views.solarize_prob == (0.0, 0.2) and v3.views.blur_prob == (0.0, 0.0)  # blur off at 32 px
    assert v3.views.scale == (0.08, 1.0)
    v1 = CIFAR10DataModule(str(tmp_path), preset="moco_v1", min_scale=0.3)
    assert v1.views.jitter == (0.4, 0.4, 0.4, 0.4) and v1.views.jitter_prob == 1.0 and v1.views.scale == (0.3, 1.0)
    big = CIFAR10DataModule(str(tmp_path), image_size=64)
    assert big.views.blur_prob == (0.5, 0.5) and big.views.size == 64


def test_pretrain_false_gives_one_augmented_view(tmp_path):
    write_cifar10(tmp_path)
    dm = training(CIFAR10DataModule(str(tmp_path), batch_size=8, pretrain=False))
    dm.setup()
    x, y, idx = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32
    val = dm.val_dataloader()
    assert len(val.dataset) == 24 and next(iter(val))[0].dtype == torch.float32  # the evaluation transform


def test_missing_files_say_where_and_how_to_get_them(tmp_path):
    dm = CIFAR10DataModule(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"nowhere/cifar-10-batches-py.*data_batch_1.*download=true"):
        dm.setup()
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing: test_batch"):
        CIFAR10DataModule(str(tmp_path)).setup()


def test_truncated_pickle_is_named(tmp_path):
    write_cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"data_batch_3: cannot be read as a CIFAR python pickle"):
        CIFAR10DataModule(str(tmp_path)).setup()
    with pytest.raises(ValueError, match=r"expected 'data' and 'labels'"):
        with open(path, "wb") as f:
            pickle.dump({"data": np.zeros((1, 3072), np.uint8)}, f)
        read_cifar_pickle(path, "labels")


def test_download_goes_through_torchvision_only_when_files_are_missing(tmp_path, monkeypatch):
    import torchvision.datasets

    calls = []

    class FakeCIFAR10:  # stands in for the network: writes the files torchvision would extract
        def __init__(self, root, train=True, download=False):
            calls.append((root, train, download))
            write_cifar10(Path(root))

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    CIFAR10DataModule(str(tmp_path), download=False).prepare_data()
    assert calls == []
    dm = CIFAR10DataModule(str(tmp_path), download=True, batch_size=8)
    dm.prepare_data()
    assert calls == [(str(tmp_path), False, True)]
    dm.prepare_data()  # files present now: no second download
    dm.setup()
    assert len(calls) == 1 and len(dm._splits["train"]) == 120


def test_batch_larger_than_the_data_is_a_clear_error(tmp_path):
    write_cifar10(tmp_path)
    with pytest.raises(ValueError, match=r"batch_size=256 is larger than the 120 training images"):
        CIFAR10DataModule(str(tmp_path), batch_size=256).setup()


def test_trains_moco_for_two_steps(tmp_path):
    from helpers.models import tiny_backbone, tiny_moco
    from helpers.trainers import cpu_trainer

    write_cifar10(tmp_path)
    dm = CIFAR10DataModule(str(tmp_path), batch_size=16, val_subset=16)
    model = tiny_moco(backbone=tiny_backbone(3), in_channels=3, image_size=32)
    trainer = cpu_trainer(max_steps=2, limit_val_batches=1)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])


def test_cifar10_config_instantiates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = built(ROOT / "configs" / "cifar10.yaml")
    model, datamodule = cli.model, cli.datamodule
    hp, dm = model.hparams, datamodule
    assert isinstance(dm, CIFAR10DataModule) and dm.batch_size == 512 and dm.views.scale == (0.08, 1.0)
    assert dm.views.blur_prob == (0.0, 0.0)
    assert (hp.backbone, hp.stem, hp.queue_size, hp.momentum, hp.temperature) == (
        "resnet18",
        "cifar",
        4096,
        0.99,
        0.1,
    )
    assert (hp.lr, hp.weight_decay, hp.head, hp.lr_schedule) == (0.03, 5e-4, "linear", "cosine")
    assert cli.trainer.max_epochs == 200
