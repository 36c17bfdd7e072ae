"""Dataset files written in their real formats (CIFAR pickles, STL-10 binaries, Fashion-MNIST idx, image folders of
JPEG/PNG files): nothing is downloaded."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
from PIL import Image


def write_cifar10(root: Path, n=24, bytes_keys=False):
    """The python version's files: data_batch_1..5 and test_batch (dict: data (N, 3072) uint8 R|G|B planes, labels)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        entry = {"batch_label": name, "data": data, "labels": labels, "filenames": [f"{i}.png" for i in range(n)]}
        if bytes_keys:  # how Python 2 pickles read back without an encoding
            entry = {k.encode(): v for k, v in entry.items()}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
        written[name] = (data, labels)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return written


def write_cifar100(root: Path, n=40):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for name in ("train", "test"):
        fine = [int(v) for v in rng.integers(0, 100, n)]
        fine[0] = 99
        entry = {
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "fine_labels": fine,
            "coarse_labels": [v // 5 for v in fine],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f)


def write_stl10(root: Path, n_train=20, n_test=12, n_unlabeled=30):
    """stl10_binary/*_X.bin: uint8 images 3x96x96, each channel stored column-major; *_y.bin: uint8 labels 1..10."""
    folder = root / "stl10_binary"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    images = {}
    for split, n in (("train", n_train), ("test", n_test), ("unlabeled", n_unlabeled)):
        chw = rng.integers(0, 256, (n, 3, 96, 96), dtype=np.uint8)
        (folder / f"{split}_X.bin").write_bytes(chw.transpose(0, 1, 3, 2).tobytes())
        images[split] = chw
        if split != "unlabeled":
            (folder / f"{split}_y.bin").write_bytes((np.arange(n) % 10 + 1).astype(np.uint8).tobytes())
    return images


def smooth_rgb(seed, size=(48, 40)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)).resize(size, Image.BILINEAR)


def write_tree(root: Path, n_per_class=4, classes=("cat", "dog"), splits=("train", "val")):
    """<root>/<split>/<class>/*.jpg|png, one image in a nested folder, plus files that are not images."""
    k = 0
    for split in splits:
        for c in classes:
            folder = root / split / c
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n_per_class):
                img = smooth_rgb(k)
                k += 1
                if i == n_per_class - 1:
                    (folder / "nested").mkdir(exist_ok=True)
                    img.save(folder / "nested" / f"{i}.png")
                else:
                    img.save(folder / f"{i}.jpg" if i % 2 == 0 else folder / f"{i}.PNG", quality=95)
            (folder / "notes.txt").write_text("not an image")
            (folder / ".hidden.jpg").write_bytes(b"ignored")
    return root


def write_idx(path, array, compress=True):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    (gzip.open if compress else open)(path, "wb").write(data)


def fake_fashion(folder, n_train=40, n_test=20, compress=True):
    rng = np.random.default_rng(0)
    suffix = ".gz" if compress else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28)), compress)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", np.arange(n) % 10, compress)
    return folder


def write_fashion_folder(root: Path, classes=(0, 1, 7), n_train=30, n_val=10, n_unlabelled=30) -> Path:
    """A user's folder as the issue tried it: Fashion-MNIST images written as PNG class folders ``train/`` and
    ``val/`` (every other image saved RGB, the rest grayscale) and a folder ``unlabelled/`` of images without classes;
    the images of each part are distinct images of Debian's training split."""
    from moco_lightning.datamodules.fashion_mnist import DEBIAN_DIR, read_idx

    images = read_idx(Path(DEBIAN_DIR) / "train-images-idx3-ubyte.gz")[:4000]
    labels = read_idx(Path(DEBIAN_DIR) / "train-labels-idx1-ubyte.gz")[:4000]
    names = {0: "t-shirt", 1: "trouser", 7: "sneaker"}
    k, used = 0, []
    for c in classes:
        rows = np.flatnonzero(labels == c)
        for split, picked in (("train", rows[:n_train]), ("val", rows[n_train : n_train + n_val])):
            folder = root / split / names.get(c, str(c))
            folder.mkdir(parents=True, exist_ok=True)
            used += list(picked)
            for i in picked:
                image = Image.fromarray(images[i])
                (image.convert("RGB") if k % 2 else image).save(folder / f"{i}.png")
                k += 1
    (root / "unlabelled").mkdir(parents=True, exist_ok=True)
    others = np.setdiff1d(np.arange(len(labels)), used)[:n_unlabelled]  # further images, of any class, no labels
    for i in others:
        Image.fromarray(images[i]).save(root / "unlabelled" / f"{i}.png")
    return root
