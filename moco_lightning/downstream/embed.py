"""``moco-lightning embed``: the features of every image of a folder, for search, clustering or a plot.

    moco-lightning embed --ckpt runs/my_run/version_0/checkpoints/last.ckpt --data my_images --out embeddings

writes ``embeddings/features.npy`` (float32, one row an image: ``numpy.load(path, mmap_mode="r")`` reads it without
loading it) and ``embeddings/index.csv`` (``row,path,label``: the class folder's name, empty for a folder without
class folders). The images go through the encoder's own evaluation transform, as the checkpoint or export records it
(:meth:`moco_lightning.downstream.encoder.Encoder.transform`; ``--mean`` / ``--std`` / ``--resize`` replace it),
in batches on the fastest device here, with a progress bar on a terminal.

``--neighbours K`` also writes ``neighbours.png``: eight images spread over the folder, each beside its K nearest
neighbours (cosine similarity); ``--projector`` writes TensorBoard's embedding projector with image sprites
(``tensorboard --logdir embeddings/projector``, the PROJECTOR tab).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from moco_lightning.errors import ConfigError


def embed_folder(
    ckpt: str | Path,
    data: str | Path,
    out: str | Path,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    resize: Optional[int] = None,
    batch_size: int = 256,
    num_workers: Optional[int] = None,
    neighbours: Optional[int] = None,
    projector: bool = False,
    skip_bad_images: bool = False,
) -> tuple[Path, Path]:
    """Writes the features of every image below ``data`` (class folders or images alone) to ``out``, and with
    ``neighbours`` / ``projector`` the pictures of :mod:`moco_lightning.downstream.pictures`; returns the paths of
    ``features.npy`` and ``index.csv``. An unreadable image raises one error naming every unreadable file;
    ``skip_bad_images`` embeds a readable image of the same class in its place (its row still names the file)."""
    import numpy as np
    from torch.utils.data import DataLoader
    from tqdm import tqdm

    from moco_lightning.constants import default_normalisation
    from moco_lightning.datamodules.image_folder import default_workers
    from moco_lightning.datamodules.images import Deterministic, ImageFileDataset, scan_image_folder
    from moco_lightning.datamodules.transforms import eval_transform
    from moco_lightning.downstream import pictures
    from moco_lightning.downstream.encoder import Encoder
    from moco_lightning.downstream.features import batches, embed

    if not Path(data).is_dir():
        raise ConfigError(f"--data {data}: not a folder; give the folder of your images (class folders or not)")
    check_out_folder(out)
    if neighbours is not None and neighbours < 1:
        raise ConfigError(f"--neighbours {neighbours}: give the number of neighbours to show, 1 or more")
    encoder = Encoder.read(ckpt, arg="--ckpt")  # the file read once
    backbone = encoder.build()[0]
    channels, size = encoder.architecture.get("in_channels", 3), encoder.architecture.get("image_size", 224)
    if mean is None and std is None and resize is None:
        transform = encoder.transform()
    else:
        mean, std = tuple(mean or default_normalisation(channels)[0]), tuple(std or default_normalisation(channels)[1])
        transform = eval_transform(size, mean, std, resize)
    samples, classes = scan_image_folder(Path(data), allow_empty=True)  # an empty class folder: no rows
    images = ImageFileDataset(samples, Deterministic(transform), channels, 0, 0, skip_bad_images)
    workers = default_workers() if num_workers is None else num_workers
    loader = DataLoader(images, batch_size=batch_size, num_workers=workers)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # a bar on a terminal, silent in a log; around features.batches, which shuts the workers down at an error
    progress = tqdm(batches(loader), total=len(loader), desc="embed", unit="batch", disable=None)
    features, _ = embed(backbone.to(device), progress, device, gather=False, normalize=False)
    skipped = images.bad_images
    if skipped:
        print(f"embed: {len(skipped)} unreadable file(s) embedded as another image of the same class (their rows "
              f"still name them): {', '.join(skipped)}", file=sys.stderr)  # fmt: skip
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "features.npy", features.float().cpu().numpy())
    with open(folder / "index.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["row", "path", "label"])
        for row, (path, target) in enumerate(samples):
            writer.writerow([row, path, classes[target] if target >= 0 else ""])
    if neighbours:
        pictures.neighbours_picture(features.cpu(), samples, classes, neighbours, folder / "neighbours.png")
    if projector:
        pictures.projector(features.cpu(), samples, classes, folder / "projector")
    return folder / "features.npy", folder / "index.csv"


def check_out_folder(out: str | Path, flag: str = "--out") -> None:
    """Before any work: ``out`` must be a folder or not exist yet (a file there would fail only after the work)."""
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"{flag} {out}: a file is there; give a folder (new or existing) for the results")
