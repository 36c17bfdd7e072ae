"""Files written by the previous release (0.2.0, the flat layout: ``tests/fixtures/release_0_2/make.py``) load in
this one and give the same features: a checkpoint through every reader, an export through ``load_backbone``; the old
module names import for one release with a ``DeprecationWarning``."""

from pathlib import Path

import pytest
import torch

from moco_lightning import Encoder, MoCo, load_backbone, load_transform
from moco_lightning.training.compat import current_path
from moco_lightning.training.run_state import imported_class

RELEASE = Path(__file__).parent / "fixtures" / "release_0_2"
SAVED = torch.load(RELEASE / "features.pt", weights_only=True)


def features(backbone: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return backbone.eval()(SAVED["x"])


def test_the_fixtures_are_the_previous_releases():
    checkpoint = torch.load(RELEASE / "MoCo.ckpt", weights_only=True)
    assert SAVED["version"] == "0.2.0" and checkpoint["moco_lightning"]["module"] == "moco_lightning.moco.MoCo"


@pytest.mark.parametrize("reader", ["load_from_checkpoint", "Encoder", "export"])
def test_a_previous_release_file_gives_the_same_features(reader):
    if reader == "load_from_checkpoint":
        got = features(MoCo.load_from_checkpoint(RELEASE / "MoCo.ckpt").backbone)
    elif reader == "Encoder":
        got = features(Encoder.read(RELEASE / "MoCo.ckpt").build()[0])
    else:
        got = features(load_backbone(RELEASE / "backbone.pt"))
    assert got.shape == SAVED["features"].shape == (4, 64)
    torch.testing.assert_close(got, SAVED["features"], rtol=0, atol=1e-6)


def test_its_export_keeps_its_evaluation_transform():
    from PIL import Image

    image = Image.fromarray((torch.rand(40, 30, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy())
    x = load_transform(RELEASE / "backbone.pt")(image)  # any PIL image: 1 channel, resize 32, centre crop 28
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32


def test_its_recorded_class_path_names_the_moved_class():
    assert current_path("moco_lightning.moco.MoCo") == "moco_lightning.methods.moco.MoCo"
    assert imported_class("moco_lightning.moco.MoCo") is MoCo


def test_the_old_module_names_import_the_same_objects_with_a_deprecation_warning_naming_the_new_path():
    """``from moco_lightning.queue import ...`` (the flat layout of 0.2) and ``moco_lightning.modules.queue`` (merged
    into ``modules.dictionary`` in 0.3.0) keep working for one release: the old name is the new module object, and
    importing it warns once with the path to use (timm's way: a warning, then removal)."""
    import importlib
    import sys
    import warnings

    from moco_lightning.training.compat import MOVED, REMOVED_IN

    assert len(MOVED) > 30
    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert importlib.import_module(old) is importlib.import_module(new), old
        said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
        assert said == [f"{old} is deprecated: import {new} (the module moved; the old name goes in moco-lightning "
                        f"{REMOVED_IN})"], (old, said)  # fmt: skip
    sys.modules.pop("moco_lightning.queue", None)
    with pytest.warns(DeprecationWarning, match="import moco_lightning.modules.dictionary") as caught:
        from moco_lightning.queue import KeyQueue
    assert caught[0].filename == __file__  # the warning points at the import line
    assert KeyQueue is importlib.import_module("moco_lightning.modules.dictionary").KeyQueue
    sys.modules.pop("moco_lightning.linear_eval", None)
    with pytest.warns(DeprecationWarning, match="import moco_lightning.downstream.linear_eval"):
        from moco_lightning.linear_eval import LinearClassifier
    assert LinearClassifier.__module__ == "moco_lightning.downstream.linear_eval"


def test_a_checkpoints_old_class_path_names_the_moved_class():
    from moco_lightning.methods.v3 import MoCoV3
    from moco_lightning.training.run_state import imported_class

    assert imported_class("moco_lightning.v3.MoCoV3") is MoCoV3
    assert imported_class("moco_lightning.MoCoV3") is MoCoV3
