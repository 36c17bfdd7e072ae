"""The compiler's and the devices' checks of :mod:`benchmarks.gpu_check`: ``compile`` and ``ddp``."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from typing import List

import torch

from benchmarks.gpu_harness import (
    Clock,
    Result,
    Row,
    ShardedKNNPeak,
    fit_rate,
    images_per_s,
    moco,
    synthetic_datamodule,
    trainer,
)


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
        model = moco(size, batch, image_size=image, compile=on, compile_backend=size["compile_backend"], width=1.0)
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
        f"resnet18 {image} px batch {batch}: eager {eager:.0f} img/s, compiled ({size['compile_backend']}) "
        f"{compiled:.0f} img/s "
        f"(x{compiled / eager:.2f}; whole fit {t_eager:.0f} s vs {t_compiled:.0f} s with compilation); "
        f"{len(log.recompiles)} recompilations, recompile limit hit {len(log.limit_hits)}x"
        + (f": {log.limit_hits[:2]}" if log.limit_hits else "")
    )
    return line, [
        Row("compile: compiled / eager img/s", f"{compiled / eager:.2f}",
            f"resnet18, {image} px, batch {batch}, {size['compile_backend']}"),
        Row("compile: recompilations / limit hits", f"{len(log.recompiles)} / {len(log.limit_hits)}",
            "train, no-grad keys, local views, eval kNN; a limit hit falls back to eager", not log.limit_hits),
    ]  # fmt: skip


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
