"""How fast can the data side feed MoCo, per augmentation path?

    python benchmarks/data_throughput.py                 # everything (a few minutes on 2 CPU cores)
    python benchmarks/data_throughput.py --train-steps 0 # views/s only
    python benchmarks/data_throughput.py --folder-images 0

Part 1, the quickstart settings (Fashion-MNIST, 28 px, batch 256, MoCo v2 preset: blur off at 28 px):
  a. views/s of the per-image PIL path: lightly's ``MoCoV2Transform`` in a DataLoader with 0, 1, 2
     workers (what a torchvision-style pipeline does);
  b. views/s of the batched tensor path: uint8 batches from the loader, then :class:`BatchViews` on the
     device (what :class:`FashionMNISTDataModule` does);
  c. a few training steps of the real quickstart model ``MoCo(backbone="resnet18", width=0.5, in_channels=1,
     channels_last=True, queue_size=4096, hidden_dim=512)`` with each path, under a Lightning ``Trainer``: the time per
     step and the
     fraction of it spent waiting for the batch (from the end of one step to the start of the next:
     fetching, transfer and, for the tensor path, ``BatchViews``).
Part 2, an image folder (synthetic JPEGs, 500x375, written to a temporary folder), per image decoded
with PIL in the workers: the ``ImageFolderDataModule`` paths ("workers": whole lightly transform per
image; "device": two random resized crops per image in the workers + batched colour ops) and a
third variant (decode + resize the whole image to a fixed square in the workers, then the full
``BatchViews`` with its crop) for comparison.

Every number is printed with its settings. Wall-clock times on a shared machine vary by ~10 %.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

# the model of configs/quickstart.yaml
QUICKSTART_MODEL = dict(
    backbone="resnet18",
    width=0.5,
    in_channels=1,
    image_size=28,
    channels_last=True,
    hidden_dim=512,
    queue_size=4096,
    momentum=0.99,
    temperature=0.2,
    lr=0.06,
)

from moco_lightning.datamodules import FashionMNISTDataModule, ImageFolderDataModule, view_settings  # noqa: E402
from moco_lightning.datamodules.image_folder import load_image  # noqa: E402


# --- part 1: Fashion-MNIST -------------------------------------------------------------------------
class PILViewsDataset(Dataset):
    """uint8 images -> PIL -> a per-image two-view transform."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, transform: Callable) -> None:
        self.images, self.targets, self.transform = images, targets, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        img = Image.fromarray(self.images[i, 0].numpy(), "L")
        return self.transform(img), self.targets[i], i


def pil_loader(images, targets, transform, batch_size: int, workers: int, seed: int = 0) -> DataLoader:
    return DataLoader(
        PILViewsDataset(images, targets, transform),
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )


def time_epoch(loader: DataLoader, make_views: Callable[[object], List[torch.Tensor]], device: torch.device) -> float:
    """Views per second of a whole epoch of ``loader``, after one warm-up epoch (worker start-up).

    Workers persist between epochs, and a new epoch's prefetching starts when it is iterated, so the
    timed epoch pays for every batch it gets.
    """
    rate = 0.0
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        n = 0
        for batch in loader:
            n += sum(len(v) for v in make_views(batch))
        _sync(device)
        rate = n / (time.perf_counter() - t0)
    return rate


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def part1(args, device: torch.device) -> None:
    dm = FashionMNISTDataModule(data_dir=args.data_dir, batch_size=args.batch_size, image_size=28)
    dm.setup()
    train = dm._splits["train"]
    images, targets = train.images, train.targets
    transform = view_settings("moco_v2", 28).pil_views(dm.mean, dm.std)  # lightly MoCoV2Transform, blur off
    print("\n== Part 1: quickstart settings ==")
    print(f"dataset: Fashion-MNIST train ({len(images)} images, 1x28x28 uint8) from {dm._find_dir()}")
    print(
        f"batch {args.batch_size}, 2 views of 28x28, preset moco_v2 at 28 px: crop 0.2-1, flip 0.5, jitter "
        "(0.4, 0.4, 0.4, 0.1) p 0.8, grayscale 0.2 (a no-op on 1 channel), blur off, normalise"
    )
    print(
        f"PIL path: {type(transform).__module__}.{type(transform).__name__}(input_size=28, gaussian_blur=0) per image"
    )
    print(f"tensor path: BatchViews on {device} after the loader (num_workers=0), one seeded generator")
    print(
        f"each views/s: one epoch of {args.batches} batches ({args.batches * args.batch_size} images), timed after "
        "a warm-up epoch; persistent workers\n"
    )

    n = args.batches * args.batch_size
    results = {}
    for w in args.workers:
        loader = pil_loader(images[:n], targets[:n], transform, args.batch_size, w)
        rate = time_epoch(loader, lambda b: [v.to(device) for v in b[0]], device)
        results[f"PIL per-image, {w} worker(s)"] = rate
        print(f"  PIL per-image lightly MoCoV2Transform, num_workers={w}: {rate:10.0f} views/s", flush=True)
    sub = FashionMNISTDataModule(data_dir=args.data_dir, batch_size=args.batch_size, train_subset=n)
    sub.setup()
    views = sub.views.to(device)
    g = torch.Generator(device=device).manual_seed(0)
    rate = time_epoch(sub.train_dataloader(), lambda b: views(b[0].to(device), g), device)
    results["BatchViews"] = rate
    print(f"  BatchViews batched on {device}, num_workers=0:            {rate:10.0f} views/s", flush=True)
    base = results[f"PIL per-image, {args.workers[0]} worker(s)"]
    print(f"  -> BatchViews / PIL({args.workers[0]} workers) = {rate / base:.1f}x")
    if args.kornia:
        kornia_views = kornia_pipeline(dm.mean, dm.std, device)
        rates = {"BatchViews": [], "kornia": []}
        for _ in range(args.kornia):  # interleaved, median
            rates["BatchViews"].append(time_epoch(sub.train_dataloader(), lambda b: views(b[0].to(device), g), device))
            rates["kornia"].append(time_epoch(sub.train_dataloader(), lambda b: kornia_views(b[0].to(device)), device))
        med = {k: sorted(v)[len(v) // 2] for k, v in rates.items()}
        print(
            f"  kornia {kornia_version()} AugmentationSequential (RandomResizedCrop 0.2-1, flip, ColorJitter(0.4, 0.4) "
            f"p 0.8, Normalize), batched on {device}: {med['kornia']:10.0f} views/s vs BatchViews "
            f"{med['BatchViews']:.0f} (median of {args.kornia} interleaved runs): kornia / BatchViews = "
            f"{med['kornia'] / med['BatchViews']:.2f}x",
            flush=True,
        )

    if args.train_steps > 0:
        part1_training(args, dm, images, targets, transform, device)


def kornia_version() -> str:
    import kornia

    return kornia.__version__


def kornia_pipeline(mean, std, device):
    """kornia's equivalent of the quickstart views on a one-channel batch (saturation, hue and grayscale are no-ops
    on one channel in both): it draws from torch's global RNG, there is no generator argument to seed and save."""
    import kornia.augmentation as K

    aug = K.AugmentationSequential(
        K.RandomResizedCrop((28, 28), scale=(0.2, 1.0)),
        K.RandomHorizontalFlip(),
        K.ColorJitter(0.4, 0.4, p=0.8),
        K.Normalize(torch.tensor(mean), torch.tensor(std)),
    ).to(device)
    return lambda images: [aug(images.float() / 255) for _ in range(2)]


def part1_training(args, dm, images, targets, transform, device) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    try:
        from moco_lightning import MoCo
    except Exception as e:  # pragma: no cover - the module not importable yet
        print(f"\n(MoCo does not import: {e}; skipping the training-step timing)")
        return

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.wait: List[float] = []
            self.step: List[float] = []

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.mark = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            _sync(device)
            now = time.perf_counter()
            self.wait.append(now - self.mark)
            self.t0 = now

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            _sync(device)
            now = time.perf_counter()
            self.step.append(now - self.t0)
            self.mark = now

    class PILDataModule(pl.LightningDataModule):
        def __init__(self, workers: int) -> None:
            super().__init__()
            self.workers = workers

        def train_dataloader(self):
            return pil_loader(images, targets, transform, args.batch_size, self.workers)

    n = args.train_steps + 1
    print(
        f"\n  Training steps: MoCo(**{QUICKSTART_MODEL}), batch {args.batch_size}, "
        f"Trainer(accelerator={device.type!r}, max_epochs=1, max_steps={n}, "
        f"precision=32), torch threads {torch.get_num_threads()}; first step (warm-up) not counted"
    )
    for name, make_dm in [
        *[(f"PIL per-image, {w} worker(s)", (lambda w=w: PILDataModule(w))) for w in args.workers],
        ("BatchViews batched", lambda: FashionMNISTDataModule(data_dir=args.data_dir, batch_size=args.batch_size)),
    ]:
        pl.seed_everything(0, verbose=False)
        model = MoCo(**QUICKSTART_MODEL)
        timer = StepTimer()
        trainer = pl.Trainer(
            accelerator=device.type,
            devices=1,
            max_epochs=1,
            max_steps=n,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer],
        )
        trainer.fit(model, datamodule=make_dm())
        wait, step = sum(timer.wait[1:]), sum(timer.step[1:])
        k = len(timer.step) - 1
        print(
            f"  {name:28s}: {(wait + step) / k:7.3f} s/step, waiting for data {wait / k:6.3f} s/step "
            f"= {100 * wait / (wait + step):5.1f} % of the step",
            flush=True,
        )


# --- part 2: an image folder --------------------------------------------------------------------
def write_jpeg_folder(root: Path, n: int, size=(500, 375)) -> None:
    """n smooth random colour images (JPEG quality 90) in two class folders."""
    rng = np.random.default_rng(0)
    for i in range(n):
        small = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize(size, Image.BICUBIC)
        folder = root / "train" / f"class_{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"{i:05d}.jpg", quality=90)


class ResizeDataset(Dataset):
    """Decode (with JPEG draft mode) + resize the whole image to load_size x load_size, as uint8."""

    def __init__(self, paths: List[str], load_size: int) -> None:
        self.paths, self.load_size = paths, load_size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        with open(self.paths[i], "rb") as f:
            img = Image.open(f)
            img.draft("RGB", (self.load_size, self.load_size))
            img = img.convert("RGB").resize((self.load_size, self.load_size), Image.BILINEAR)
        return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1), 0, i


def part2(args, device: torch.device) -> None:
    size = args.folder_size
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_jpeg_folder(root, args.folder_images)
        bs = args.folder_batch_size
        print("\n== Part 2: image folder ==")
        print(
            f"{args.folder_images} synthetic JPEGs 500x375 (q 90) in {root}; views {size}x{size}, preset moco_v2 "
            f"(blur p 0.5 on), batch {bs}, one epoch timed after a warm-up epoch; batched ops on {device}"
        )
        for w in args.workers:
            for aug in ("workers", "device"):
                dm = ImageFolderDataModule(str(root), batch_size=bs, image_size=size, num_workers=w, augment_on=aug)
                dm.setup()
                views = dm.views.to(device) if dm.views is not None else None
                g = torch.Generator(device=device).manual_seed(0)
                if aug == "workers":
                    fn = lambda b: [v.to(device) for v in b[0]]  # noqa: E731
                    what = "PIL: decode + lightly MoCoV2Transform x2 in workers"
                else:
                    fn = lambda b, views=views, g=g: views(b[0].to(device), g)  # noqa: E731
                    what = "decode + 2 crops in workers, colour batched"
                rate = time_epoch(dm.train_dataloader(), fn, device)
                print(f"  augment_on={aug!r:9s} num_workers={w}: {rate:8.0f} views/s  ({what})", flush=True)
            paths = sorted(str(p) for p in (root / "train").rglob("*.jpg"))
            load = round(size * 256 / 224)
            loader = DataLoader(
                ResizeDataset(paths, load),
                batch_size=bs,
                shuffle=True,
                drop_last=True,
                num_workers=w,
                persistent_workers=w > 0,
            )
            full = view_settings("moco_v2", size).batch_views(dm.mean, dm.std).to(device)
            g = torch.Generator(device=device).manual_seed(0)
            rate = time_epoch(loader, lambda b, full=full, g=g: full(b[0].to(device), g), device)
            print(
                f"  (variant)              num_workers={w}: {rate:8.0f} views/s  (decode+resize to {load}^2 in "
                "workers, full BatchViews incl. crop)",
                flush=True,
            )
        # what each path costs a worker, per image, on one core: with a GPU doing the batched part, this is
        # what bounds the throughput (images/s = workers / cost)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        k = min(64, len(paths))
        print(f"  worker-side CPU cost per image, one process, 1 torch thread, {k} images:")
        t0 = time.perf_counter()
        for p in paths[:k]:
            load_image(p)
        print(f"    decode + convert only:                          {1000 * (time.perf_counter() - t0) / k:6.1f} ms")
        for aug in ("workers", "device"):
            dm = ImageFolderDataModule(str(root), batch_size=bs, image_size=size, num_workers=0, augment_on=aug)
            dm.setup()
            ds = dm._splits["train"]
            t0 = time.perf_counter()
            for i in range(k):
                ds[(i, 0)]
            what = (
                "decode + lightly MoCoV2Transform x2" if aug == "workers" else "decode + 2 random resized crops (uint8)"
            )
            print(f"    augment_on={aug!r:9s} {what:38s} {1000 * (time.perf_counter() - t0) / k:6.1f} ms")
        rd = ResizeDataset(paths, load)
        t0 = time.perf_counter()
        for i in range(k):
            rd[i]
        print(
            f"    (variant) decode (draft) + resize to {load}^2:          "
            f"{1000 * (time.perf_counter() - t0) / k:6.1f} ms"
        )
        dm = ImageFolderDataModule(str(root), batch_size=bs, image_size=size, num_workers=0, augment_on="device")
        dm.setup()
        batch = torch.stack([dm._splits["train"][(i, 0)][0] for i in range(bs)])
        g = torch.Generator().manual_seed(0)
        dm.views(batch, g)
        t0 = time.perf_counter()
        dm.views(batch, g)
        print(
            f"    (device part of augment_on='device' on this CPU, batched: "
            f"{1000 * (time.perf_counter() - t0) / bs:6.1f} ms "
            "per image; on a GPU it leaves the workers)"
        )
        torch.set_num_threads(threads)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST folder (default: the Debian package's)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=8, help="timed batches per views/s measurement")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train-steps", type=int, default=3, help="timed MoCo training steps per path (0: skip)")
    p.add_argument("--folder-images", type=int, default=192, help="synthetic JPEGs for part 2 (0: skip)")
    p.add_argument("--folder-size", type=int, default=224)
    p.add_argument("--folder-batch-size", type=int, default=32)
    p.add_argument("--kornia", type=int, default=5, help="interleaved runs of kornia vs BatchViews (0: skip)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads of the main process (default: torch's choice). On a busy shared "
        "machine 1 avoids OpenMP threads waiting on each other (small ops were 45x slower with 2)",
    )
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs "
        f"(torch threads {torch.get_num_threads()}), device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    print("command: " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    print("load average at start (1/5/15 min): %.1f %.1f %.1f" % os.getloadavg())
    part1(args, device)
    if args.folder_images > 0:
        part2(args, device)
    print("\nload average at end (1/5/15 min): %.1f %.1f %.1f" % os.getloadavg())


if __name__ == "__main__":
    main()
