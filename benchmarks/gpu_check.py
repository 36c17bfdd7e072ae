"""A prepared, self-contained check of moco-lightning on a CUDA machine: a few minutes, no dataset download.

    python benchmarks/gpu_check.py                  # on the GPU (the default when CUDA is available)
    python benchmarks/gpu_check.py --device cpu     # the same code at toy sizes (run by the tests)

What only a GPU can show, each printed as one line (``check: result``):

- ``fit``: MoCo + an in-memory datamodule (random uint8 images, views drawn batched on the device) trains a few
  steps in bf16-mixed: the first GPU batch does not crash on tensors left on the CPU; logits and queue stay fp32.
- ``syncs``: host-device synchronisations per training step, counted with ``torch.cuda.set_sync_debug_mode``
  over steps after the warm-up (Lightning's own included).
- ``split_bn``: CUDA kernels launched by one SplitBatchNorm2d forward (8 splits) and by a BatchNorm2d.
- ``bf16_logits``: the largest logit error at K = 65536 under bf16 autocast: ours (fp32 similarities) and a
  bf16 ``q @ queue.T``.
- ``knn_memory``: peak memory of the kNN monitor's evaluation for a bank of N x 2048 features, fp32 and bf16.
- ``checkpoint``: a checkpoint loaded with ``map_location="cuda"`` resumes training (the RNG states were saved as
  CPU tensors and are restored from wherever they were mapped).
- ``throughput``: MoCo v2 (``configs/moco_v2.yaml``: ResNet-50, K 65536) at 224 px in bf16-mixed and channels-last,
  images/s of (a) the bare encoder work on views already on the GPU, (b) the full ``fit`` step on those views,
  (c) the data path alone over a generated JPEG folder: PIL workers (crops in the workers, colour batched on the
  GPU) vs DALI (``device="mixed"``: nvJPEG), (d) ``fit`` with each data path. Goal: (d) with DALI >= 0.9 of (a).
- ``ddp_queue``: 2 DDP processes started with spawn (NCCL on 2 or more GPUs; gloo on the CPU, which the tests run):
  everything is pickled into them, and the queue must be identical on every rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from typing import Callable

import torch
from lightning.pytorch import Callback
from torch import nn

from moco_lightning.datamodules import InMemoryDataModule, view_settings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZES = {  # toy: seconds on a CPU; full: a GPU's minutes
    "toy": dict(image=16, batch=16, images=128, steps=4, queue=256, width=0.25, bank=4096, bank_dim=64,
                jpegs=16, big_image=32, big_batch=8, backbone="resnet18", workers=1, bench_steps=2, warmup=1),
    "full": dict(image=64, batch=256, images=8192, steps=30, queue=65536, width=1.0, bank=1_281_167, bank_dim=2048,
                 jpegs=2048, big_image=224, big_batch=128, backbone="resnet50", workers=12, bench_steps=30,
                 warmup=3),
}  # fmt: skip


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


class SaveQueue(Callback):
    """Writes each rank's queue at the end of training."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        torch.save(pl_module.queue.keys.cpu(), os.path.join(self.folder, f"q{trainer.global_rank}.pt"))


def synthetic_datamodule(size: dict, channels: int = 3):
    return Synthetic(view_settings("moco_v2", size["image"]), size["images"], size["image"], size["batch"], channels)


def moco(size: dict, **kw):
    from moco_lightning import MoCo

    args = dict(
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


def check_fit(device: str, size: dict) -> str:
    from lightning.pytorch import Callback

    seen = {}

    class Look(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.update(views=batch[0][0].device.type, loss=outputs["loss"].dtype)

    model = moco(size)
    t = time.perf_counter()
    # bf16-mixed here on the CPU too: what autocast does to the logits and the queue is the point of this check
    trainer(device, size["steps"], callbacks=[Look()], precision="bf16-mixed").fit(model, synthetic_datamodule(size))
    return (
        f"{size['steps']} steps in {time.perf_counter() - t:.1f} s; views on {seen['views']}, loss {seen['loss']}, "
        f"queue {model.queue.keys.dtype} on {model.queue.keys.device.type}, ptr {int(model.queue.ptr)}"
    )


def check_syncs(device: str, size: dict) -> str:
    if device != "cuda":
        return "n/a (CUDA only)"
    from lightning.pytorch import Callback

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
    return f"{len(syncs) / max(1, count.counted):.2f} per step over {count.counted} steps; at {where}"


def check_split_bn(device: str, size: dict) -> str:
    from torch.profiler import ProfilerActivity, profile

    from moco_lightning.split_bn import SplitBatchNorm2d

    x = torch.randn(size["batch"], 64, size["image"], size["image"], device=device).contiguous(
        memory_format=torch.channels_last
    )
    out = []
    for bn in (SplitBatchNorm2d(64, 8).to(device), nn.BatchNorm2d(64).to(device)):
        bn(x)
        activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            bn(x)
            if device == "cuda":
                torch.cuda.synchronize()
        kind = "kernels" if device == "cuda" else "ops"
        n = sum(1 for e in prof.events() if (e.device_type.name == "CUDA") == (device == "cuda"))
        out.append(f"{type(bn).__name__} {n} {kind}")
    return ", ".join(out)


def check_bf16_logits(device: str, size: dict) -> str:
    from moco_lightning.loss import contrastive_similarities

    g = torch.Generator(device=device).manual_seed(0)
    q, k = (nn.functional.normalize(torch.randn(256, 128, device=device, generator=g), dim=1) for _ in range(2))
    queue = nn.functional.normalize(torch.randn(size["queue"], 128, device=device, generator=g), dim=1)
    exact = contrastive_similarities(q.double(), k.double(), queue.double())[0]
    with torch.autocast(device, dtype=torch.bfloat16):
        ours = contrastive_similarities(q, k, queue)[0]
        naive = torch.cat([(q * k).sum(1, keepdim=True), q @ queue.T], 1)
    err = lambda s: (s.double() - exact).abs().max().item() / 0.2  # noqa: E731 - in logit units at T = 0.2
    return f"K {size['queue']}: max logit error ours {err(ours):.2e} ({ours.dtype}), bf16 product {err(naive):.2e}"


def check_knn_memory(device: str, size: dict) -> str:
    from torch.utils.data import DataLoader, TensorDataset

    from moco_lightning.callbacks.knn import knn_accuracy

    n, d = size["bank"], size["bank_dim"]
    feats = torch.randn(n, d)
    labels = torch.randint(0, 1000, (n,))
    bank = DataLoader(TensorDataset(feats, labels), batch_size=8192)
    queries = DataLoader(TensorDataset(feats[:10000], labels[:10000]), batch_size=8192)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        acc = knn_accuracy(
            nn.Identity(), bank, queries, num_classes=1000, device=torch.device(device), bank_dtype=dtype
        )
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        out.append(f"{str(dtype)[6:]} peak {peak:.2f} GiB, {time.perf_counter() - t:.1f} s, acc1 {acc['acc1']:.3f}")
    return f"bank {n} x {d}: " + "; ".join(out)


def check_checkpoint(device: str, size: dict) -> str:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from moco_lightning import MoCo

    with tempfile.TemporaryDirectory() as tmp:
        saver = ModelCheckpoint(dirpath=tmp, every_n_train_steps=2, save_top_k=-1)
        trainer(device, 2, callbacks=[saver], enable_checkpointing=True).fit(moco(size), synthetic_datamodule(size))
        path = os.path.join(tmp, os.listdir(tmp)[0])
        loaded = MoCo.load_from_checkpoint(path, map_location=device, weights_only=False)
        rng_device = loaded._rng_to_restore["torch"].device.type if loaded._rng_to_restore else "none"
        resumed = moco(size)
        trainer(device, 4).fit(resumed, synthetic_datamodule(size), ckpt_path=path)
        return (
            f"loaded with map_location={device!r} (RNG state tensors on {rng_device}); resumed from step 2 to step "
            f"{int(resumed.queue.enqueued_at.max())}"
        )


def write_jpegs(root: str, n: int, seed: int = 0) -> None:
    """``n`` smooth random 500x375 JPEGs in 4 class folders (content is irrelevant to throughput)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(n):
        small = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
        folder = os.path.join(root, "train", f"c{i % 4}")
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(small).resize((500, 375), Image.BICUBIC).save(os.path.join(folder, f"{i}.jpg"), quality=90)


def check_throughput(device: str, size: dict) -> str:
    """Images/s of the encoder work, the fit step, the data paths and fit with each (module docstring)."""
    import lightning.pytorch as pl

    from _common import config_path, from_config
    from step_overhead import SameBatch, bare_step

    out, n, steps, warm = {}, size["big_batch"], size["bench_steps"], size["warmup"]
    with tempfile.TemporaryDirectory() as tmp:
        write_jpegs(tmp, size["jpegs"])
        d = "--data.init_args."
        common = (
            f"{d}data_dir={tmp}",
            f"{d}val_dir=null",
            f"{d}image_size={size['big_image']}",
            f"{d}batch_size={n}",
            f"--model.backbone={size['backbone']}",
            f"--model.queue_size={size['queue']}",
            "--model.channels_last=true",
            f"--model.bn_splits={8 if n >= 64 else 2}",
        )
        paths = {
            "PIL": (f"{d}augment_on=device", f"{d}num_workers={size['workers']}"),
            "DALI": (f"{d}backend=dali", f"{d}num_workers={max(2, size['workers'] // 3)}"),
        }
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
            t = time.perf_counter()
            for _ in range(steps):
                step()
            sync(device)
        out["(a) bare encoder"] = n * steps / (time.perf_counter() - t)

        def fit_rate(model, **data) -> float:
            clock = []
            cb = type(
                "Clock", (pl.Callback,), {"on_train_batch_end": lambda self, *a: clock.append(time.perf_counter())}
            )
            trainer(device, steps + warm, callbacks=[cb()]).fit(model, **data)
            return n * (len(clock) - warm) / (clock[-1] - clock[warm - 1])

        same = ([v for v in views], torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device))
        loader = torch.utils.data.DataLoader(
            SameBatch(same, (steps + warm + 1) * n), batch_size=n, collate_fn=lambda b: b
        )
        out["(b) fit step, views on the device"] = fit_rate(
            from_config(config_path("moco_v2"), *common)[0], train_dataloaders=loader
        )
        for name, overrides in paths.items():
            model, dm = from_config(config_path("moco_v2"), *common, *overrides)
            dm.setup()
            it, t, k = iter(dm.train_dataloader()), time.perf_counter(), 0
            for b in it:
                if dm.views is not None:
                    dm.views([x.to(device) for x in b[0]] if isinstance(b[0], list) else b[0].to(device))
                k += n
                if k >= n * steps:
                    break
            sync(device)
            out[f"(c) data path alone, {name}"] = k / (time.perf_counter() - t)
            out[f"(d) fit with {name}"] = fit_rate(model, datamodule=dm)
    fit_dali, bare = out["(d) fit with DALI"], out["(a) bare encoder"]
    return "; ".join(f"{k} {v:.0f} img/s" for k, v in out.items()) + f"; DALI fit / bare = {fit_dali / bare:.2f}"


def check_ddp_queue(device: str, size: dict) -> str:
    """2 DDP processes started with spawn (what a multi-GPU node needs): NCCL on GPUs, gloo on the CPU."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        return f"n/a (needs 2 or more GPUs; {torch.cuda.device_count()} here)"
    from lightning.pytorch.strategies import DDPStrategy

    with tempfile.TemporaryDirectory() as tmp:
        strategy = DDPStrategy(start_method="spawn", find_unused_parameters=False)
        ddp = trainer(device, size["steps"], devices=2, strategy=strategy, callbacks=[SaveQueue(tmp)])
        ddp.fit(moco(size, shuffle_bn="ddp"), synthetic_datamodule(size))
        q0, q1 = (torch.load(os.path.join(tmp, f"q{r}.pt")) for r in (0, 1))
        backend = "NCCL" if device == "cuda" else "gloo"
        return f"2 ranks x {size['steps']} steps (spawn, {backend}): queues identical: {torch.equal(q0, q1)}"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


CHECKS: dict[str, Callable[[str, dict], str]] = {
    "fit": check_fit,
    "syncs": check_syncs,
    "split_bn": check_split_bn,
    "bf16_logits": check_bf16_logits,
    "knn_memory": check_knn_memory,
    "checkpoint": check_checkpoint,
    "throughput": check_throughput,
    "ddp_queue": check_ddp_queue,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=list(SIZES), default=None, help="default: full on CUDA, toy on the CPU")
    p.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    args = p.parse_args(argv)
    size = SIZES[args.size or ("full" if args.device == "cuda" else "toy")]
    from _common import quiet

    quiet()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"gpu_check on {name}: torch {torch.__version__}, sizes {size}", flush=True)
    failed = 0
    for check in args.checks:
        t = time.perf_counter()
        try:
            result = CHECKS[check](args.device, size)
        except Exception as e:  # report and go on: one broken check must not hide the others
            result, failed = f"FAILED {type(e).__name__}: {e}", failed + 1
        print(f"{check}: {result} [{time.perf_counter() - t:.1f} s]", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
