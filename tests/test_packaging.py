"""The installed package has one namespace: datamodules/ and callbacks/ land inside moco_lightning."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_one_namespace_and_imports(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=240,
    )
    wheel = next(tmp_path.glob("moco_lightning-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "moco_lightning/datamodules/fashion_mnist.py" in names
    assert "moco_lightning/callbacks/__init__.py" in names
    tops = {n.split("/")[0] for n in names}
    assert not tops & {"callbacks", "datamodules", "tests", "configs"}, tops
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    code = (
        "import moco_lightning, moco_lightning.datamodules as d, moco_lightning.callbacks;"
        "print(moco_lightning.__file__); print(d.FashionMNISTDataModule.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(site)),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith(str(site)) and "FashionMNISTDataModule" in out.stdout


def test_lightning_requirement_forwards_set_epoch_to_our_samplers():
    """Under DDP Lightning wraps the datamodules' seeded samplers; before 2.6.1 (Lightning #21454) the wrapper did
    not forward set_epoch, so every epoch repeated the first one's order and crops. setup.cfg requires the fix."""
    import configparser

    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    from moco_lightning.datamodules import SeededRandomSampler

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    requires = [
        r.strip()
        for r in cfg["options"]["install_requires"].splitlines()
        if r.strip() and not r.strip().startswith("#")
    ]
    assert "lightning>=2.6.1" in requires
    inner = SeededRandomSampler(20, seed=0)
    wrapper = DistributedSamplerWrapper(inner, num_replicas=2, rank=0, shuffle=False)
    first = list(wrapper)
    wrapper.set_epoch(1)
    assert inner.epoch == 1 and list(wrapper) != first
