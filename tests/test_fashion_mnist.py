import pytest
import torch
from helpers.data import tiny_data
from helpers.files import fake_fashion
from helpers.trainers import cpu_trainer

from moco_lightning.datamodules import FashionMNISTDataModule
from moco_lightning.datamodules.fashion_mnist import read_idx


def test_reads_the_debian_package_files():
    dm = FashionMNISTDataModule(val_subset=None)
    dm.setup()
    train, val = dm._splits["train"], dm._splits["val"]
    assert train.images.shape == (60000, 1, 28, 28) and val.images.shape == (10000, 1, 28, 28)
    assert train.images.dtype == torch.uint8 and train.targets.dtype == torch.int64
    assert torch.bincount(train.targets).tolist() == [6000] * 10  # the official split is balanced
    assert dm.num_classes == 10 and dm.in_channels == 1


@pytest.mark.parametrize("compress", [True, False])
def test_reads_a_data_dir_in_idx_format(tmp_path, compress):
    fake_fashion(tmp_path, compress=compress)
    dm = FashionMNISTDataModule(data_dir=str(tmp_path), batch_size=8)
    dm.setup()
    assert len(dm._splits["train"]) == 40 and dm._splits["val"].targets.tolist() == [i % 10 for i in range(20)]


def test_missing_dataset_says_how_to_get_it(tmp_path):
    dm = FashionMNISTDataModule(data_dir=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"nowhere.*apt-get install dataset-fashion-mnist.*download=true"):
        dm.setup()


def test_truncated_file_is_named(tmp_path):
    fake_fashion(tmp_path, compress=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte: truncated or corrupt"):
        read_idx(path)


@pytest.mark.parametrize("case", ["missing", "not gzip"])
def test_an_unreadable_file_is_named_with_what_to_do(tmp_path, case):
    path = tmp_path / "train-images-idx3-ubyte.gz"
    if case == "not gzip":
        path.write_bytes(b"\x00\x00\x08\x03 not gzip data")
    with pytest.raises(
        ValueError, match=r"train-images-idx3-ubyte.gz: cannot be read as an IDX file .*get the dataset again"
    ):
        read_idx(path)


def test_batch_larger_than_the_data_is_a_clear_error(tmp_path):
    fake_fashion(tmp_path)
    with pytest.raises(ValueError, match=r"batch_size=64 is larger than the 40 training images"):
        FashionMNISTDataModule(data_dir=str(tmp_path), batch_size=64).setup()


def test_two_views_differ_are_seeded_and_eval_views_are_not_augmented():
    def first_batch(seed):
        dm = tiny_data(seed=seed)
        trainer = cpu_trainer()
        dm.trainer = trainer
        dm.setup()
        raw = next(iter(dm.train_dataloader()))
        trainer.state.fn, trainer.training = "fit", True
        return dm, raw, dm.on_after_batch_transfer(raw, 0)

    dm, raw, (views, targets, index) = first_batch(0)
    v1, v2 = views
    assert v1.shape == v2.shape == (16, 1, 28, 28) and v1.dtype == torch.float32
    assert (v1 - v2).abs().mean() > 0.1  # two different augmentations
    assert torch.equal(targets, dm._splits["train"].targets[index])
    _, raw_again, (views_again, _, _) = first_batch(0)
    assert torch.equal(raw[0], raw_again[0]) and torch.equal(views_again[0], v1)
    _, _, (views_other, _, _) = first_batch(1)
    assert not torch.equal(views_other[0], v1)
    x, y, idx = next(iter(dm.eval_train_dataloader()))
    expected = (dm._splits["train"].images[:16].float() / 255 - 0.2860) / 0.3530
    assert torch.allclose(x, expected) and idx.tolist() == list(range(16))  # in order, normalised only
    assert len(dm.eval_val_dataloader().dataset) == 32


def test_sampler_order_depends_on_seed_and_epoch_only():
    dm = tiny_data()
    dm.setup()
    loader = dm.train_dataloader()
    sampler = loader.sampler
    first = list(sampler)
    torch.manual_seed(123)  # the global RNG plays no part
    assert list(sampler) == first and sorted(first) == list(range(64))
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert loader.drop_last and len(loader) == 4


def test_training_loader_resumes_mid_epoch_from_its_state():
    """The loader's state is (epoch, batches yielded); a loader given it skips exactly those batches of that epoch
    (a state of another epoch, or none, skips nothing), and drawing does not touch the global RNG."""
    dm = tiny_data()
    dm.setup()
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)
    whole = [b[2] for b in loader]
    assert loader.state_dict() == {"epoch": 1, "batches": 4, "batch_size": 16, "samples": 64}
    it = iter(loader)
    next(it)
    assert loader.state_dict() == {"epoch": 1, "batches": 1, "batch_size": 16, "samples": 64}
    fresh = dm.train_dataloader()
    fresh.sampler.set_epoch(1)
    fresh.load_state_dict({"epoch": 1, "batches": 3})
    state = torch.get_rng_state()
    rest = [b[2] for b in fresh]
    assert torch.equal(torch.get_rng_state(), state)
    assert (
        len(rest) == 1
        and torch.equal(rest[0], whole[3])
        and fresh.state_dict() == {"epoch": 1, "batches": 4, "batch_size": 16, "samples": 64}
    )
    assert [b[2].tolist() for b in fresh] == [b.tolist() for b in whole]  # the next pass is a whole epoch again
    other = dm.train_dataloader()
    other.sampler.set_epoch(2)
    other.load_state_dict(
        {"epoch": 1, "batches": 4, "batch_size": 16, "samples": 64}
    )  # saved at the end of epoch 1: epoch 2 starts at its start
    assert len(list(other)) == 4


def test_a_file_is_decompressed_once_per_process_and_again_when_it_changes(tmp_path, monkeypatch):
    """``evaluate``'s budgets and a test's runs decompress Fashion-MNIST's files once; a replaced file is read anew."""
    import gzip
    import os

    fake_fashion(tmp_path)
    opened = []
    real_open = gzip.open
    reading = lambda f, mode="rb", **k: (mode == "rb" and opened.append(f)) or real_open(f, mode)  # noqa: E731
    monkeypatch.setattr(gzip, "open", reading)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    first = read_idx(path)
    assert read_idx(path) is first and opened == [path]
    assert not first.flags.writeable  # shared between readers: nobody may change it
    changed = first.copy()
    changed[0] = 255
    with gzip.open(path, "wb") as f:  # the same size, a later modification time
        f.write(bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in changed.shape) + changed.tobytes())
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    again = read_idx(path)
    assert len(opened) == 2 and (again[0] == 255).all() and (first[0] != 255).any()
