"""NVIDIA DALI as the image-folder data path: decoding and augmentation in DALI pipelines (on the GPU if any).

``ImageFolderDataModule(backend="dali")`` uses :class:`DaliLoader` instead of PIL in DataLoader workers. DALI
(https://github.com/NVIDIA/DALI, PyPI ``nvidia-dali-cuda130``: ``pip install "moco-lightning[dali]"``) decodes
JPEGs with nvJPEG on the GPU (``device="mixed"``) and runs the whole view augmentation there; without a GPU it runs
CPU-only pipelines (``device_id=None``) in its own C++ threads. The contract is the datamodules' (``base.py``):
training batches ``([view_1, view_2, *local_views], targets, index)``, evaluation batches ``(image, target, index)``.

- Order and sharding: every epoch's order is :class:`~.base.SeededRandomSampler`'s permutation of ``(seed, epoch)``,
  padded to a multiple of the world size and cut ``rank::world`` (as ``DistributedSampler``), so every rank gets
  the same number of batches; training drops the last partial batch. DALI's file reader (``fn.readers.file``, its
  own threads, not the training loop's) reads the files in that order; each image's index comes through the
  pipeline as its label, and the targets are looked up from it.
- On the GPU the outputs are bound to the current CUDA stream (``pipe.run(stream)``: no host synchronisation) and
  copied into PyTorch tensors on that stream; views, targets and indices all arrive on the device.
- Unreadable files: a file DALI cannot decode stops the epoch with :class:`~.images.BadImageError` naming every
  unreadable file of the split (checked once with PIL), as the PIL path does; with ``skip_bad_images`` each one is
  replaced by the next readable image of its class and the epoch goes on from that batch.
- Randomness: the pipeline of each epoch is seeded by ``(seed, epoch, rank)``: an epoch's views are the same
  whether or not the run was resumed.
- Resuming mid-epoch: the loader's state (``state_dict``, saved by Lightning) is the epoch and the batches yielded
  in it; a resumed epoch runs the pipeline over the batches already trained on and discards them (DALI's random
  operators advance their state per sample: replaying is what gives the remaining batches the views they would have
  had), then yields the rest. The replay costs the decoding of those batches, once.
- Views per preset: random resized crop (torchvision's area and aspect ranges), flip, colour jitter (brightness,
  contrast, saturation and hue factors as torchvision's, applied with the preset's probability), grayscale, Gaussian
  blur (sigma scaled with the image side as the other paths), solarization, normalisation; local views for
  multi-crop. Evaluation: resize of the shorter side, centre crop, normalisation. Differences from PIL/torchvision:
  DALI's resampling filters, and the jitter ops in one fixed order (``color_twist``).
"""

from __future__ import annotations

import math
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from moco_lightning.errors import ConfigError

from .dali_views import DaliViews
from .images import item_seed
from .loading import EpochPosition
from .transforms import ViewSettings

DALI_MODES = ("pretrain", "linear", "eval")  # a loader's mode, by index in its pipeline's seed


def require_dali():
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        raise ConfigError(
            "backend='dali' needs NVIDIA DALI: pip install \"moco-lightning[dali]\" (PyPI nvidia-dali-cuda130; it runs "
            "CPU-only pipelines on machines without a GPU), or use backend='pil'"
        ) from None


class DaliLoader(EpochPosition):
    """An iterable of batches from image files through a DALI pipeline; ``len()`` batches per epoch.

    Args:
        paths, targets: the files and their labels.
        mode: ``"pretrain"`` (the preset's two views + local views), ``"linear"`` (one view: crop 0.08-1 + flip) or
            ``"eval"`` (resize ``eval_resize`` + centre crop; in order, nothing dropped; rank ``r`` of ``world`` gets
            the files ``r::world``, not padded).
        settings, mean, std, eval_resize, channels: the views and the normalisation.
        batch_size, seed, rank, world: per-rank batch, the order's seed, this rank's shard.
        device_id: the CUDA device for ``device="mixed"`` decoding and GPU ops; None: a CPU pipeline.
        num_threads: DALI's CPU threads.
        shuffle: a new order (and new views) every epoch; False: the files in order, the same views every epoch
            (a validation loader), still sharded over the ranks.
        files: the :class:`~.images.ImageFileDataset` of these files, for unreadable ones: its ``skip_bad_images``
            policy and registry (None: an unreadable file is an error naming every unreadable file).
        fused_crop: each random-resized crop decodes only its window (``fn.decoders.image_random_crop``, ROI
            decoding: nvJPEG on the GPU, libjpeg-turbo on the CPU) instead of one whole decode cropped per view.
    """

    def __init__(
        self,
        paths: Sequence[str],
        targets: Sequence[int],
        mode: str,
        settings: ViewSettings,
        mean: Sequence[float],
        std: Sequence[float],
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        device_id: Optional[int] = None,
        num_threads: int = 2,
        eval_resize: Optional[int] = None,
        channels: int = 3,
        shuffle: bool = True,
        files=None,
        fused_crop: bool = False,
    ) -> None:
        require_dali()
        if mode not in ("pretrain", "linear", "eval"):
            raise ConfigError(f"DaliLoader: mode must be 'pretrain', 'linear' or 'eval', got {mode!r}")
        self.paths, self.targets = list(paths), np.asarray(targets, dtype=np.int64)
        self.mode, self.settings, self.mean, self.std = mode, settings, tuple(mean), tuple(std)
        self.batch_size, self.seed, self.rank, self.world = batch_size, seed, rank, world
        self.device_id, self.num_threads, self.channels = device_id, num_threads, channels
        self.eval_resize = eval_resize or int(round(settings.image_size / 0.875))
        self.epoch, self.shuffle = 0, shuffle and mode != "eval"
        self.sampler, self.batch_sampler = self, None  # Lightning calls ``sampler.set_epoch(epoch)`` every epoch
        self.equal_batches = mode != "eval"  # every rank gets as many full batches: gathers need not exchange sizes
        self.files, self.fused_crop = files, fused_crop
        self.views = DaliViews(settings, self.mean, self.std, channels, self.eval_resize, fused_crop)
        self._stand_ins: dict[int, int] = {}  # unreadable file -> the readable one of its class read instead
        self._targets_on: dict[str, torch.Tensor] = {}  # the targets on the outputs' device, looked up by index

    @property
    def decoded_on(self) -> str:
        """Where the pipeline decodes and augments: ``"cuda:N (nvJPEG)"`` or ``"cpu"``."""
        return f"cuda:{self.device_id} (nvJPEG)" if self.device_id is not None else "cpu"

    # --- order -------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        if self.shuffle:
            self.epoch = epoch

    @property
    def rank_shard(self) -> Optional[Tuple[int, int]]:
        """``(rank, world)`` of an evaluation loader that holds only this rank's share (every ``world``-th file from
        ``rank``): the evaluation callbacks take its batches as this rank's shard instead of sharding them again."""
        return (self.rank, self.world) if self.mode == "eval" else None

    def order(self) -> np.ndarray:
        n = len(self.paths)
        if self.mode == "eval":  # in order, nothing dropped or repeated; each rank decodes only its share
            return np.arange(n)[self.rank :: self.world]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)  # SeededRandomSampler's permutation
        perm = torch.randperm(n, generator=g).numpy() if self.shuffle else np.arange(n)
        per_rank = math.ceil(n / self.world)
        perm = np.concatenate([perm, perm[: per_rank * self.world - n]])  # padded as DistributedSampler
        return perm[self.rank :: self.world]

    def __len__(self) -> int:
        n = len(self.order())
        return n // self.batch_size if self.shuffle else math.ceil(n / self.batch_size)

    # --- resuming mid-epoch (EpochPosition: Lightning saves and loads the state of a training loader) -------------
    def epoch_samples(self) -> int:
        return len(self.paths)

    def current_epoch(self) -> int:
        return self.epoch

    # --- the pipeline --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Tuple]:
        skip = self.start_epoch()
        order = self.order()
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.shuffle:  # training: the last partial batch is dropped
            batches = [b for b in batches if len(b) == self.batch_size]
        gpu = self.device_id is not None
        stream = torch.cuda.current_stream(self.device_id) if gpu else None
        pipe, i = None, 0
        while i < len(batches):
            if pipe is None:
                pipe = self._pipeline(batches, start=i)
            try:
                outputs = pipe.run(stream) if gpu else pipe.run()
            except Exception as e:  # a file DALI cannot decode: name it (and every other), or read a stand-in
                self._unreadable(batches[i : i + 2], e)
                pipe = None  # rebuilt from this batch on, with the stand-ins
                continue
            i += 1
            if i <= skip:  # trained on before the run was interrupted: replayed for the pipeline's random state
                continue
            self._yielded += 1
            *views, index = (self._to_torch(o) for o in outputs)
            index = index.reshape(-1)[: len(batches[i - 1])].long()  # an evaluation loader's last batch was padded
            views = [v[: len(index)] for v in views]
            targets = self._targets(index)
            yield (views, targets, index) if self.mode == "pretrain" else (views[0], targets, index)

    def _targets(self, index: Tensor) -> Tensor:
        where = str(index.device)
        if where not in self._targets_on:
            self._targets_on[where] = torch.from_numpy(self.targets).to(index.device)
        return self._targets_on[where][index]

    def _unreadable(self, batches: List[np.ndarray], error: Exception) -> None:
        """Unreadable files in ``batches`` (the failed one and the one DALI may have been prefetching): with
        ``skip_bad_images`` their stand-ins are recorded; else the error names every unreadable file of the split."""
        from .images import BadImageError, find_bad_images

        suspects = sorted({self._stand_ins.get(int(i), int(i)) for b in batches for i in b})
        bad = find_bad_images([self.paths[i] for i in suspects], self.channels)
        if not bad:  # PIL reads them all: a failure of DALI's own, with the files it was given
            names = ", ".join(self.paths[i] for i in suspects[:4])
            raise RuntimeError(f"DALI failed on a batch of {names}, ...: {error}") from error
        if self.files is None or not self.files.skip_bad_images:
            path, cause = bad[0]
            raise BadImageError(path, cause, find_bad_images(self.paths, self.channels), len(self.paths)) from None
        bad_paths = {p for p, _ in bad}
        for i in {int(i) for b in batches for i in b}:
            if self.paths[self._stand_ins.get(i, i)] in bad_paths:
                self._stand_ins[i] = self.files.stand_in(i)[0]

    def pipeline_seed(self, start: int = 0) -> int:
        """The seed of this epoch's pipeline (one that starts at batch ``start``: after an unreadable file), from
        integers only: Python salts the hash of a string per process, so the former ``hash((seed, epoch, rank,
        "pretrain"))`` gave every process (a resumed run) other views."""
        return item_seed(self.seed, self.epoch, self.rank, DALI_MODES.index(self.mode) + 3 * start) & (2**31 - 1)

    def _pipeline(self, batches: List[np.ndarray], start: int = 0):
        from nvidia.dali import fn, pipeline_def

        index = [int(i) for b in batches[start:] for i in b]
        files = [self.paths[self._stand_ins.get(i, i)] for i in index]
        gpu = self.device_id is not None

        @pipeline_def(
            batch_size=self.batch_size,
            num_threads=self.num_threads,
            device_id=self.device_id,
            seed=self.pipeline_seed(start),
            exec_dynamic=True,
            prefetch_queue_depth=2,
        )
        def pipeline():
            # the index of each image as its label: the targets are looked up from it (a stand-in keeps the index of
            # the image it stands in for, and its class)
            encoded, label = fn.readers.file(
                files=files, labels=index, random_shuffle=False, pad_last_batch=True, name="files"
            )
            if gpu:
                label = label.gpu()
            return (*self.views.outputs(encoded, gpu, self.mode), label)

        pipe = pipeline()
        pipe.build()
        return pipe

    def _to_torch(self, tensor_list) -> Tensor:
        if self.device_id is None:
            return torch.from_numpy(np.asarray(tensor_list.as_tensor()))
        from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

        dense = tensor_list.as_tensor()
        device = torch.device("cuda", self.device_id)
        out = torch.empty(dense.shape(), dtype=to_torch_type[dense.dtype], device=device)
        # a copy on the stream the outputs are bound to (non-blocking: the host does not wait for it)
        feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(self.device_id))
        return out
