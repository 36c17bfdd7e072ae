"""The DALI backend of the image-folder datamodule, on CPU-only DALI pipelines (device_id=None)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.files import write_tree

from moco_lightning.datamodules import ImageFolderDataModule
from moco_lightning.datamodules.dali import DaliLoader

ROOT = Path(__file__).resolve().parents[1]


def folder(tmp_path, n=8):
    write_tree(tmp_path, n_per_class=n)
    return str(tmp_path)


def dm(root, **kw):
    args = dict(batch_size=4, image_size=32, num_workers=1, backend="dali")
    args.update(kw)
    d = ImageFolderDataModule(root, **args)
    d.setup()
    return d


def test_training_batches_follow_the_contract_and_epochs_are_seeded(tmp_path):
    d = dm(folder(tmp_path), local_views=2, local_size=16)
    loader = d.train_dataloader()
    assert len(loader) == 16 // 4 and loader.batch_size == 4 and loader.equal_batches
    epoch0 = list(loader)
    (v1, v2, l1, l2), targets, index = epoch0[0]
    assert v1.shape == v2.shape == (4, 3, 32, 32) and l1.shape == l2.shape == (4, 3, 16, 16)
    assert v1.dtype == torch.float32 and abs(v1.mean().item()) < 1.5 and not torch.equal(v1, v2)
    ds = d._splits["train"]
    assert torch.equal(targets, ds.targets[index])  # each label is its file's class
    assert sorted(torch.cat([b[2] for b in epoch0]).tolist()) == list(range(16))  # every image once per epoch
    again = list(loader)  # the same epoch again: the same order and the same views (what a resume sees)
    assert all(torch.equal(a[0][0], b[0][0]) and torch.equal(a[2], b[2]) for a, b in zip(epoch0, again))
    loader.set_epoch(1)
    epoch1 = list(loader)
    assert not torch.equal(epoch1[0][2], epoch0[0][2])  # a new order (SeededRandomSampler's, epoch 1)


def test_ranks_get_equal_disjoint_shards(tmp_path):
    d = dm(folder(tmp_path, n=5))  # 10 images, 2 ranks: 5 each, one batch of 4 per rank
    ds = d._splits["train"]
    shards = [
        DaliLoader(ds.paths, ds.targets.tolist(), "pretrain", d.view_settings, d.mean, d.std, 4, rank=r, world=2)
        for r in (0, 1)
    ]
    orders = [s.order() for s in shards]
    assert len(orders[0]) == len(orders[1]) == 5 and len(shards[0]) == len(shards[1]) == 1
    assert set(orders[0]) | set(orders[1]) == set(range(10)) and not set(orders[0]) & set(orders[1])


def test_evaluation_loader_is_every_file_in_order_close_to_the_pil_transform(tmp_path):
    root = folder(tmp_path)
    dali, pil = dm(root), dm(root, backend="pil", num_workers=0)
    a, b = list(dali.eval_train_dataloader()), list(pil.eval_train_dataloader())
    assert torch.equal(torch.cat([x[2] for x in a]), torch.arange(16)) and torch.equal(
        torch.cat([x[1] for x in a]), torch.cat([x[1] for x in b])
    )
    xa, xb = torch.cat([x[0] for x in a]), torch.cat([x[0] for x in b])
    assert xa.shape == xb.shape and (xa - xb).abs().mean() < 0.15  # resampling filters differ, the content does not
    # the same normalisation, channel by channel (a missing or swapped one moves these by > 0.5), the same pixels
    torch.testing.assert_close(xa.mean((0, 2, 3)), xb.mean((0, 2, 3)), rtol=0, atol=0.05)
    assert torch.corrcoef(torch.stack([xa.flatten(), xb.flatten()]))[0, 1] > 0.97  # measured 0.987


def test_grayscale_and_linear_evaluation_views(tmp_path):
    d = dm(folder(tmp_path), in_channels=1, pretrain=False)
    x, y, i = next(iter(d.train_dataloader()))
    assert x.shape == (4, 1, 32, 32) and y.shape == (4,)


@pytest.mark.slow  # a subprocess / several processes
def test_trains_moco_through_the_cli_with_backend_dali(tmp_path):
    """The issue's must-show: configs/moco_v2.yaml with --data.init_args.backend dali, on the CPU."""
    import subprocess

    root = folder(tmp_path)
    exe = Path(sys.executable).with_name("moco-lightning")
    out = subprocess.run(
        [
            str(exe),
            "fit",
            "--config",
            str(ROOT / "configs" / "moco_v2.yaml"),
            "--trainer.fast_dev_run=2",
            "--trainer.accelerator=cpu",
            f"--data.init_args.data_dir={root}",
            "--data.init_args.backend=dali",
            "--data.init_args.batch_size=8",
            "--data.init_args.image_size=32",
            "--model.bn_splits=2",
            "--data.init_args.num_workers=1",
            "--model.backbone=resnet18",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in out.stderr + out.stdout


def test_missing_dali_says_how_to_install(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_dali(name, *a, **k):
        if name.startswith("nvidia.dali"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_dali)
    with pytest.raises(ValueError, match=r"pip install \"moco-lightning\[dali\]\""):
        ImageFolderDataModule(folder(tmp_path), backend="dali")


def test_views_are_seeded_by_the_seed(tmp_path):
    root = folder(tmp_path)
    a = next(iter(dm(root, seed=0).train_dataloader()))[0][0]
    b = next(iter(dm(root, seed=0).train_dataloader()))[0][0]
    c = next(iter(dm(root, seed=1).train_dataloader()))[0][0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert np.isfinite(a.numpy()).all()


@pytest.mark.slow  # a subprocess / several processes
def test_pipeline_seed_is_the_same_in_every_process():
    """Python salts string hashes per process: the former hash((seed, epoch, rank, "pretrain")) drew other views in
    a resumed run. A process with another string-hash salt (a fresh interpreter, PYTHONHASHSEED chosen to differ from
    this one's) must agree with this one."""
    import os
    import subprocess
    import sys

    seed = (
        "from moco_lightning.datamodules.dali import DaliLoader; from moco_lightning.datamodules.transforms import "
        "view_settings; l = DaliLoader(['a.jpg'], [0], 'pretrain', view_settings('moco_v2', 32), (0.5,), (0.5,), 1, "
        "seed=3, rank=1); l.set_epoch(2); seed = l.pipeline_seed()"
    )
    here: dict = {}
    exec(seed, here)
    salt = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    env = {**os.environ, "PYTHONHASHSEED": salt}
    code = seed + "; print(seed, hash('pretrain'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout.split()
    assert int(other[1]) != hash("pretrain")  # the two processes salt strings differently
    assert int(other[0]) == here["seed"]


def test_a_resumed_epoch_replays_the_pipeline_and_yields_the_remaining_batches_with_their_views(tmp_path):
    d = dm(folder(tmp_path))
    loader = d.train_dataloader()
    whole = list(loader)
    assert loader.state_dict() == {"epoch": 0, "batches": 4, "batch_size": 4, "samples": 16}
    resumed = d.train_dataloader()
    resumed.load_state_dict({"epoch": 0, "batches": 3})
    rest = list(resumed)
    assert len(rest) == 1 and resumed.state_dict() == {"epoch": 0, "batches": 4, "batch_size": 4, "samples": 16}
    assert torch.equal(rest[0][2], whole[3][2]) and torch.equal(rest[0][0][0], whole[3][0][0])
    other = d.train_dataloader()
    other.set_epoch(1)
    other.load_state_dict({"epoch": 0, "batches": 4})  # saved at the end of epoch 0: epoch 1 starts at its start
    assert len(list(other)) == 4


def test_evaluation_loaders_decode_only_their_ranks_share(tmp_path):
    """Under DDP each rank's evaluation loader holds the files rank::world (it decoded all of them, and the kNN
    bank's sharding then dropped (world - 1) / world); the callbacks' shard() takes them as they are."""
    from moco_lightning.callbacks._utils import shard

    d = dm(folder(tmp_path, n=5))  # 10 files
    ds = d._eval_splits["train"]
    loaders = [
        DaliLoader(ds.paths, ds.targets.tolist(), "eval", d.view_settings, d.mean, d.std, 4, rank=r, world=2)
        for r in (0, 1)
    ]
    indices = [torch.cat([b[2] for b in loader]) for loader in loaders]
    assert indices[0].tolist() == [0, 2, 4, 6, 8] and indices[1].tolist() == [1, 3, 5, 7, 9]
    assert len(loaders[0]) == 2 and loaders[1].rank_shard == (1, 2)
    mine = list(shard(loaders[1], 1, 2))  # nothing dropped again
    assert torch.equal(torch.cat([y for _, y in mine]), ds.targets[indices[1]])
    limited = list(shard(loaders[1], 1, 2, limit=6))  # the first 6 samples of the split: rank 1 has 1, 3, 5
    assert torch.equal(torch.cat([y for _, y in limited]), ds.targets[[1, 3, 5]])


def test_unreadable_files_are_named_or_stood_in_for_within_their_class(tmp_path):
    """4 unreadable files among 54 (as a new user tried: a 99-line "nvImageCodec failure" naming no file, and
    skip_bad_images ignored): the error names every one of them; with skip_bad_images the epoch goes on, each read
    as another image of its class (the labels stay right), and the datamodule lists them."""
    from moco_lightning.datamodules import BadImageError

    write_tree(tmp_path, n_per_class=25, splits=("train",))
    (tmp_path / "train" / "dog" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg" * 10)
    (tmp_path / "train" / "dog" / "text.jpg").write_text("not an image")
    good = (tmp_path / "train" / "cat" / "0.jpg").read_bytes()
    (tmp_path / "train" / "cat" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (tmp_path / "train" / "cat" / "empty.png").write_bytes(b"")
    with pytest.raises(BadImageError) as raised:
        list(dm(str(tmp_path), batch_size=8).train_dataloader())
    message = str(raised.value)
    named = ("cat/empty.png", "cat/truncated.jpg", "dog/corrupt.jpg", "dog/text.jpg")
    assert all(f"{n}: cannot be read as an image" in message for n in named) and "4 unreadable of the 54" in message
    skipping = dm(str(tmp_path), batch_size=8, skip_bad_images=True)
    with pytest.warns(RuntimeWarning, match="skip_bad_images: .* cannot be read"):
        batches = list(skipping.train_dataloader())
    assert len(batches) == 54 // 8 and all(b[0][0].shape == (8, 3, 32, 32) for b in batches)
    ds = skipping._splits["train"]
    index = torch.cat([b[2] for b in batches])
    assert len(set(index.tolist())) == 48 and all(torch.equal(b[1], ds.targets[b[2]]) for b in batches)
    met = {ds.paths[i].split("train/")[1] for i in index.tolist()} & set(named)  # the bad files this epoch drew
    assert met and {p.split("train/")[1] for p in skipping.bad_images} >= met


def test_fused_decode_and_crop_gives_seeded_views_of_every_image(tmp_path):
    """dali_fused_crop: each view decodes only its crop window (fn.decoders.image_random_crop); the contract, the
    seeding and the order are the decode-then-crop path's."""
    root = folder(tmp_path)
    fused = dm(root, dali_fused_crop=True, local_views=1, local_size=16)
    a, b = list(fused.train_dataloader()), list(fused.train_dataloader())
    (v1, v2, l1), targets, index = a[0]
    assert v1.shape == v2.shape == (4, 3, 32, 32) and l1.shape == (4, 3, 16, 16) and not torch.equal(v1, v2)
    assert all(torch.equal(x[0][0], y[0][0]) for x, y in zip(a, b))  # the same epoch, the same views
    plain = list(dm(root).train_dataloader())
    assert all(torch.equal(x[2], y[2]) for x, y in zip(a, plain))  # the same order
    assert not torch.equal(a[0][0][0], plain[0][0][0])  # other crops: decoded windows, not crops of a whole decode
    assert float(v1.std()) > 0.1  # normalised pixels, not a blank
    with pytest.raises(ValueError, match="dali_fused_crop=true needs backend='dali'"):
        ImageFolderDataModule(root, backend="pil", dali_fused_crop=True)


def views_of(tmp_path, pixels: np.ndarray, mode: str, n: int = 32, **settings) -> torch.Tensor:
    """``n`` copies of one PNG (lossless) through a DALI loader of ``mode``; its first view, (n, 3, 32, 32)."""
    from PIL import Image

    from moco_lightning.datamodules.transforms import view_settings

    tmp_path.mkdir()
    paths = []
    for i in range(n):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(pixels).save(paths[-1])
    st = view_settings("moco_v2", 32, **settings)
    loader = DaliLoader(paths, [0] * n, mode, st, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), n, seed=0)
    batch = next(iter(loader))
    return batch[0][0] if mode == "pretrain" else batch[0]


def test_training_views_are_normalised_cropped_flipped_and_jittered(tmp_path):
    """DALI's training views, each operation checked on an image that shows it: a constant colour comes out as
    (colour / 255 - mean) / std exactly; a horizontal ramp shows the crop (a window of 24.5 % to 100 % of the width)
    and the flip (about half the views run backwards); colour jitter changes about 84 % of the views of a constant
    colour (p 0.8, grayscale p 0.2; neither: 16 %)."""
    colour = np.array([200, 100, 50], dtype=np.uint8)
    flat = views_of(tmp_path / "flat", np.broadcast_to(colour, (48, 64, 3)).copy(), "linear")
    expected = (torch.tensor(colour / 255.0) - torch.tensor([0.5, 0.4, 0.3])) / torch.tensor([0.2, 0.25, 0.3])
    torch.testing.assert_close(flat, expected.float().view(1, 3, 1, 1).expand_as(flat), rtol=0, atol=1e-4)

    ramp = np.broadcast_to(np.linspace(0, 255, 256).astype(np.uint8)[None, :, None], (256, 256, 3)).copy()
    x = views_of(tmp_path / "ramp", ramp, "linear")[:, 0] * 0.2 + 0.5  # back to [0, 1], channel 0
    rows = x[:, 16]  # (n, 32): the ramp across the view
    span = (rows[:, -1] - rows[:, 0]).abs()  # the crop window's share of the width, in [0, 1]
    assert span.min() >= 0.2 and span.max() <= 1.0 and span.max() - span.min() > 0.3  # random windows
    backwards = (rows[:, -1] < rows[:, 0]).float().mean()
    assert 0.2 <= backwards <= 0.8  # flipped with p 0.5

    jittered = views_of(tmp_path / "jitter", np.broadcast_to(colour, (48, 64, 3)).copy(), "pretrain", n=64)
    pure = expected.float().view(1, 3, 1, 1)
    unchanged = ((jittered - pure).abs().amax(dim=(1, 2, 3)) < 1e-3).float().mean()
    assert 0.02 <= unchanged <= 0.4, unchanged
