"""The training step's checks of :mod:`benchmarks.gpu_check`: ``fit``, ``syncs``, ``split_bn``, ``bf16_logits``,
``knn_memory`` and ``checkpoint`` (what each measures: the module docstring there)."""

from __future__ import annotations

import os
import tempfile
import time
import warnings

import torch
from lightning.pytorch import Callback
from torch import nn

from benchmarks.gpu_harness import Result, Row, knn_loaders, moco, synthetic_datamodule, trainer


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
    from moco_lightning.modules.loss import info_nce

    g = torch.Generator(device=device).manual_seed(0)
    q, k = (nn.functional.normalize(torch.randn(256, 128, device=device, generator=g), dim=1) for _ in range(2))
    queue = nn.functional.normalize(torch.randn(size["queue"], 128, device=device, generator=g), dim=1)
    exact = info_nce(q.double(), k.double(), queue.double(), 1.0)[1]
    with torch.autocast(device, dtype=torch.bfloat16):
        ours = info_nce(q, k, queue, 1.0)[1]
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
