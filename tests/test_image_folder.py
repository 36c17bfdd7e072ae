"""ImageFolderDataModule on JPEG/PNG trees the tests write: both augmentation paths, image modes, bad files."""

import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.data import training
from helpers.files import smooth_rgb, write_tree
from PIL import Image
from torchvision import transforms as T

from moco_lightning.datamodules import BadImageError, ImageFolderDataModule, load_image
from moco_lightning.datamodules.image_folder import scan_image_folder

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def png_rgb16(arr: np.ndarray) -> bytes:
    """A 16-bit-per-channel RGB PNG (PIL cannot write one)."""
    h, w, _ = arr.shape
    raw = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def first_views(dm):
    dm.setup()
    raw = next(iter(dm.train_dataloader()))
    return training(dm).on_after_batch_transfer(raw, 0)


# --- layout -----------------------------------------------------------------------------------------
def test_scan_finds_nested_images_ignores_other_files_and_sorts_classes(tmp_path):
    write_tree(tmp_path, classes=("zebra", "ant"))
    samples, classes = scan_image_folder(tmp_path / "train")
    assert classes == ["ant", "zebra"] and len(samples) == 8
    assert [t for _, t in samples] == [0] * 4 + [1] * 4
    assert any("nested" in p for p, _ in samples) and not any(p.endswith((".txt", ".hidden.jpg")) for p, _ in samples)
    dm = ImageFolderDataModule(str(tmp_path), batch_size=4, num_workers=0)
    assert dm.num_classes == 2 and dm.classes == ["ant", "zebra"]


def test_layout_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere/train does not exist.*<data_dir>/train/<class>/\*.jpg"):
        ImageFolderDataModule(str(tmp_path / "nowhere"), num_workers=0).setup()
    (tmp_path / "empty" / "train").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"empty/train holds no images"):
        ImageFolderDataModule(str(tmp_path / "empty"), num_workers=0).setup()
    write_tree(tmp_path / "hole")
    (tmp_path / "hole" / "train" / "empty_class").mkdir()
    with pytest.raises(ValueError, match=r"class folder .*train/empty_class holds no images"):
        ImageFolderDataModule(str(tmp_path / "hole"), num_workers=0).setup()
    write_tree(tmp_path / "mixed")
    smooth_rgb(0).save(tmp_path / "mixed" / "train" / "stray.jpg")
    with pytest.raises(ValueError, match=r"holds both image files \(stray.jpg"):
        ImageFolderDataModule(str(tmp_path / "mixed"), num_workers=0).setup()
    write_tree(tmp_path / "extra")
    (tmp_path / "extra" / "val" / "bird").mkdir()
    smooth_rgb(0).save(tmp_path / "extra" / "val" / "bird" / "0.jpg")
    with pytest.raises(ValueError, match=r"class folders the training folder lacks: \['bird'\]"):
        ImageFolderDataModule(str(tmp_path / "extra"), num_workers=0).setup()
    write_tree(tmp_path / "flatval", splits=("train",))
    (tmp_path / "flatval" / "val").mkdir()
    smooth_rgb(0).save(tmp_path / "flatval" / "val" / "ILSVRC2012_val_00000001.JPEG")
    with pytest.raises(ValueError, match=r"flatval/val holds images without class folders.*valprep.sh"):
        ImageFolderDataModule(str(tmp_path / "flatval"), num_workers=0).setup()


def test_unlabelled_folder_pretrains_but_has_no_evaluation(tmp_path):
    (tmp_path / "train").mkdir()
    for i in range(6):
        smooth_rgb(i).save(tmp_path / "train" / f"{i}.jpg")
    dm = ImageFolderDataModule(str(tmp_path), batch_size=4, image_size=32, num_workers=0)
    (v1, v2), targets, _ = first_views(dm)
    assert v1.shape == (4, 3, 32, 32) and targets.eq(-1).all() and dm.num_classes == 0
    assert dm.val_dataloader() == []  # no val folder: no validation
    with pytest.raises(ValueError, match=r"unlabelled, num_classes=0.*class folders"):
        dm.eval_train_dataloader()
    with pytest.raises(ValueError, match=r"unlabelled"):
        dm.eval_val_dataloader()
    with pytest.raises(ValueError, match=r"linear evaluation \(pretrain=False\) needs labels"):
        ImageFolderDataModule(str(tmp_path), batch_size=4, num_workers=0, pretrain=False).setup()


# --- image modes -----------------------------------------------------------------------------------
def test_every_image_mode_loads_as_8_bit_rgb(tmp_path):
    gray = Image.fromarray(np.full((8, 8), 100, np.uint8), "L")
    gray.save(tmp_path / "gray.png")
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[:4] = (255, 0, 0, 255)  # opaque red top half, fully transparent (black) bottom half
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    pal = Image.fromarray(np.full((8, 8, 3), (0, 128, 255), np.uint8)).convert("P", palette=Image.ADAPTIVE, colors=4)
    pal.save(tmp_path / "palette.png")
    pal_t = pal.copy()
    pal_t.info["transparency"] = pal_t.getpixel((0, 0))
    pal_t.save(tmp_path / "palette_transparent.png", transparency=pal_t.getpixel((0, 0)))
    Image.fromarray(np.full((8, 8), 32896, np.uint16)).save(tmp_path / "gray16.png")  # 0x8080 -> 128
    rgb16 = np.zeros((8, 8, 3), np.uint16)
    rgb16[..., 0], rgb16[..., 1] = 65535, 32896
    (tmp_path / "rgb16.png").write_bytes(png_rgb16(rgb16))
    Image.fromarray(np.full((8, 8, 3), (200, 100, 50), np.uint8)).convert("CMYK").save(
        tmp_path / "cmyk.jpg", quality=100
    )
    Image.fromarray(np.full((8, 8), 255, np.uint8)).convert("1").save(tmp_path / "bilevel.png")

    def px(name, xy=(0, 0), channels=3):
        img = load_image(str(tmp_path / name), channels)
        assert img.mode == ("RGB" if channels == 3 else "L") and img.size == (8, 8)
        return img.getpixel(xy)

    with Image.open(tmp_path / "gray16.png") as im16:
        assert im16.mode.startswith("I;16")  # PIL's convert would clip this to 255
    assert px("gray.png") == (100, 100, 100)
    assert px("rgba.png", (0, 0)) == (255, 0, 0) and px("rgba.png", (0, 7)) == (255, 255, 255)  # over white
    assert px("palette.png") == (0, 128, 255)
    assert px("palette_transparent.png") == (255, 255, 255)
    assert px("gray16.png") == (128, 128, 128) and px("gray16.png", channels=1) == 128
    assert px("rgb16.png") == (255, 128, 0)
    assert all(abs(a - b) <= 3 for a, b in zip(px("cmyk.jpg"), (200, 100, 50)))
    assert px("bilevel.png") == (255, 255, 255)
    assert abs(px("rgba.png", (0, 0), channels=1) - 76) <= 1  # luma of pure red


def test_mixed_mode_folder_batches_and_grayscale_pipeline(tmp_path):
    folder = tmp_path / "train" / "a"
    folder.mkdir(parents=True)
    Image.fromarray(np.full((20, 30), 90, np.uint8), "L").save(folder / "gray.png")
    Image.fromarray(np.full((20, 30, 4), 200, np.uint8), "RGBA").save(folder / "rgba.png")
    smooth_rgb(0).convert("P").save(folder / "pal.png")
    Image.fromarray(np.full((20, 30), 40000, np.uint16)).save(folder / "g16.png")
    for channels in (3, 1):
        for aug in ("device", "workers"):
            dm = ImageFolderDataModule(
                str(tmp_path), batch_size=4, image_size=16, num_workers=0, in_channels=channels, augment_on=aug
            )
            (v1, v2), _, _ = first_views(dm)
            assert v1.shape == v2.shape == (4, channels, 16, 16) and torch.isfinite(v1).all()
            x, _, _ = next(iter(dm.eval_train_dataloader()))
            assert x.shape == (4, channels, 16, 16)
    assert ImageFolderDataModule(str(tmp_path), in_channels=1).mean == (0.449,)


# --- bad files ---------------------------------------------------------------------------------------
def corrupt_tree(root):
    write_tree(root, n_per_class=6, splits=("train",))
    (root / "train" / "dog" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg" * 10)
    good = (root / "train" / "cat" / "0.jpg").read_bytes()
    (root / "train" / "cat" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    return root


def test_corrupt_image_error_names_the_file(tmp_path):
    corrupt_tree(tmp_path)
    dm = ImageFolderDataModule(str(tmp_path), batch_size=14, image_size=16, num_workers=0)
    dm.setup()
    with pytest.raises(
        BadImageError, match=r"train/(cat/truncated|dog/corrupt).jpg: cannot be read as an image.*skip_bad_images=true"
    ):
        next(iter(dm.train_dataloader()))
    workers = ImageFolderDataModule(str(tmp_path), batch_size=14, image_size=16, num_workers=2)
    workers.setup()
    with pytest.raises(BadImageError) as raised:  # from a worker process: the message, not the worker's traceback
        next(iter(workers.train_dataloader()))
    message = str(raised.value)
    assert "Traceback" not in message and "\n" not in message
    assert message.startswith(str(tmp_path)) and "corrupt.jpg: cannot be read as an image" in message
    with pytest.raises(BadImageError, match=r"truncated.jpg: cannot be read"):
        load_image(str(tmp_path / "train" / "cat" / "truncated.jpg"))
    with pytest.raises(BadImageError, match=r"corrupt.jpg: cannot be read"):
        load_image(str(tmp_path / "train" / "dog" / "corrupt.jpg"))


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
@pytest.mark.parametrize("workers", [0, 1])
def test_skip_bad_images_counts_them_with_one_warning(tmp_path, workers):
    corrupt_tree(tmp_path)
    dm = ImageFolderDataModule(
        str(tmp_path), batch_size=14, image_size=16, num_workers=workers, skip_bad_images=True, augment_on="workers"
    )
    dm.setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = next(iter(dm.train_dataloader()))  # all 14 images in one batch
    assert batch[0][0].shape == (14, 3, 16, 16)  # the batch keeps its size
    assert sorted(Path(p).name for p in dm.bad_images) == ["corrupt.jpg", "truncated.jpg"] and dm.bad_image_count == 2
    if workers == 0:  # a worker's warning goes to its own stderr
        skipped = [w for w in caught if "skip_bad_images" in str(w.message)]
        assert len(skipped) == 1 and ".jpg cannot be read" in str(skipped[0].message)


# --- views ------------------------------------------------------------------------------------------
@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
@pytest.mark.parametrize("aug", ["device", "workers"])
def test_views_differ_are_seeded_per_image_and_per_epoch(tmp_path, aug):
    write_tree(tmp_path)

    def views(seed, workers=0, epoch=0):
        dm = ImageFolderDataModule(
            str(tmp_path), batch_size=8, image_size=24, num_workers=workers, seed=seed, augment_on=aug
        )
        dm.setup()
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return training(dm).on_after_batch_transfer(next(iter(loader)), 0)

    (v1, v2), targets, index = views(0)
    assert v1.shape == v2.shape == (8, 3, 24, 24) and v1.dtype == torch.float32 and (v1 - v2).abs().mean() > 0.1
    assert sorted(index.tolist()) == list(range(8)) and torch.equal(targets, (index >= 4).long())
    (w1, w2), _, _ = views(0)
    assert torch.equal(v1, w1) and torch.equal(v2, w2)
    (o1, _), _, _ = views(1)
    assert not torch.equal(o1, v1)
    (e1, _), _, e_index = views(0, epoch=1)
    assert not torch.equal(e1[e_index.argsort()], v1[index.argsort()])  # new views every epoch
    if aug == "workers":  # the same views whatever the number of workers
        (p1, p2), _, _ = views(0, workers=1)
        assert torch.allclose(p1, v1) and torch.allclose(p2, v2)


def test_pil_path_leaves_the_main_process_rngs_alone(tmp_path):
    write_tree(tmp_path)
    dm = ImageFolderDataModule(str(tmp_path), batch_size=8, image_size=16, num_workers=0, augment_on="workers")
    dm.setup()
    torch.manual_seed(5)
    np.random.seed(5)
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()[1].copy()
    dm._splits["train"][(3, 2)]  # image 3 of epoch 2, made in this (the main) process
    assert torch.equal(torch.get_rng_state(), torch_state) and np.array_equal(np.random.get_state()[1], np_state)


def test_eval_views_are_resize_centre_crop_normalise(tmp_path):
    write_tree(tmp_path)
    dm = ImageFolderDataModule(str(tmp_path), batch_size=8, image_size=24, num_workers=0)
    dm.setup()
    x, y, idx = next(iter(dm.eval_train_dataloader()))
    assert idx.tolist() == list(range(8)) and y.tolist() == [0] * 4 + [1] * 4
    path = dm._eval_splits["train"].paths[0]
    reference = T.Compose([T.Resize(27), T.CenterCrop(24), T.ToTensor(), T.Normalize(dm.mean, dm.std)])
    assert torch.allclose(x[0], reference(Image.open(path).convert("RGB")), atol=1e-6)
    assert len(dm.eval_val_dataloader().dataset) == 8 and not dm.eval_val_dataloader().drop_last


@pytest.mark.parametrize("aug", ["device", "workers"])
def test_pretrain_false_gives_one_view(tmp_path, aug):
    write_tree(tmp_path)
    dm = ImageFolderDataModule(
        str(tmp_path), batch_size=4, image_size=16, num_workers=0, pretrain=False, augment_on=aug
    )
    x, y, _ = first_views(dm)
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32
    assert next(iter(dm.val_dataloader()))[0].shape == (4, 3, 16, 16)


def test_presets_and_arguments(tmp_path):
    dm = ImageFolderDataModule(str(tmp_path), preset="moco_v3", image_size=96, augment_on="device")
    assert [bv.blur_prob for bv in dm.views.per_view] == [(1.0,), (0.1,)]
    assert [bv.solarize_prob for bv in dm.views.per_view] == [(0.0,), (0.2,)]
    assert ImageFolderDataModule(str(tmp_path)).augment_on == ("device" if torch.cuda.is_available() else "workers")
    with pytest.raises(ValueError, match="in_channels must be 1"):
        ImageFolderDataModule(str(tmp_path), in_channels=2)
    with pytest.raises(ValueError, match="mean and std need 3 values"):
        ImageFolderDataModule(str(tmp_path), mean=(0.5,), std=(0.5,))
    write_tree(tmp_path)
    with pytest.raises(ValueError, match=r"batch_size=64 is larger than the 8 training images"):
        ImageFolderDataModule(str(tmp_path), batch_size=64, num_workers=0).setup()


def test_subsets_keep_every_class(tmp_path):
    write_tree(tmp_path, n_per_class=5, classes=("a", "b", "c"))
    dm = ImageFolderDataModule(str(tmp_path), batch_size=2, num_workers=0, train_subset=3, val_subset=6)
    dm.setup()
    assert dm._splits["train"].targets.tolist() == [0, 1, 2] and len(dm._eval_splits["val"]) == 6


def test_holdout_takes_the_same_share_of_every_class_in_place_of_val(tmp_path):
    """holdout 0.25 of 3 classes x 8 images: 2 of each class, seeded, out of the training split (and its kNN bank)
    into the evaluation split, replacing val/; a number of images works alike; a class emptied is refused."""
    from moco_lightning.errors import ConfigError

    write_tree(tmp_path, n_per_class=8, classes=("a", "b", "c"))
    splits = {}
    for holdout in (0.25, 6):
        dm = ImageFolderDataModule(str(tmp_path), batch_size=2, num_workers=0, holdout=holdout, pretrain=False)
        dm.setup()
        train, held = dm._eval_splits["train"], dm._eval_splits["val"]
        assert sorted(held.targets.tolist()) == [0, 0, 1, 1, 2, 2] and len(train) == 18
        assert not set(held.paths) & set(train.paths)
        assert all("/train/" in p for p in held.paths)  # val/ is not read
        splits[holdout] = held.paths
    assert splits[0.25] == splits[6]  # the same seeded draw
    for bad, said in ((24, "leaves class .a. without training images"), (0, "holdout=0: give a share")):
        with pytest.raises(ConfigError, match=said):
            dm = ImageFolderDataModule(str(tmp_path), batch_size=2, num_workers=0, holdout=bad)
            dm.setup()


@pytest.mark.parametrize("labelled", [True, False])
def test_trains_moco_for_two_steps(tmp_path, labelled):
    from helpers.models import tiny_backbone, tiny_moco
    from helpers.trainers import cpu_trainer

    if labelled:
        write_tree(tmp_path)
    else:
        (tmp_path / "train").mkdir()
        for i in range(8):
            smooth_rgb(i).save(tmp_path / "train" / f"{i}.jpg")
    # the labelled run crops in the workers and colours in on_after_batch_transfer; the other, all in the workers
    dm = ImageFolderDataModule(
        str(tmp_path), batch_size=4, image_size=16, num_workers=0, augment_on="device" if labelled else "workers"
    )
    model = tiny_moco(backbone=tiny_backbone(3), in_channels=3, image_size=16)
    trainer = cpu_trainer(max_steps=2, limit_val_batches=1)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
    assert ("val/loss" in trainer.callback_metrics) == labelled  # validation only with a val folder


@pytest.mark.parametrize(
    "config, preset, head, temperature",
    [("moco_v2.yaml", "moco_v2", "mlp", 0.2), ("moco_v1.yaml", "moco_v1", "linear", 0.07)],
)
def test_imagenet_configs_instantiate(tmp_path, monkeypatch, config, preset, head, temperature):
    from lightning.pytorch import LightningDataModule
    from lightning.pytorch.cli import LightningCLI

    from moco_lightning import MoCo

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["moco-lightning"])
    cli = LightningCLI(
        MoCo, LightningDataModule, subclass_mode_data=True, run=False, args=["--config", str(ROOT / "configs" / config)]
    )
    hp, dm = cli.model.hparams, cli.datamodule
    assert isinstance(dm, ImageFolderDataModule) and dm.preset == preset and dm.batch_size == 256
    assert (hp.backbone, hp.queue_size, hp.momentum, hp.head, hp.temperature) == (
        "resnet50",
        65536,
        0.999,
        head,
        temperature,
    )
    assert hp.lr == 0.03 and hp.weight_decay == 1e-4 and cli.trainer.max_epochs == 200
    assert hp.lr_schedule == ("cosine" if preset == "moco_v2" else "step")
    if preset == "moco_v1":
        assert list(hp.lr_milestones) == [120, 160]


def test_error_names_every_unreadable_file_of_the_split(tmp_path):
    corrupt_tree(tmp_path)
    dm = ImageFolderDataModule(str(tmp_path), batch_size=14, image_size=16, num_workers=0)
    dm.setup()
    with pytest.raises(BadImageError) as caught:
        next(iter(dm.train_dataloader()))
    message = str(caught.value)
    assert "cat/truncated.jpg: cannot be read" in message and "dog/corrupt.jpg: cannot be read" in message
    assert "2 unreadable of the 14 files of this split" in message


@pytest.mark.parametrize("workers", [0, 1])
def test_skipped_images_are_replaced_within_their_class_and_warned_once(tmp_path, workers):
    """A bad file that is the last of its class must not be replaced by the next class's first image under the bad
    file's label: the stand-in comes from the same class, in the kNN bank and in linear evaluation too."""
    write_tree(tmp_path, n_per_class=3, splits=("train",))
    bad = tmp_path / "train" / "cat" / "nested" / "2.png"  # the last file of the first class
    bad.write_bytes(b"not a jpeg")
    dm = ImageFolderDataModule(
        str(tmp_path), batch_size=6, image_size=16, num_workers=workers, skip_bad_images=True, augment_on="workers"
    )
    dm.setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for loader in (dm.train_dataloader(), dm.eval_train_dataloader()):
            for _ in loader:
                pass
    eval_ds = dm._eval_splits["train"]
    i = eval_ds.paths.index(str(bad))
    image, target, _ = eval_ds[i]
    same_class = [j for j in range(len(eval_ds)) if eval_ds.targets[j] == target and j != i]
    assert any(torch.equal(image, eval_ds[j][0]) for j in same_class)  # a readable image of its own class
    assert dm.bad_images == [str(bad)]
    if workers == 0:
        assert len([w for w in caught if "skip_bad_images" in str(w.message)]) == 1  # one warning per run


def test_worker_loader_resumes_mid_epoch_with_the_same_views(tmp_path):
    """PIL in 2 persistent workers: a loader given the state (epoch 1, 2 batches) yields that epoch's batches 3 and
    4 with the views the uninterrupted loader gave them (each image's views are seeded by index and epoch)."""
    write_tree(tmp_path, n_per_class=8)
    dm = ImageFolderDataModule(str(tmp_path), batch_size=4, image_size=16, num_workers=2)
    dm.setup()
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)
    whole = list(loader)
    resumed = dm.train_dataloader()
    resumed.sampler.set_epoch(1)
    resumed.load_state_dict({"epoch": 1, "batches": 2})
    rest = list(resumed)
    assert (
        len(whole) == 4
        and len(rest) == 2
        and resumed.state_dict() == {"epoch": 1, "batches": 4, "batch_size": 4, "samples": 16}
    )
    for a, b in zip(whole[2:], rest):
        assert torch.equal(a[2], b[2]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert len(list(resumed)) == 4  # the persistent workers' next epoch starts at its first batch


@pytest.mark.slow  # a subprocess / several processes
def test_loaders_with_workers_are_freed_at_once_and_leave_no_worker_behind(tmp_path):
    """An evaluation loader with worker processes, iterated and dropped, is freed by reference counting alone (no
    cycle through its index sampler) and its workers are gone: before, they lived until the cyclic collector ran, and
    processes forked meanwhile inherited them and printed "AssertionError: can only test a child process" when they
    collected them (16 tracebacks in a 4-epoch run with KNNMonitor). A training run with workers and a kNN monitor
    prints none."""
    import gc
    import multiprocessing
    import weakref

    from helpers.cli import run_script_forked

    root = write_tree(tmp_path / "data", n_per_class=6)
    dm = ImageFolderDataModule(data_dir=str(root), batch_size=4, image_size=32, num_workers=2, pretrain=False)
    dm.setup("fit")
    gc.disable()  # only reference counting may free them
    try:
        for make in (dm.eval_train_dataloader, dm.eval_val_dataloader, dm.train_dataloader):
            loader = make()
            assert sum(len(batch[1]) for batch in loader) > 0
            freed = weakref.ref(loader)
            del loader
            assert freed() is None, make.__name__
            assert not multiprocessing.active_children(), make.__name__
    finally:
        gc.enable()
    script = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "from lightning.pytorch import Trainer\n"
        "from moco_lightning import MoCo\n"
        "from moco_lightning.callbacks import KNNMonitor\n"
        "from moco_lightning.datamodules import ImageFolderDataModule\n"
        f"dm = ImageFolderDataModule(data_dir={str(root)!r}, batch_size=4, image_size=32, num_workers=2)\n"
        "model = MoCo(backbone='resnet18', width=0.0625, image_size=32, hidden_dim=16, dim=8, queue_size=8,"
        " bn_splits=2)\n"
        "Trainer(accelerator='cpu', max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,"
        " callbacks=[KNNMonitor(k=3)]).fit(model, dm)\n"
    )
    run = run_script_forked(script, cwd=tmp_path)  # a process of its own (its stderr), without a fresh one's imports
    assert run.returncode == 0, run.stderr[-2000:]
    assert "can only test a child process" not in run.stderr and "Traceback" not in run.stderr


def test_the_number_of_workers_follows_the_machine(tmp_path, monkeypatch):
    import os

    from moco_lightning.datamodules.image_folder import default_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    assert default_workers() == 1 and ImageFolderDataModule(str(tmp_path)).num_workers == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert default_workers() == 16 and ImageFolderDataModule(str(tmp_path), num_workers=3).num_workers == 3


def test_unlabelled_folders_join_pretraining_while_the_knn_bank_stays_labelled(tmp_path, seeded):
    """Many unlabelled images beside a few labelled ones: pretraining draws from both, the kNN bank and the linear
    probe see the labelled training folder alone, the queries the labelled val folder."""
    from helpers.models import tiny_backbone, tiny_moco
    from helpers.trainers import cpu_trainer

    from moco_lightning.callbacks import KNNMonitor

    write_tree(tmp_path)  # train/ and val/: 2 classes of 4
    more = tmp_path / "more"
    more.mkdir()
    for i in range(6):
        smooth_rgb(100 + i).save(more / f"{i}.jpg")
    dm = ImageFolderDataModule(str(tmp_path), unlabelled_dirs=["more"], batch_size=4, image_size=16, num_workers=0,
                               augment_on="workers")  # fmt: skip
    dm.setup()
    pretraining, bank = dm.train_dataloader().dataset, dm.eval_train_dataloader().dataset
    assert len(pretraining) == 8 + 6 and (pretraining.targets == -1).sum() == 6
    assert len(bank) == 8 and set(bank.targets.tolist()) == {0, 1} and dm.num_classes == 2
    model = tiny_moco(backbone=tiny_backbone(3), in_channels=3, image_size=16, queue_size=8)
    knn = KNNMonitor(k=3)
    cpu_trainer(max_steps=3, callbacks=[knn], limit_val_batches=1).fit(model, datamodule=dm)
    assert model.global_step == 3 and knn.history and all(0.0 <= acc <= 1.0 for _, acc in knn.history)
    with pytest.raises(ValueError, match="unlabelled_dirs: .*nowhere is not a folder"):
        ImageFolderDataModule(str(tmp_path), unlabelled_dirs=["nowhere"], batch_size=4, num_workers=0).setup()
