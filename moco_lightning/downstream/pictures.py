"""Embeddings to look at (``moco-lightning embed --neighbours K --projector``): a picture of a few images beside
their nearest neighbours in feature space, and TensorBoard's embedding projector with image sprites, as lightly's
``lightly-embed`` and TensorBoard's projector tutorial show them."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

#: the most images a projector sprite holds: TensorBoard reads sprites up to 8192 x 8192 px, here of 32-px thumbnails
SPRITE_LIMIT = (8192 // 32) ** 2


def thumbnail(path: str, size: int):
    """The image at ``path`` as an RGB square of ``size`` px (centre-cropped), for pictures and sprites."""
    from PIL import Image, ImageOps

    with Image.open(path) as image:
        return ImageOps.fit(image.convert("RGB"), (size, size))


def nearest(features: torch.Tensor, queries: Sequence[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, cosines)`` of each query row's ``k`` nearest other rows by cosine similarity, nearest first."""
    unit = torch.nn.functional.normalize(features.float(), dim=1)
    similarity = unit[list(queries)] @ unit.T
    similarity[torch.arange(len(queries)), torch.as_tensor(list(queries))] = -float("inf")  # not itself
    cosines, indices = similarity.topk(min(k, len(features) - 1), dim=1)
    return indices, cosines


def neighbours_picture(
    features: torch.Tensor, samples: Sequence[tuple[str, int]], classes: Sequence[str], k: int, out: Path,
    rows: int = 8, size: int = 96,
) -> Path:  # fmt: skip
    """Writes ``out`` (PNG): ``rows`` query images spread over the folder (first column, framed), each beside its
    ``k`` nearest neighbours, captioned with their class (or file name) and the cosine similarity."""
    from PIL import Image, ImageDraw

    queries = sorted({int(i) for i in np.linspace(0, len(samples) - 1, min(rows, len(samples)))})
    indices, cosines = nearest(features, queries, k)
    caption, gap = 14, 8
    width = size * (indices.shape[1] + 1) + gap
    sheet = Image.new("RGB", (width, (size + caption) * len(queries)), "white")
    draw = ImageDraw.Draw(sheet)

    def name(i: int) -> str:
        path, target = samples[i]
        return classes[target] if target >= 0 else Path(path).stem

    for r, q in enumerate(queries):
        top = r * (size + caption)
        sheet.paste(thumbnail(samples[q][0], size), (0, top))
        draw.rectangle([0, top, size - 1, top + size - 1], outline="red", width=2)
        draw.text((2, top + size), name(q)[:14], fill="black")
        for c, (i, cos) in enumerate(zip(indices[r].tolist(), cosines[r].tolist())):
            left = size * (c + 1) + gap
            sheet.paste(thumbnail(samples[i][0], size), (left, top))
            draw.text((left + 2, top + size), f"{name(i)[:9]} {cos:.2f}", fill="black")
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out)
    return out


def projector(features: torch.Tensor, samples: Sequence[tuple[str, int]], classes: Sequence[str], folder: Path) -> Path:
    """Writes TensorBoard's embedding projector for ``features`` into ``folder`` (``tensorboard --logdir folder``,
    the PROJECTOR tab): every row with its class and path, and image sprites up to :data:`SPRITE_LIMIT` images."""
    from torch.utils.tensorboard import SummaryWriter

    metadata = [[classes[t] if t >= 0 else "", path] for path, t in samples]
    images = None
    if len(samples) <= SPRITE_LIMIT:
        images = torch.stack(
            [torch.from_numpy(np.array(thumbnail(p, 32))).permute(2, 0, 1) for p, _ in samples]
        ).float() / 255  # fmt: skip
    writer = SummaryWriter(str(folder))
    writer.add_embedding(features.float(), metadata=metadata, label_img=images, metadata_header=["label", "path"],
                         tag="embed")  # fmt: skip
    writer.close()
    return folder
