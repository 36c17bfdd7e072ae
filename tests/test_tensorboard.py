"""ViewGrid and EmbeddingProjector write what TensorBoard reads back; without TensorBoard they do nothing."""

from __future__ import annotations

import io

import numpy as np
import pytest
from helpers.data import ToyData
from helpers.models import TinyNet
from helpers.trainers import trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moco_lightning.callbacks import EmbeddingProjector, KNNMonitor, ViewGrid


def test_views_scalars_and_projector_are_written(seeded, tmp_path):
    data = ToyData(size=8)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    callbacks = [ViewGrid(n_images=4), EmbeddingProjector(n_samples=20, class_names=["h", "v", "c"]), KNNMonitor(k=10)]
    trainer(max_epochs=1, logger=logger, callbacks=callbacks).fit(TinyNet(), datamodule=data)

    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    assert "val/knn_acc1" in tags["scalars"] and "val/knn_acc5" in tags["scalars"]
    assert [e.step for e in events.Scalars("val/knn_acc1")] == [0, 5]

    assert tags["images"] == ["train/views"]
    (image,) = events.Images("train/views")
    # make_grid: 4 images of 8 px per row, 2 rows (the two views), 2-px padding
    assert (image.width, image.height) == (4 * 10 + 2, 2 * 10 + 2)
    pixels = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("L"), dtype=np.int32)
    inner = np.concatenate(
        [pixels[2 + 10 * r : 10 * (r + 1), 2 + 10 * c : 10 * (c + 1)].ravel() for r in range(2) for c in range(4)]
    )
    # de-normalised: dark pixels (~0.1) and bright ones (~0.9) keep their grey levels; drawn as they are, the
    # normalised tensors ((x - 0.3) / 0.4: ~-0.5 and ~1.5) would be clipped to 0 and 255 almost everywhere
    assert np.mean((inner > 5) & (inner < 250)) > 0.8
    assert inner.max() - inner.min() > 150

    projector = logger.log_dir + "/projector_config.pbtxt"
    config = open(projector).read()
    assert 'tensor_name: "features:' in config
    folder = tmp_path / "tb" / "version_0" / "00006" / "features"  # global step 6 (6 batches)
    vectors = np.loadtxt(folder / "tensors.tsv", delimiter="\t")
    assert vectors.shape == (20, 16)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    metadata = (folder / "metadata.tsv").read_text().split()
    assert metadata == [["h", "v", "c"][i % 3] for i in range(20)]  # labels of the first 20 val images
    assert Image.open(folder / "sprite.png").size == (5 * 8, 5 * 8)  # ceil(sqrt(20)) = 5 thumbnails a side


@pytest.mark.parametrize("logger_kind", ["csv", "none"])
def test_without_tensorboard_they_warn_and_do_nothing(seeded, tmp_path, logger_kind):
    logger = CSVLogger(tmp_path) if logger_kind == "csv" else False
    with pytest.warns(UserWarning, match="TensorBoardLogger"):
        trainer(max_steps=2, logger=logger, callbacks=[ViewGrid(), EmbeddingProjector()]).fit(
            TinyNet(), datamodule=ToyData()
        )
    assert not list(tmp_path.rglob("projector_config.pbtxt"))


@pytest.mark.slow  # a subprocess / several processes
def test_the_tensorboard_server_serves_our_scalars_views_and_projector(seeded, tmp_path):
    """The real client: ``tensorboard`` started on a short MoCo run's folder (no sleeps: it names its own port once it
    serves, with the logs loaded), stopped by its PID."""
    import json
    import re
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    from helpers.data import tiny_data
    from helpers.models import tiny_moco
    from helpers.trainers import cpu_trainer

    from moco_lightning.callbacks import LinearProbe, RepresentationDiagnostics

    callbacks = [
        ViewGrid(n_images=4),
        EmbeddingProjector(n_samples=20),
        KNNMonitor(k=10),
        LinearProbe(),
        RepresentationDiagnostics(every_n_steps=1),
    ]
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    cpu_trainer(max_epochs=1, logger=logger, callbacks=callbacks, log_every_n_steps=1, limit_val_batches=0).fit(
        tiny_moco(), tiny_data()
    )
    exe = Path(sys.executable).with_name("tensorboard")
    # port 0: the server binds a free port itself (no port chosen here and released, which a parallel test could
    # take); --reload_task blocking: the logs are loaded before it serves, so its first answer is complete
    server = subprocess.Popen(
        [str(exe), "--logdir", str(tmp_path), "--host", "127.0.0.1", "--port", "0", "--load_fast", "false"]
        + ["--reload_interval", "0", "--reload_task", "blocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def get(path: str):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
            return json.loads(r.read())

    try:
        port = None
        for line in server.stderr:  # it says where it serves once it does: "... at http://127.0.0.1:PORT/ ..."
            found = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
            if found:
                port = int(found.group(1))
                break
        assert port is not None, "tensorboard exited without serving"
        wanted = {"train/loss", "val/knn_acc1", "val/probe_acc1", "diag/alignment", "diag/uniformity", "diag/queue_age"}
        scalars = get("/data/plugin/scalars/tags").get("run/version_0", {})
        assert wanted <= set(scalars), sorted(scalars)
        assert "train/views" in get("/data/plugin/images/tags")["run/version_0"]
        assert "run/version_0" in get("/data/plugin/projector/runs")
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
