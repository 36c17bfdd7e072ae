"""The data path's checks of :mod:`benchmarks.gpu_check`: ``throughput`` (bare encoder, ``fit`` step, PIL and
DALI data paths) and ``multi_crop``."""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from typing import Optional

import torch

from benchmarks import gpu_harness
from benchmarks.gpu_harness import Result, Row, fit_rate, moco, precision, sync, synthetic_datamodule


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
    if gpu_harness.NO_DALI:
        return "--no-dali"
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
        return "nvidia-dali is not installed (pip install nvidia-dali-cuda130)"
    return None


def check_throughput(device: str, size: dict, deadline: float) -> Result:
    """Images/s of the encoder work, the fit step, the data paths and fit with each (module docstring)."""
    from benchmarks._common import config_path, forward_context, from_config
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
        step = bare_step(model, *views, forward_context("bf16-mixed" if device == "cuda" else "32-true", device))
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
