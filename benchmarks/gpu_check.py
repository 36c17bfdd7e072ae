"""A prepared, self-contained check of moco-lightning on a CUDA machine: a few minutes, no dataset download.

    python -m benchmarks.gpu_check                  # on the GPU(s) of this node, in --minutes (default 6)
    python -m benchmarks.gpu_check --quick          # the figures of the README's GPU table, under 3 minutes
    python -m benchmarks.gpu_check --device cpu --quick   # the same code at toy sizes (run by the tests)

What only a GPU can show, each printed as one line (``check: result``) as it finishes, then one summary table
(figure, value, what it means, pass / fail where there is a threshold) to paste into the README. Each check runs in
a process of its own, killed when its share of ``--minutes`` is spent: a check that hangs or cannot finish prints
why and the others go on. The summary is also written to ``--summary`` (Markdown), rewritten after every check, so
that what ran is kept whatever happens to the rest.

- ``fit``: MoCo + an in-memory datamodule (random uint8 images, views drawn batched on the device) trains a few
  steps in bf16-mixed: the first GPU batch does not crash on tensors left on the CPU; logits and queue stay fp32.
- ``syncs``: host-device synchronisations per training step, counted with ``torch.cuda.set_sync_debug_mode``
  over steps after the warm-up (Lightning's own included).
- ``split_bn``: CUDA kernels launched by one SplitBatchNorm2d forward + backward (8 splits) and by a BatchNorm2d.
- ``bf16_logits``: the largest logit error at K = 65536 under bf16 autocast: ours (fp32 similarities) and a
  bf16 ``q @ queue.T``.
- ``knn_memory``: peak memory of the kNN monitor's evaluation for a bank of N x 2048 features, fp32 and bf16, N as
  large as the check's share affords (up to ImageNet's 1.28 M), from a timed small bank.
- ``checkpoint``: a checkpoint loaded with ``map_location="cuda"`` resumes training (the RNG states were saved as
  CPU tensors and are restored from wherever they were mapped).
- ``throughput``: MoCo v2 (``configs/moco_v2.yaml``: ResNet-50, K 65536) at 224 px in bf16-mixed and channels-last,
  images/s of (a) the bare encoder work on views already on the GPU (plain BN), (b) the full ``fit`` step on those
  views with split BN (8, the one-GPU default) and with plain BN (``shuffle_bn: off``), (c) the data path alone over
  a generated JPEG folder: PIL workers (crops in the workers, colour batched on the GPU) and, where DALI is
  installed, DALI (built on the GPU explicitly, ``device="mixed"``: nvJPEG; the line says where it decoded; a line
  says when it was skipped), (d) ``fit`` with each data path. The folder holds enough JPEGs for the warm-up and the
  timed batches inside one epoch (no epoch boundary, no worker start-up in the timing). Goals: (b) with split BN
  >= 0.9 of (a); (d) >= 0.9 of (a).
- ``compile``: ``fit`` images/s with ``compile: false`` and ``true`` (a ResNet-18), and the recompilations Dynamo
  logged (training, no-grad key encoder, evaluation): none may hit the recompile limit (it falls back to eager).
- ``multi_crop``: ``fit`` images/s of MoCo v2 with 2 x 224 px views and with 2 x 224 + 6 x 96 px (SwAV's layout).
- ``ddp``: ``fit`` on every GPU of the node (DDP, NCCL, started with spawn: everything is pickled into the
  processes), images/s per GPU against the same run on one GPU (scaling efficiency); the queue must be identical on
  every rank; the kNN monitor's bank sharded over the ranks, peak memory per rank. On the CPU: 2 gloo processes.

``--minutes`` bounds the whole check: each check's process is killed at its share of the budget, and its timed
loops stop at 60 % of that share (the rest is start-up, compilation and the figures). At toy sizes (the CPU) every
timed loop runs its minimum steps and each check may take up to 3 minutes, whatever ``--minutes`` says.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable, List, Optional, Tuple

import torch
from lightning.pytorch import Callback
from torch import nn

from moco_lightning.datamodules import InMemoryDataModule, view_settings

SIZES = {  # toy: seconds on a CPU; full: a GPU's minutes
    "toy": dict(image=16, batch=16, images=128, steps=4, queue=256, width=0.25, bank=4096, bank_dim=64,
                big_image=32, big_batch=8, backbone="resnet18", workers=1, bench_steps=3, warmup=1,
                local_image=16, local_views=2, compile_image=16, compile_batch=8, ddp_image=16, ddp_batch=8),
    "full": dict(image=64, batch=256, images=8192, steps=30, queue=65536, width=1.0, bank=1_281_167, bank_dim=2048,
                 big_image=224, big_batch=128, backbone="resnet50", workers=12, bench_steps=30, warmup=3,
                 local_image=96, local_views=6, compile_image=112, compile_batch=256, ddp_image=224, ddp_batch=128),
}  # fmt: skip

# each check's share of --minutes (its process is killed there; its timed loops stop at LOOPS of it)
SHARES = dict(fit=0.05, syncs=0.05, split_bn=0.03, bf16_logits=0.03, knn_memory=0.07, checkpoint=0.05,
              throughput=0.30, compile=0.14, multi_crop=0.12, ddp=0.16)  # fmt: skip
LOOPS = 0.6
#: the README's GPU table: under 3 minutes on one GPU (``--quick``)
QUICK = ("fit", "syncs", "split_bn", "bf16_logits", "checkpoint", "throughput")
TOY_SECONDS = 180  # a toy check's limit (the CPU: start-up dominates)
NO_DALI = False  # --no-dali


class Row:
    """One line of the summary table."""

    def __init__(self, figure: str, value: str, meaning: str, ok: Optional[bool] = None) -> None:
        self.figure, self.value, self.meaning, self.ok = figure, value, meaning, ok

    def cells(self) -> List[str]:
        verdict = "" if self.ok is None else ("pass" if self.ok else "**fail**")
        return [self.figure, self.value, self.meaning, verdict]


class Synthetic(InMemoryDataModule):
    """Random uint8 images in memory. Module-level (as every class of this check), so that
    ``DDPStrategy(start_method="spawn")`` can pickle the trainer and the datamodule into its processes."""

    num_classes = 10

    def __init__(self, settings, images: int, image: int, batch: int, channels: int = 3) -> None:
        self.in_channels, self.mean, self.std = channels, (0.5,) * channels, (0.25,) * channels
        self.n_images, self.side = images, image
        super().__init__(settings, batch_size=batch, image_size=image)

    def load_split(self, split: str):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        n = self.n_images if split == "train" else self.batch_size * 2
        images = torch.randint(0, 256, (n, self.in_channels, self.side, self.side), generator=g, dtype=torch.uint8)
        return images, torch.randint(0, 10, (n,), generator=g)


class Clock(Callback):
    """``perf_counter`` at the end of every training batch; stops the fit once ``deadline`` (a ``time.time()``) has
    passed and at least ``min_steps`` were timed after the ``warmup`` steps. On every rank, ``folder``: each rank
    writes its times and queue there at the end (the DDP check reads them back)."""

    def __init__(self, warmup: int, deadline: float, min_steps: int = 2, folder: Optional[str] = None) -> None:
        self.warmup, self.deadline, self.min_steps, self.folder = warmup, deadline, min_steps, folder
        self.ends: List[float] = []
        self.decoded_on = "?"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())
        if len(self.ends) == 1:
            self.decoded_on = getattr(trainer.train_dataloader, "decoded_on", "workers")
        timed = len(self.ends) - self.warmup - 1
        stop = timed >= self.min_steps and time.time() > self.deadline
        if trainer.world_size > 1:  # every rank stops at the same step
            stop = bool(trainer.strategy.reduce_boolean_decision(stop, all=False))
        if stop:
            trainer.should_stop = True

    def rate(self, batch: int) -> float:
        """Images/s of this rank over the timed steps (after the warm-up)."""
        return images_per_s(self.ends, self.warmup, batch)

    def on_train_end(self, trainer, pl_module):
        if self.folder is None:
            return
        record = dict(ends=self.ends, queue=pl_module.dictionary.keys.cpu().tolist(), world=trainer.world_size)
        with open(os.path.join(self.folder, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


def images_per_s(ends: List[float], warmup: int, batch: int) -> float:
    """Images/s from the end times of a rank's batches, over the steps after the ``warmup`` first ones."""
    timed = len(ends) - warmup - 1
    return batch * timed / (ends[-1] - ends[warmup]) if timed > 0 else float("nan")


class ShardedKNNPeak(Callback):
    """After the fit, each rank runs the kNN monitor's evaluation on its shard of an N x D bank (the bank is never
    gathered) and writes its peak memory and the accuracy (which must be the same on every rank)."""

    def __init__(self, folder: str, n: int, d: int) -> None:
        self.folder, self.n, self.d = folder, n, d

    def on_train_end(self, trainer, pl_module):
        from moco_lightning.callbacks.knn import knn_accuracy

        bank, queries = knn_loaders(self.n, self.d)
        cuda = pl_module.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        acc = knn_accuracy(nn.Identity(), bank, queries, num_classes=1000, device=pl_module.device)
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else float("nan")
        with open(os.path.join(self.folder, f"knn{trainer.global_rank}.json"), "w") as f:
            json.dump(dict(peak=peak, acc1=acc["acc1"], total=acc["total"]), f)


def knn_loaders(n: int, d: int):
    """A bank of ``n`` random ``d``-dim features over 1000 classes and 10 000 of them as queries (seeded: the same in
    every process)."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    feats, labels = torch.randn(n, d, generator=g), torch.randint(0, 1000, (n,), generator=g)
    q = min(10_000, n)
    bank = DataLoader(TensorDataset(feats, labels), batch_size=8192)
    return bank, DataLoader(TensorDataset(feats[:q], labels[:q]), batch_size=8192)


def synthetic_datamodule(
    size: dict,
    channels: int = 3,
    image: Optional[int] = None,
    batch: Optional[int] = None,
    local_views: int = 0,
    local_size: Optional[int] = None,
    images: Optional[int] = None,
):
    image, batch = image or size["image"], batch or size["batch"]
    settings = view_settings("moco_v2", image).with_local_views(local_views, local_size, (0.05, 0.14))
    return Synthetic(settings, images or size["images"], image, batch, channels)


def moco(size: dict, batch: Optional[int] = None, **kw):
    """MoCo for the check, split BN in 8 (2 under a batch of 64, as the throughput configs) of ``batch`` images."""
    from moco_lightning import MoCo

    args = dict(
        bn_splits=8 if (batch or size["batch"]) >= 64 else 2,
        backbone="resnet18",
        width=size["width"],
        cifar_stem=True,
        image_size=size["image"],
        queue_size=size["queue"],
        momentum=0.99,
        lr=0.06,
        channels_last=True,
        hidden_dim=512,
    )
    args.update(kw)
    return MoCo(**args)


def trainer(device: str, steps: int, **kw):
    from lightning.pytorch import Trainer

    args = dict(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        precision=precision(device),
    )
    args.update(kw)
    return Trainer(**args)


def precision(device: str) -> str:
    """bf16-mixed on the GPU; fp32 on a CPU, whose bf16 is emulated and would make the toy run take minutes."""
    return "bf16-mixed" if device == "cuda" else "32-true"


def fit_rate(device: str, size: dict, deadline: float, model, batch: int, **data) -> Tuple[float, str]:
    """(images/s of ``fit`` after the warm-up, where the training batches were decoded), stopping at ``deadline``."""
    warm, steps = size["warmup"], size["bench_steps"]
    clock = Clock(warm, deadline)
    trainer(device, steps + warm + 1, callbacks=[clock]).fit(model, **data)
    return clock.rate(batch), clock.decoded_on


# --- the checks: each returns (its line, its rows of the summary table) -------------------------------------------
Result = Tuple[str, List[Row]]


def check_fit(device: str, size: dict, deadline: float) -> Result:
    seen = {}

    class Look(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.update(views=batch[0][0].device.type, loss=outputs["loss"].dtype)

    model = moco(size)
    t = time.perf_counter()
    # bf16-mixed here on the CPU too: what autocast does to the logits and the queue is the point of this check
    trainer(device, size["steps"], callbacks=[Look()], precision="bf16-mixed").fit(model, synthetic_datamodule(size))
    keys = model.dictionary.keys
    ok = seen["views"] == device and seen["loss"] == torch.float32 and keys.dtype == torch.float32
    line = (
        f"{size['steps']} steps in {time.perf_counter() - t:.1f} s; views on {seen['views']}, loss {seen['loss']}, "
        f"queue {keys.dtype} on {keys.device.type}, ptr {int(model.dictionary.ptr)}"
    )
    meaning = "bf16-mixed fit: views on the device, loss and queue in fp32"
    return line, [
        Row("bf16 fit: views / loss / queue", f"{seen['views']} / {seen['loss']} / {keys.dtype}", meaning, ok)
    ]


def check_syncs(device: str, size: dict, deadline: float) -> Result:
    if device != "cuda":
        return "n/a (CUDA only)", [Row("host syncs per step", "n/a (CUDA only)", "torch.cuda.set_sync_debug_mode")]

    class Count(Callback):
        def __init__(self) -> None:
            self.warnings, self.counted = [], 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:  # after the warm-up: count from here on
                torch.cuda.set_sync_debug_mode("warn")
                self.catcher = warnings.catch_warnings(record=True)
                self.warnings = self.catcher.__enter__()
                warnings.simplefilter("always")

        def on_train_end(self, trainer, pl_module):
            torch.cuda.set_sync_debug_mode("default")
            self.catcher.__exit__(None, None, None)
            self.counted = trainer.global_step - 3

    count = Count()
    trainer(device, size["steps"] + 3, callbacks=[count]).fit(moco(size), synthetic_datamodule(size))
    syncs = [w for w in count.warnings if "synchroniz" in str(w.message).lower()]
    where = sorted({f"{os.path.basename(w.filename)}:{w.lineno}" for w in syncs})[:8]
    per_step = len(syncs) / max(1, count.counted)
    row = Row("host syncs per step", f"{per_step:.2f}", f"Lightning's included; at {where}", per_step == 0)
    return f"{per_step:.2f} per step over {count.counted} steps; at {where}", [row]


def check_split_bn(device: str, size: dict, deadline: float) -> Result:
    from torch.profiler import ProfilerActivity, profile

    from moco_lightning.modules.split_bn import SplitBatchNorm2d

    x = torch.randn(size["batch"], 64, size["image"], size["image"], device=device).contiguous(
        memory_format=torch.channels_last
    )
    counts = []
    x.requires_grad_()
    for bn in (SplitBatchNorm2d(64, 8).to(device), nn.BatchNorm2d(64).to(device)):
        bn(x).sum().backward()
        activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            bn(x).sum().backward()
            if device == "cuda":
                torch.cuda.synchronize()
        counts.append(sum(1 for e in prof.events() if (e.device_type.name == "CUDA") == (device == "cuda")))
    kind = "kernels" if device == "cuda" else "ops"
    value = f"{counts[0]} vs {counts[1]} {kind}"
    row = Row("SplitBatchNorm2d (8 splits) vs BatchNorm2d", value, f"{kind} of one forward + backward (+ sum)")
    return f"SplitBatchNorm2d {counts[0]} {kind}, BatchNorm2d {counts[1]} {kind}", [row]


def check_bf16_logits(device: str, size: dict, deadline: float) -> Result:
    from moco_lightning.modules.loss import contrastive_similarities

    g = torch.Generator(device=device).manual_seed(0)
    q, k = (nn.functional.normalize(torch.randn(256, 128, device=device, generator=g), dim=1) for _ in range(2))
    queue = nn.functional.normalize(torch.randn(size["queue"], 128, device=device, generator=g), dim=1)
    exact = contrastive_similarities(q.double(), k.double(), queue.double())[0]
    with torch.autocast(device, dtype=torch.bfloat16):
        ours = contrastive_similarities(q, k, queue)[0]
        naive = torch.cat([(q * k).sum(1, keepdim=True), q @ queue.T], 1)
    err = lambda s: (s.double() - exact).abs().max().item() / 0.2  # noqa: E731 - in logit units at T = 0.2
    line = f"K {size['queue']}: max logit error ours {err(ours):.2e} ({ours.dtype}), bf16 product {err(naive):.2e}"
    value = f"{err(ours):.1e} (bf16 product {err(naive):.1e})"
    return line, [Row("max logit error under bf16 autocast", value, f"K {size['queue']}, T 0.2", err(ours) < 1e-4)]


def check_knn_memory(device: str, size: dict, deadline: float) -> Result:
    from moco_lightning.callbacks.knn import knn_accuracy

    d = size["bank_dim"]
    # the bank the share affords: a small bank timed first, the evaluation's time grows with the bank's size
    small = min(size["bank"], 65536)
    t = time.perf_counter()
    knn_accuracy(nn.Identity(), *knn_loaders(small, d), num_classes=1000, device=torch.device(device))
    per_row = (time.perf_counter() - t) / small
    n = max(small, min(size["bank"], int((deadline - time.time()) / 2.5 / max(per_row, 1e-9))))
    bank, queries = knn_loaders(n, d)
    out, peaks = [], []
    for dtype in (torch.float32, torch.bfloat16):
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        acc = knn_accuracy(
            nn.Identity(), bank, queries, num_classes=1000, device=torch.device(device), bank_dtype=dtype
        )
        peaks.append(torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan"))
        out.append(
            f"{str(dtype)[6:]} peak {peaks[-1]:.2f} GiB, {time.perf_counter() - t:.1f} s, acc1 {acc['acc1']:.3f}"
        )
    ratio = peaks[1] / peaks[0]
    value = f"{peaks[0]:.2f} / {peaks[1]:.2f} GiB" if device == "cuda" else "n/a (CUDA memory stats)"
    ok = ratio <= 0.6 if device == "cuda" else None
    of = "" if n == size["bank"] else f" (of {size['bank']}: what the share affords)"
    row = Row("kNN bank peak, fp32 / bf16", value, f"bank {n} x {d}{of}, one process; bf16 <= 0.6 x fp32", ok)
    return f"bank {n} x {d}{of}: " + "; ".join(out), [row]


def check_checkpoint(device: str, size: dict, deadline: float) -> Result:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from moco_lightning import MoCo
    from moco_lightning.training.checkpoint_io import read_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        saver = ModelCheckpoint(dirpath=tmp, every_n_train_steps=2, save_top_k=-1)
        trainer(device, 2, callbacks=[saver], enable_checkpointing=True).fit(moco(size), synthetic_datamodule(size))
        path = os.path.join(tmp, os.listdir(tmp)[0])
        MoCo.load_from_checkpoint(path, map_location=device)  # loads where the weights are asked for
        rng = (read_checkpoint(path, map_location=device).get("moco_lightning") or {}).get("rng_states")
        rng_device = rng[0]["torch"].device.type if rng else "none"
        resumed = moco(size)
        trainer(device, 4).fit(resumed, synthetic_datamodule(size), ckpt_path=path)
        step = int(resumed.dictionary.enqueued_at.max())
        line = (
            f"loaded with map_location={device!r} (RNG state tensors on {rng_device}); resumed from step 2 to step "
            f"{step}"
        )
        row = Row(
            "resume from a checkpoint mapped to the device", f"step 2 -> {step}", "trains on to step 4", step == 4
        )
        return line, [row]


def write_jpegs(root: str, n: int, seed: int = 0) -> None:
    """``n`` smooth random 500x375 JPEGs in 4 class folders (content is irrelevant to throughput), in processes."""
    from concurrent.futures import ProcessPoolExecutor

    for c in range(4):
        os.makedirs(os.path.join(root, "train", f"c{c}"), exist_ok=True)
    with ProcessPoolExecutor(max(1, min(16, (os.cpu_count() or 1)))) as pool:
        list(pool.map(_write_jpeg, [(root, i, seed) for i in range(n)], chunksize=64))


def _write_jpeg(job) -> None:
    import numpy as np
    from PIL import Image

    root, i, seed = job
    small = np.random.default_rng((seed, i)).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    path = os.path.join(root, "train", f"c{i % 4}", f"{i}.jpg")
    Image.fromarray(small).resize((500, 375), Image.BICUBIC).save(path, quality=90)


def dali_missing() -> Optional[str]:
    """Why DALI's path is skipped (``--no-dali``, or the package is not installed), or None."""
    if NO_DALI:
        return "--no-dali"
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
        return "nvidia-dali is not installed (pip install nvidia-dali-cuda130)"
    return None


def check_throughput(device: str, size: dict, deadline: float) -> Result:
    """Images/s of the encoder work, the fit step, the data paths and fit with each (module docstring)."""
    from benchmarks._common import config_path, from_config
    from benchmarks.step_overhead import SameBatch, bare_step

    out, n, steps, warm = {}, size["big_batch"], size["bench_steps"], size["warmup"]
    skipped = dali_missing()
    share = (deadline - time.time()) / (5 if skipped else 7)  # the measurements
    splits = 8 if n >= 64 else 2
    split_fit, plain_fit = f"(b) fit step, split BN {splits}", "(b) fit step, plain BN"
    with tempfile.TemporaryDirectory() as tmp:
        # the warm-up and the timed batches of every measurement inside one epoch (plus the prefetched ones)
        write_jpegs(tmp, n * (warm + steps + 4))
        d = "--data.init_args."
        common = (
            f"{d}data_dir={tmp}",
            f"{d}val_dir=null",
            f"{d}image_size={size['big_image']}",
            f"{d}batch_size={n}",
            f"--model.backbone={size['backbone']}",
            f"--model.queue_size={size['queue']}",
            "--model.channels_last=true",
            f"--model.bn_splits={splits}",
        )
        paths = {"PIL": (f"{d}augment_on=device", f"{d}num_workers={size['workers']}")}
        if not skipped:
            paths["DALI"] = (f"{d}backend=dali", f"{d}num_workers={max(2, size['workers'] // 3)}")
        model, dm = from_config(config_path("moco_v2"), *common, *paths["PIL"])
        dm.setup()
        batch = next(iter(dm.train_dataloader()))
        views = [v.to(device) for v in dm.views(batch[0].to(device), torch.Generator(device=device).manual_seed(0))]
        model = model.to(device).to(memory_format=torch.channels_last)
        step = bare_step(model, *views)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            for _ in range(warm):
                step()
            sync(device)
            t, stop, k = time.perf_counter(), time.time() + share, 0
            while k < steps and (k < 2 or time.time() < stop):
                step()
                k += 1
            sync(device)
        out["(a) bare encoder"] = n * k / (time.perf_counter() - t)
        print(f"  (a) bare encoder: {out['(a) bare encoder']:.0f} img/s", flush=True)

        same = ([v for v in views], torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device))
        loader = torch.utils.data.DataLoader(
            SameBatch(same, (steps + warm + 2) * n), batch_size=n, collate_fn=lambda b: b
        )
        for name, bn in ((split_fit, ()), (plain_fit, ("--model.shuffle_bn=off",))):
            model = from_config(config_path("moco_v2"), *common, *bn)[0]
            out[name] = fit_rate(device, size, time.time() + share, model, n, train_dataloaders=loader)[0]
            print(f"  {name}: {out[name]:.0f} img/s", flush=True)
        decoded = {}
        for name, overrides in paths.items():
            model, dm = from_config(config_path("moco_v2"), *common, *overrides)
            dm.setup()
            if name == "DALI":  # no trainer yet: the GPU pipeline asked for explicitly (else it would be the CPU's)
                train = dm.dali_train_loader(torch.device(device))
                decoded["(c)"] = train.decoded_on
            else:
                train = dm.train_dataloader()
            it, stop = iter(train), time.time() + share
            for _ in range(warm):  # worker start-up, pipeline build: not timed
                b = next(it)
            t, k = time.perf_counter(), 0
            for b in it:
                if dm.views is not None:
                    dm.views([x.to(device) for x in b[0]] if isinstance(b[0], list) else b[0].to(device))
                k += n
                if k >= n * steps or (k >= 2 * n and time.time() > stop):
                    break
            sync(device)
            out[f"(c) data path alone, {name}"] = k / (time.perf_counter() - t)
            del it, train
            rate, decoded[f"(d) {name}"] = fit_rate(device, size, time.time() + share, model, n, datamodule=dm)
            out[f"(d) fit with {name}"] = rate
            print(f"  (c), (d) {name}: {out[f'(c) data path alone, {name}']:.0f}, {rate:.0f} img/s", flush=True)
    bare = out["(a) bare encoder"]
    line = "; ".join(f"{k} {v:.0f} img/s" for k, v in out.items())
    what = f"MoCo v2 {size['backbone']}, {size['big_image']} px, batch {n}, {precision(device)}, channels-last"
    rows = [Row(k, f"{v:.0f} img/s ({v / bare:.2f} of (a))", what) for k, v in out.items()]
    gpu = device == "cuda"
    rows.append(Row(f"{split_fit} / (a)", f"{out[split_fit] / bare:.2f}", "GPU goal >= 0.9: the step costs little "
                    "beyond the encoder", out[split_fit] / bare >= 0.9 if gpu else None))  # fmt: skip
    best = "DALI" if "DALI" in paths else "PIL"
    fit_data = out[f"(d) fit with {best}"]
    rows.append(Row(f"(d) fit with {best} / (a)", f"{fit_data / bare:.2f}", "GPU goal >= 0.9: the data path keeps up",
                    fit_data / bare >= 0.9 if gpu else None))  # fmt: skip
    if skipped:
        line += f"; DALI skipped: {skipped}"
        rows.append(Row("DALI data path", "skipped", skipped))
    else:
        line += f"; DALI decoded on {decoded['(c)']} in (c), {decoded['(d) DALI']} in (d)"
        rows.append(Row("DALI decoded on", f"{decoded['(c)']} / {decoded['(d) DALI']}", "(c) / (d)"))
    return line + f"; (b) split BN / (a) = {out[split_fit] / bare:.2f}", rows


class DynamoLog(logging.Handler):
    """Counts Dynamo's recompilations and recompile-limit hits (``TORCH_LOGS=recompiles``'s records)."""

    def __init__(self) -> None:
        super().__init__()
        self.recompiles: List[str] = []
        self.limit_hits: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "Recompiling function" in text:
            self.recompiles.append(text.split("\n", 1)[0])
        if "recompile_limit" in text or "cache_size_limit" in text:
            self.limit_hits.append(text.split("\n", 1)[0])


def check_compile(device: str, size: dict, deadline: float) -> Result:
    """fit images/s with compile off and on (ResNet-18, 2 global + 2 local views), and Dynamo's recompilations in the
    compiled fit (training, the no-grad key encoder, the local views' shape, a kNN evaluation in eval mode)."""
    import torch._dynamo
    import torch._logging

    from moco_lightning.callbacks import KNNMonitor

    image, batch = size["compile_image"], size["compile_batch"]
    share = (deadline - time.time()) / 2
    rates, log = {}, DynamoLog()
    for on in (False, True):
        torch._dynamo.reset()
        data = synthetic_datamodule(  # with local views: their other shape is one more (dynamic) compilation
            size,
            image=image,
            batch=batch,
            images=batch * (size["bench_steps"] + 8),
            local_views=2,
            local_size=image // 2,
        )
        model = moco(size, batch, image_size=image, compile=on, width=1.0)
        callbacks = [Clock(size["warmup"] + 1, time.time() + share)]
        if on:  # the monitor's evaluation runs the compiled backbone in eval mode, without gradients
            callbacks.append(KNNMonitor(every_n_epochs=1, max_bank_size=4 * batch, k=20))
            torch._logging.set_logs(recompiles=True)
            logging.getLogger("torch._dynamo").addHandler(log)
        t = time.perf_counter()
        try:
            trainer(device, size["bench_steps"] + size["warmup"] + 2, callbacks=callbacks).fit(model, data)
        finally:
            if on:
                logging.getLogger("torch._dynamo").removeHandler(log)
                torch._logging.set_logs()
        rates[on] = (callbacks[0].rate(batch), time.perf_counter() - t)
    (eager, t_eager), (compiled, t_compiled) = rates[False], rates[True]
    line = (
        f"resnet18 {image} px batch {batch}: eager {eager:.0f} img/s, compiled {compiled:.0f} img/s "
        f"(x{compiled / eager:.2f}; whole fit {t_eager:.0f} s vs {t_compiled:.0f} s with compilation); "
        f"{len(log.recompiles)} recompilations, recompile limit hit {len(log.limit_hits)}x"
        + (f": {log.limit_hits[:2]}" if log.limit_hits else "")
    )
    return line, [
        Row("compile: compiled / eager img/s", f"{compiled / eager:.2f}", f"resnet18, {image} px, batch {batch}"),
        Row("compile: recompilations / limit hits", f"{len(log.recompiles)} / {len(log.limit_hits)}",
            "train, no-grad keys, local views, eval kNN; a limit hit falls back to eager", not log.limit_hits),
    ]  # fmt: skip


def check_multi_crop(device: str, size: dict, deadline: float) -> Result:
    """fit images/s of MoCo v2 (the throughput check's backbone) with 2 global views and with 2 global + local."""
    share = (deadline - time.time()) / 2
    image, batch, local = size["big_image"], size["big_batch"], size["local_image"]
    rates = {}
    for views in (0, size["local_views"]):
        data = synthetic_datamodule(
            size,
            image=image,
            batch=batch,
            local_views=views,
            local_size=local,
            images=batch * (size["bench_steps"] + 6),
        )
        model = moco(size, batch, backbone=size["backbone"], cifar_stem=False, width=1.0, image_size=image,
                     symmetric=True, hidden_dim=2048, temperature=0.2)  # fmt: skip
        rates[views] = fit_rate(device, size, time.time() + share, model, batch, datamodule=data)[0]
    plain, multi = rates[0], rates[size["local_views"]]
    layout = f"2 x {image} + {size['local_views']} x {local} px"
    line = f"{size['backbone']} symmetric, batch {batch}: 2 x {image} px {plain:.0f} img/s, {layout} {multi:.0f} img/s"
    line += f" (x{multi / plain:.2f})"
    return line, [Row("multi-crop / 2 global views, img/s", f"{multi / plain:.2f}", f"{layout}, {size['backbone']}")]


def check_ddp(device: str, size: dict, deadline: float) -> Result:
    """fit on every GPU of the node (DDP, spawn) against one GPU; the queues; the sharded kNN bank's peak per rank."""
    world = torch.cuda.device_count() if device == "cuda" else 2
    if world < 2:
        return f"n/a (needs 2 or more GPUs; {world} here)", [Row("DDP", "n/a", f"{world} GPU here")]
    from lightning.pytorch.strategies import DDPStrategy

    image, batch = size["ddp_image"], size["ddp_batch"]
    share = (deadline - time.time()) / 2
    model_kw = dict(backbone=size["backbone"], cifar_stem=False, width=1.0, image_size=image, hidden_dim=2048,
                    temperature=0.2)  # fmt: skip
    images = batch * world * (size["bench_steps"] + size["warmup"] + 4)
    one = fit_rate(device, size, time.time() + share, moco(size, batch, **model_kw), batch,
                   datamodule=synthetic_datamodule(size, image=image, batch=batch, images=images))[0]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        strategy = DDPStrategy(start_method="spawn", find_unused_parameters=False)
        clock = Clock(size["warmup"], time.time() + share, folder=tmp)
        knn = ShardedKNNPeak(tmp, size["bank"], size["bank_dim"])
        t = time.perf_counter()
        ddp = trainer(device, size["bench_steps"] + size["warmup"] + 1, devices=world, strategy=strategy,
                      callbacks=[clock, knn])  # fmt: skip
        ddp.fit(
            moco(size, shuffle_bn="ddp", **model_kw),
            synthetic_datamodule(size, image=image, batch=batch, images=images),
        )
        wall = time.perf_counter() - t
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
        knns = [json.load(open(os.path.join(tmp, f"knn{r}.json"))) for r in range(world)]
    per_gpu = [images_per_s(r["ends"], size["warmup"], batch) for r in ranks]
    same_queue = all(r["queue"] == ranks[0]["queue"] for r in ranks)
    same_knn = len({(k["acc1"], k["total"]) for k in knns}) == 1
    rate = min(per_gpu)
    backend = "NCCL" if device == "cuda" else "gloo"
    peaks = ", ".join(f"{k['peak']:.2f}" for k in knns)
    line = (
        f"{world} ranks (spawn, {backend}, {wall:.0f} s with start-up): {rate:.0f} img/s per rank ({rate * world:.0f} "
        f"in all) vs {one:.0f} on one (efficiency {rate / one:.2f}); queues identical: {same_queue}; sharded kNN bank "
        f"{size['bank']} x {size['bank_dim']}: peak per rank [{peaks}] GiB, the same accuracy on every rank: {same_knn}"
    )
    what = f"{size['backbone']} {image} px, batch {batch} per rank"
    return line, [
        Row(f"DDP img/s per rank ({world} ranks, {backend})", f"{rate:.0f} ({rate / one:.2f} of one)", what),
        Row("DDP queues identical on every rank", str(same_queue), "keys gathered before enqueue", same_queue),
        Row("kNN bank sharded: peak per rank (GiB)", peaks if device == "cuda" else "n/a (CUDA memory stats)",
            f"{size['bank']} x {size['bank_dim']} over {world} ranks; same accuracy everywhere", same_knn),
    ]  # fmt: skip


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


CHECKS: dict[str, Callable[[str, dict, float], Result]] = {
    "fit": check_fit,
    "syncs": check_syncs,
    "split_bn": check_split_bn,
    "bf16_logits": check_bf16_logits,
    "knn_memory": check_knn_memory,
    "checkpoint": check_checkpoint,
    "throughput": check_throughput,
    "compile": check_compile,
    "multi_crop": check_multi_crop,
    "ddp": check_ddp,
}


def summary(rows: List[Row]) -> str:
    """The summary as a Markdown table."""
    head = ["figure", "value", "what it means", "pass / fail"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def run_one(args) -> int:
    """A check in this process (``--one``): its line and rows as JSON in ``--result``."""
    global NO_DALI
    NO_DALI = args.no_dali
    size = SIZES[args.size]
    toy = size is SIZES["toy"]
    deadline = time.time() + (0.0 if toy else args.seconds * LOOPS)
    try:
        line, rows = CHECKS[args.one](args.device, size, deadline)
    except Exception as e:  # report: the runner goes on with the other checks
        line, rows = (
            f"FAILED {type(e).__name__}: {e}",
            [Row(args.one, "FAILED", f"{type(e).__name__}: {str(e)[:120]}", False)],
        )
    with open(args.result, "w") as f:
        json.dump(dict(line=line, rows=[vars(r) for r in rows]), f)
    return 0


def run_in_process(args, check: str, seconds: float) -> Tuple[str, List[Row]]:
    """``check`` in a process of its own, killed after ``seconds``: (its line, its rows)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--one", check, "--device", args.device,
               "--size", args.size, "--seconds", f"{seconds:.1f}", "--result", result]  # fmt: skip
        try:
            code = subprocess.run(cmd + ["--no-dali"] * args.no_dali, timeout=seconds).returncode
        except subprocess.TimeoutExpired:
            why = f"did not finish within its share, {seconds:.0f} s: killed (give it more --minutes or run it alone)"
            return f"FAILED: {why}", [Row(check, "FAILED", why, False)]
        if not os.path.exists(result):
            why = f"its process exited with code {code} without a result"
            return f"FAILED: {why}", [Row(check, "FAILED", why, False)]
        with open(result) as f:
            got = json.load(f)
    return got["line"], [Row(**r) for r in got["rows"]]


def main(argv=None) -> int:
    from benchmarks._common import parser

    p = parser(__doc__)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=list(SIZES), default=None, help="default: full on CUDA, toy on the CPU")
    p.add_argument("--checks", nargs="+", choices=list(CHECKS), default=None, help="default: all, or --quick's")
    p.add_argument("--quick", action="store_true", help=f"the README's GPU table only: {', '.join(QUICK)}")
    p.add_argument("--minutes", type=float, default=None, help="time budget of the whole check (6; --quick 2.8)")
    p.add_argument("--no-dali", action="store_true", help="skip DALI's data path even where it is installed")
    p.add_argument("--summary", default="gpu_check_summary.md", help="the summary, rewritten after every check")
    for hidden in ("--one", "--result"):  # a check's own process
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.size = args.size or ("full" if args.device == "cuda" else "toy")
    from benchmarks._common import quiet

    quiet()
    if args.one:
        return run_one(args)
    checks = args.checks or list(QUICK if args.quick else CHECKS)
    minutes = args.minutes or (2.8 if args.quick else 6.0)
    name = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if args.device == "cuda" else "CPU"
    print(f"gpu_check on {name}: torch {torch.__version__}, {minutes:g} minutes, {args.size} sizes "
          f"{SIZES[args.size]}; summary in {args.summary}", flush=True)  # fmt: skip
    failed, rows, t0 = 0, [], time.time()
    budget = minutes * 60 - 10  # the summary
    total_share = sum(SHARES[c] for c in checks)
    for check in checks:
        t = time.perf_counter()
        seconds = budget * SHARES[check] / total_share
        if args.size == "toy":
            seconds = max(seconds, TOY_SECONDS)
        result, check_rows = run_in_process(args, check, seconds)
        rows += check_rows
        failed += result.startswith("FAILED")
        print(f"{check}: {result} [{time.perf_counter() - t:.1f} s]", flush=True)
        with open(args.summary, "w") as f:
            f.write(f"gpu_check on {name} ({time.time() - t0:.0f} s so far; {', '.join(checks)}):\n\n{summary(rows)}\n")
    print(f"\nsummary ({name}, {time.time() - t0:.0f} s):\n\n{summary(rows)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
