"""The datamodule contract (moco_lightning.data_contract): every datamodule of the library meets it, and a fit whose
callbacks read what a user's datamodule lacks stops at its start with one line naming it."""

import pytest
import torch
from helpers.data import ToyData
from helpers.models import tiny_moco
from helpers.trainers import cpu_trainer
from torch.utils.data import DataLoader, TensorDataset

from moco_lightning.callbacks import KNNMonitor, LinearProbe
from moco_lightning.data_contract import (
    Classes,
    Described,
    EvaluationData,
    EvaluationLoaders,
    LabelBudgets,
    TrainingData,
    lacks,
    members,
)
from moco_lightning.errors import ConfigError


def test_the_contract_names_each_member_once():
    assert members(EvaluationData) == ["num_classes", "eval_train_dataloader", "eval_val_dataloader"]
    assert members(LabelBudgets) == ["train_targets", "select_train"]
    assert lacks(object(), EvaluationData) == ["num_classes", "eval_train_dataloader()", "eval_val_dataloader()"]


@pytest.mark.parametrize("name", ["FashionMNISTDataModule", "CIFAR10DataModule", "CIFAR100DataModule",
                                  "STL10DataModule", "ImageFolderDataModule"])  # fmt: skip
def test_every_datamodule_of_the_library_meets_the_whole_contract(name):
    import moco_lightning.datamodules as dms

    cls = getattr(dms, name)
    for contract in (TrainingData, EvaluationLoaders, LabelBudgets):
        assert not lacks(cls, contract), (name, contract.__name__)
    # the data members are set by the constructor: checked on an instance
    dm = dms.FashionMNISTDataModule(batch_size=8, train_subset=16, val_subset=8) if name.startswith("Fashion") else None
    if dm is not None:
        assert isinstance(dm, EvaluationData) and isinstance(dm, Described) and isinstance(dm, LabelBudgets)


class TrainingOnly(ToyData):
    """A user's datamodule with training batches only."""

    eval_train_dataloader = None
    eval_val_dataloader = None


def test_a_callback_that_reads_what_the_datamodule_lacks_stops_the_fit_at_its_start_naming_it(seeded):
    model = tiny_moco(in_channels=1, image_size=8, queue_size=8)
    trainer = cpu_trainer(max_steps=2, callbacks=[KNNMonitor(k=3)])
    with pytest.raises(ConfigError) as caught:
        trainer.fit(model, datamodule=TrainingOnly())
    said = str(caught.value)
    assert said.startswith("TrainingOnly lacks eval_train_dataloader(), eval_val_dataloader(), which KNNMonitor reads")
    assert "moco_lightning.data_contract.EvaluationLoaders" in said and "\n" not in said
    assert trainer.global_step == 0  # nothing trained


def test_without_a_datamodule_the_line_says_how_to_give_one(seeded):
    x = torch.rand(16, 1, 8, 8)
    loader = DataLoader(TensorDataset(x, x, torch.zeros(16)), batch_size=8, collate_fn=lambda b: ([torch.stack(
        [i[0] for i in b]), torch.stack([i[1] for i in b])], torch.zeros(len(b))))  # fmt: skip
    trainer = cpu_trainer(max_steps=2, callbacks=[LinearProbe()])
    with pytest.raises(ConfigError, match=r"LinearProbe reads the datamodule's num_classes, and the fit has no "
                                          r"datamodule: trainer.fit\(model, datamodule=dm\)"):  # fmt: skip
        trainer.fit(tiny_moco(in_channels=1, image_size=8, queue_size=8), loader)


def test_a_callback_given_its_own_loaders_and_classes_reads_nothing_of_the_datamodule(seeded):
    data = ToyData()
    knn = KNNMonitor(k=3, num_classes=3, bank_dataloader=data.eval_train_dataloader(),
                     val_dataloader=data.eval_val_dataloader())  # fmt: skip
    assert knn.data_contract == () and KNNMonitor(k=3).data_contract == (EvaluationLoaders, Classes)
    trainer = cpu_trainer(max_steps=2, limit_val_batches=0, callbacks=[knn])
    trainer.fit(tiny_moco(in_channels=1, image_size=8, queue_size=8), datamodule=TrainingOnly())
    assert trainer.global_step == 2 and knn.history
