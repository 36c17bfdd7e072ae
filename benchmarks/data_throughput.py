"""How fast can the data side feed MoCo, per data path?

    python -m benchmarks.data_throughput                                   # both parts (~10 min on 2 cores)
    python -m benchmarks.data_throughput --folder-images 0                 # Fashion-MNIST only

Part 1, Fashion-MNIST at the settings of ``configs/fashion_mnist_moco_v2.yaml`` (28 px, batch 256): views/s of the
per-image PIL path (lightly's ``MoCoV2Transform`` in a DataLoader with ``--workers``), of :class:`BatchViews` (what
the datamodule does: uint8 batches, the views batched after the transfer) and of kornia's equivalent batched
pipeline (``--kornia`` interleaved runs).

Part 2, an image folder of real photographs at ImageNet-like sizes: ``--folder-images`` JPEGs generated from
scikit-image's sample photographs (the astronaut, the cat, the coffee cup, the rocket, ...: random crops, flips and
rescalings to 333-500 px on the shorter side, q 90, one class per photograph). Views/s of ``configs/moco_v2.yaml``'s
views at ``--folder-size`` px through each path: PIL in DataLoader workers (``augment_on="workers"``, ``--workers``),
PIL crops in the workers + colour batched (``augment_on="device"``), DALI (``backend="dali"``; on this CPU a
CPU-only pipeline with ``--dali-threads``), and DALI with the fused decode-and-crop (``dali_fused_crop``: each view
decodes only its crop window). Then a few training steps of that config (its ResNet-50 at
``--folder-size`` px, batch ``--folder-batch-size``) with each path: seconds per step and the fraction of it
spent waiting for the next batch.
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, List

import numpy as np
import torch
from PIL import Image

from benchmarks._common import config_path, footer, from_config, header, parser, quiet, trainer_kwargs

PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "motorcycle_right.png",
          "hubble_deep_field.jpg", "retina.jpg", "ihc.png", "camera.png", "moon.png", "coins.png"]  # fmt: skip


def views_per_second(loader, make_views: Callable, device: torch.device, epochs: int = 2) -> float:
    """Views per second of a whole epoch of ``loader``, the last of ``epochs`` (the first warms workers up)."""
    rate = 0.0
    for _ in range(epochs):
        t0, n = time.perf_counter(), 0
        for batch in loader:
            n += sum(len(v) for v in make_views(batch))
        if device.type == "cuda":
            torch.cuda.synchronize()
        rate = n / (time.perf_counter() - t0)
    return rate


# --- part 1: Fashion-MNIST -------------------------------------------------------------------------------------
def part1(args, device: torch.device) -> None:
    from benchmarks._common import reference_loader

    _, dm = from_config(config_path("fashion_mnist_moco_v2"), f"--data.init_args.train_subset={args.batches * 256}")
    dm.setup()
    ds = dm.split_dataset("train")
    print(
        f"\n== Part 1: Fashion-MNIST, batch {dm.batch_size}, 2 views of 28 px (crop 0.2-1, flip, jitter 0.4 p 0.8) =="
    )
    for w in args.workers:
        loader = reference_loader(ds.images, ds.targets, dm.batch_size, w)
        rate = views_per_second(loader, lambda b: [v.to(device) for v in b[0]], device)
        print(f"  PIL per-image lightly MoCoV2Transform, num_workers={w}: {rate:9.0f} views/s", flush=True)
    views, g = dm.views.to(device), torch.Generator(device=device).manual_seed(0)
    cases = {"BatchViews": lambda b: views(b[0].to(device), g)}
    if args.kornia:
        cases["kornia"] = kornia_views(dm.mean, dm.std, device)
    rates = {n: [] for n in cases}
    for r in range(max(1, args.kornia)):  # interleaved
        for n in cases if r % 2 == 0 else list(cases)[::-1]:
            rates[n].append(views_per_second(dm.train_dataloader(), cases[n], device))
    med = {n: statistics.median(v) for n, v in rates.items()}
    print(f"  BatchViews batched on {device}: {med['BatchViews']:9.0f} views/s (median of {len(rates['BatchViews'])})")
    if args.kornia:
        import kornia

        print(
            f"  kornia {kornia.__version__} AugmentationSequential (RandomResizedCrop 0.2-1, flip, "
            f"ColorJitter(0.4, 0.4) p 0.8, Normalize) on {device}: {med['kornia']:9.0f} views/s: kornia / BatchViews = "
            f"{med['kornia'] / med['BatchViews']:.2f}x",
            flush=True,
        )


def kornia_views(mean, std, device) -> Callable:
    """kornia's equivalent of the views on a one-channel batch (it draws from torch's global RNG: no generator)."""
    import kornia.augmentation as K

    aug = K.AugmentationSequential(
        K.RandomResizedCrop((28, 28), scale=(0.2, 1.0)),
        K.RandomHorizontalFlip(),
        K.ColorJitter(0.4, 0.4, p=0.8),
        K.Normalize(torch.tensor(mean), torch.tensor(std)),
    ).to(device)
    return lambda b: [aug(b[0].to(device).float() / 255) for _ in range(2)]


# --- part 2: a folder of photographs ---------------------------------------------------------------------------
def write_photo_folder(root: Path, n: int, seed: int = 0) -> None:
    """``n`` JPEGs (class = source photograph) cut and rescaled from scikit-image's sample photographs."""
    spec = importlib.util.find_spec("skimage")
    if spec is None:
        raise SystemExit("part 2 needs scikit-image's sample photographs: pip install 'moco-lightning[bench]'")
    data = Path(spec.submodule_search_locations[0]) / "data"
    photos = [Image.open(data / name).convert("RGB") for name in PHOTOS]
    rng = np.random.default_rng(seed)
    for i in range(n):
        k = i % len(photos)
        img = photos[k]
        area = rng.uniform(0.3, 1.0)
        w, h = int(img.width * np.sqrt(area)), int(img.height * np.sqrt(area))
        left, top = rng.integers(0, img.width - w + 1), rng.integers(0, img.height - h + 1)
        crop = img.crop((left, top, left + w, top + h))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        short = int(rng.integers(333, 501))
        size = (short * 4 // 3, short) if crop.width >= crop.height else (short, short * 4 // 3)
        folder = root / "train" / Path(PHOTOS[k]).stem
        folder.mkdir(parents=True, exist_ok=True)
        crop.resize(size, Image.BICUBIC).save(folder / f"{i:05d}.jpg", quality=90)


def folder_datamodule(args, root: Path, *overrides: str):
    d = "--data.init_args."
    return from_config(
        config_path("moco_v2"),
        f"{d}data_dir={root}",
        f"{d}val_dir=null",
        f"{d}image_size={args.folder_size}",
        f"{d}batch_size={args.folder_batch_size}",
        *overrides,
    )


def part2(args, device: torch.device) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        write_photo_folder(root, args.folder_images)
        print(
            f"\n== Part 2: {args.folder_images} photographs (JPEG q 90, 333-500 px short side, {len(PHOTOS)} classes) "
            f"written in {time.perf_counter() - t:.0f} s; configs/moco_v2.yaml's views at {args.folder_size} px, batch "
            f"{args.folder_batch_size} ==",
            flush=True,
        )
        d = "--data.init_args."
        paths = {
            f"PIL workers, num_workers={w}": (f"{d}augment_on=workers", f"{d}num_workers={w}") for w in args.workers
        }
        paths["PIL crops + colour batched, num_workers=2"] = (
            "--data.init_args.augment_on=device",
            "--data.init_args.num_workers=2",
        )
        if args.dali_threads:
            paths[f"DALI (CPU pipeline), {args.dali_threads} threads"] = (
                "--data.init_args.backend=dali",
                f"--data.init_args.num_workers={args.dali_threads}",
            )
            paths[f"DALI fused decode-crop, {args.dali_threads} threads"] = (
                *paths[f"DALI (CPU pipeline), {args.dali_threads} threads"],
                "--data.init_args.dali_fused_crop=true",
            )
        rates = {}
        for name, overrides in paths.items():
            _, dm = folder_datamodule(args, root, *overrides)
            dm.setup()
            g = torch.Generator(device=device).manual_seed(0)
            if dm.views is not None:  # uint8 crops from the workers, colour batched here
                colour = dm.views.to(device)
                make = lambda b, v=colour, g=g: v(b[0], g)  # noqa: E731
            else:  # views made by the workers or by DALI
                make = lambda b: [v.to(device) for v in b[0]]  # noqa: E731
            rates[name] = views_per_second(dm.train_dataloader(), make, device)
            print(f"  {name:45s} {rates[name]:7.0f} views/s", flush=True)
        best_pil = max(v for n, v in rates.items() if n.startswith("PIL"))
        for n, v in rates.items():
            if n.startswith("DALI"):
                print(f"  -> DALI / best PIL = {v / best_pil:.2f}x (goal >= 2)")
        if args.train_steps:
            print(
                f"\n  training steps of configs/moco_v2.yaml ({args.folder_size} px, batch {args.folder_batch_size}, "
                f"{args.train_steps} timed after 1): seconds per step, waiting for the next batch",
                flush=True,
            )
            for name, overrides in paths.items():
                step, wait = timed_steps(args, root, overrides)
                print(
                    f"  {name:45s} {step:6.2f} s/step, waiting {wait:5.2f} s = {100 * wait / step:5.1f} %", flush=True
                )


def timed_steps(args, root: Path, overrides) -> tuple[float, float]:
    import lightning.pytorch as pl

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.wait: List[float] = []
            self.whole: List[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            now = time.perf_counter()
            if hasattr(self, "end"):
                self.wait.append(now - self.end)
                self.whole.append(now - self.start)
            self.start = self.end if hasattr(self, "end") else now

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.end = time.perf_counter()

    torch.manual_seed(0)
    model, dm = folder_datamodule(args, root, *overrides, "--model.bn_splits=4")
    timer = Timer()
    pl.Trainer(**trainer_kwargs(args.train_steps + 2, [timer])).fit(model, datamodule=dm)
    return statistics.median(timer.whole[1:]), statistics.median(timer.wait[1:])


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--batches", type=int, default=8, help="Fashion-MNIST batches per views/s measurement")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--kornia", type=int, default=5, help="interleaved runs of kornia vs BatchViews (0: skip)")
    p.add_argument("--folder-images", type=int, default=256, help="generated photographs for part 2 (0: skip)")
    p.add_argument("--folder-size", type=int, default=64)
    p.add_argument("--folder-batch-size", type=int, default=32)
    p.add_argument("--dali-threads", type=int, default=2, help="DALI's CPU threads (0: no DALI)")
    p.add_argument("--train-steps", type=int, default=3, help="timed training steps per path in part 2 (0: skip)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    quiet()
    t0 = time.perf_counter()
    header("Data throughput per path", args)
    device = torch.device(args.device)
    part1(args, device)
    if args.folder_images:
        part2(args, device)
    footer(t0)


if __name__ == "__main__":
    main()
