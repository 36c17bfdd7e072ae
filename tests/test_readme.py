"""Every Python block of the README runs as written: extracted and executed in order (as doctests are), with
Lightning's Trainer and the Fashion-MNIST datamodule shrunk to two steps on 64 images, and the exported file the
export section loads written beforehand from the quickstart's own model settings.

Every command of the README's "Your own images" section runs too, in order, on a folder of Fashion-MNIST PNGs
written as a user would have it (RGB and grayscale, class folders, unlabelled images), each with the arguments of
:data:`SHRINK` appended (a few steps of small images); what they write is checked against the library's own
loaders: the section's end-to-end promise."""

import json
import pickle
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from helpers.cli import cli_main
from helpers.files import write_fashion_folder
from helpers.trainers import CPU_TRAINER, cpu_trainer
from lightning.pytorch import Trainer

import moco_lightning.datamodules as datamodules
from moco_lightning import MoCo
from moco_lightning.downstream.export import export_backbone

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
OWN_IMAGES = re.search(r"\n## Your own images\n(.*?)\n## ", README, flags=re.S)[1]
COMMANDS = [shlex.split(line) for block in re.findall(r"```bash\n(.*?)```", OWN_IMAGES, flags=re.S)
            for line in block.splitlines() if line.startswith("moco-lightning ")]  # fmt: skip
SHRINK = {  # appended to each command of the section: a few steps on 32-px images, one process
    "fit": ["--trainer.max_steps", "3", "--data.init_args.batch_size", "16", "--data.init_args.num_workers", "0",
            "--data.init_args.image_size", "32", "--model.init_args.image_size", "32",
            "--model.init_args.queue_size", "32", "--trainer.precision", "32-true"],
    "evaluate": ["--steps", "3"],
    "embed": ["--num_workers", "0"],
    "export": [],
}  # fmt: skip
NARROW = ["--model.init_args.width", "0.25"]  # the first run's ResNet-18 at a quarter width (the detection run: full)


class TinyTrainer(Trainer):
    """The Trainer a README block builds, at two steps on the CPU without logs or checkpoints."""

    def __init__(self, **kwargs):
        super().__init__(**{**kwargs, **CPU_TRAINER, "max_steps": 2, "limit_val_batches": 1})


class TinyFashionMNIST(datamodules.FashionMNISTDataModule):
    def __init__(self, **kwargs):
        kwargs.update(batch_size=32, train_subset=64, val_subset=32)
        super().__init__(**kwargs)


@pytest.fixture
def readme_world(tmp_path, monkeypatch, seeded):
    import lightning.pytorch

    monkeypatch.setattr(lightning.pytorch, "Trainer", TinyTrainer)
    monkeypatch.setattr(datamodules, "FashionMNISTDataModule", TinyFashionMNIST)
    monkeypatch.chdir(tmp_path)
    # backbone.pt, as `moco-lightning export` writes it for the quickstart's model (untrained: loading is tested)
    settings = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())["model"]
    trainer = cpu_trainer()
    trainer.strategy.connect(MoCo(**settings))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    export_backbone(tmp_path / "last.ckpt", tmp_path / "backbone.pt")
    # the "Your own images" section's folder and run, for its Python block (an untrained image_folder.yaml model)
    write_fashion_folder(tmp_path / "my_images", n_train=10, n_val=4, n_unlabelled=0)
    settings = yaml.safe_load((ROOT / "configs" / "image_folder.yaml").read_text())["model"]
    trainer = cpu_trainer()
    trainer.strategy.connect(MoCo(**{**settings, "width": 0.25}))  # narrower: the block's evaluation in seconds
    trainer.save_checkpoint(tmp_path / "runs" / "image_folder" / "version_0" / "checkpoints" / "last.ckpt")
    return tmp_path


def test_the_readme_has_the_blocks_this_test_checks():
    assert len(BLOCKS) == 4, [b.splitlines()[0] for b in BLOCKS]
    assert [c[1] for c in COMMANDS] == ["fit", "evaluate", "embed"] + ["export"] * 4 + ["fit"] + ["export"] * 2


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
@pytest.mark.parametrize("number", range(len(BLOCKS)))
def test_each_readme_python_block_runs_as_written(readme_world, number):
    names: dict = {}
    exec(compile(BLOCKS[number], f"README.md python block {number + 1}", "exec"), names)
    if "features" in names:  # the drop-in block: features of a batch of evaluation images
        assert names["features"].shape == (32, 512) and torch.isfinite(names["features"]).all()
    if "trainer" in names:  # the callbacks block: both monitors logged
        assert {"val/knn_acc1", "val/probe_acc1"} <= set(names["trainer"].callback_metrics)
    if "figures" in names:  # the own-images block: the evaluation of a folder
        assert set(names["figures"]["fractions"]) == {"0.1", "10/class"}
        assert names["figures"]["fractions"]["10/class"]["labels"] == 30 and names["figures"]["eval_images"] == 12
    module = names.get("backbone", names.get("model")) if number in (2, 3) else None
    if module is not None:  # the export blocks: the quickstart's narrow grayscale ResNet-18, its weights
        assert module.conv1.in_channels == 1 and module.layer4[0].conv1.out_channels == 256
        saved = torch.load(readme_world / "backbone.pt")
        assert all(torch.equal(v, saved[k]) for k, v in module.state_dict().items())


@pytest.mark.slow
def test_your_own_images_end_to_end(tmp_path, monkeypatch, seeded):
    """The section's commands in order: pretraining on the unlabelled and labelled PNGs, evaluate at 1 %, 10 % and
    10 images a class, embed, every export format; then each output read back and compared."""
    import numpy as np
    import onnxruntime
    from helpers.detection import official_converter
    from PIL import Image
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    from moco_lightning import load_backbone
    from moco_lightning.cli.evaluate import datamodule_of

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    write_fashion_folder(tmp_path / "my_images")  # 3 classes x (30 train + 10 val), 30 unlabelled
    for command in COMMANDS:
        narrow = NARROW if command[1] == "fit" and "detection" not in command else []
        assert cli_main(*command[1:], *SHRINK[command[1]], *narrow) == 0, command
    run = Path("runs/image_folder/version_0/checkpoints/last.ckpt")
    assert torch.load(run, weights_only=True)["global_step"] == 3
    ran = yaml.safe_load(Path("runs/image_folder/version_0/config.yaml").read_text())["data"]["init_args"]
    assert ran["unlabelled_dirs"] == ["unlabelled"]
    # evaluate reads the folder as the encoder was pretrained: its size and channels (32 px here), not 224 px
    folder = datamodule_of(None, "test", False, "my_images", str(run))
    assert (folder.image_size, folder.in_channels, folder.pretrain) == (32, 3, False)

    # evaluate: every label budget fine-tuned and from scratch, on the 30 val images
    result = json.loads(next(Path("runs/evaluate").rglob("evaluate.json")).read_text())
    assert result["train_images"] == 90 and result["eval_images"] == 30 and result["classes"] == 3
    assert {k: r["labels"] for k, r in result["fractions"].items()} == {"0.01": 3, "0.1": 9, "10/class": 30}
    for row in result["fractions"].values():
        assert 0 <= row["fine_tuned"] <= 1 and 0 <= row["from_scratch"] <= 1 and row["batch"] == min(64, row["labels"])

    # embed: a row per val image, load_backbone's features of the image through the recorded transform
    backbone, transform = load_backbone("backbone.pt", with_transform=True)
    backbone.eval()
    features = np.load("embeddings/features.npy", mmap_mode="r")
    index = Path("embeddings/index.csv").read_text().splitlines()[1:]
    assert features.shape == (30, 128) and len(index) == 30 and Path("embeddings/neighbours.png").is_file()
    images = torch.stack([transform(Image.open(line.split(",")[1])) for line in index[:5]])
    assert images.shape == (5, 3, 32, 32)  # the run's own size (shrunk to 32) and channels, from gray and RGB files
    with torch.no_grad():
        expected = backbone(images).numpy()
    np.testing.assert_allclose(features[:5], expected, rtol=1e-4, atol=1e-4)

    # programs: the same features at another batch size, without this library
    session = onnxruntime.InferenceSession("backbone.onnx", providers=["CPUExecutionProvider"])
    assert np.abs(session.run(["features"], {"images": images.numpy()})[0] - expected).max() < 1e-4
    with torch.no_grad():
        assert np.abs(torch.export.load("backbone.pt2").module()(images).numpy() - expected).max() < 1e-4
        assert np.abs(torch.jit.load("backbone.ts")(images).numpy() - expected).max() < 1e-4

    # detection: the official converter's names and arrays; the ResNet-FPN body takes its file strictly
    detection = torch.load("runs/detection/version_0/checkpoints/last.ckpt", weights_only=True)["state_dict"]
    state = {k[len("backbone.") :]: v for k, v in detection.items() if k.startswith("backbone.")}
    official = {k: v for k, v in official_converter(state).items() if not k.endswith("num_batches_tracked")}
    with open("moco_r18.pkl", "rb") as f:
        written = pickle.load(f)
    assert written["matching_heuristics"] and set(written["model"]) == set(official)
    assert all(np.array_equal(written["model"][k], v) for k, v in official.items())
    body = resnet_fpn_backbone(backbone_name="resnet18", weights=None).body
    body.load_state_dict(torch.load("fpn_body.pt"), strict=True)
    assert torch.equal(body.conv1.weight, state["conv1.weight"])


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


USER_PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_every_relative_link_of_the_user_facing_pages_resolves_and_no_issue_number_is_cited(page):
    """A link to a file names one that exists, an anchor a heading it has; a user cannot open this project's
    issues, so no page cites one by number."""
    text = page.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(target)
    assert not broken, broken
    assert not re.findall(r"(?<![\w/&`])#\d+\b", text), re.findall(r".{30}(?<![\w/&`])#\d+\b.{10}", text)
