"""The datamodule contract, written once: what a fit, the evaluation callbacks and ``evaluate`` read of a datamodule.

Every datamodule of this library meets all of it (:class:`~moco_lightning.datamodules.base.TwoViewDataModule`); a
datamodule of your own needs only what its use reads:

- :class:`TrainingData`, to pretrain: ``train_dataloader()`` giving ``([view_1, view_2, *local_views], target[,
  index])`` (or uint8 images that its ``on_after_batch_transfer`` turns into views on the device);
- :class:`EvaluationData`, for :class:`~moco_lightning.callbacks.KNNMonitor`, :class:`~moco_lightning.callbacks.
  LinearProbe` (without loaders or ``num_classes`` of their own) and ``evaluate``: :class:`EvaluationLoaders`, the
  train and held-out splits with the evaluation transform, in order, nothing dropped, ``(image, target[, index])``,
  and :class:`Classes`, ``num_classes``;
- :class:`LabelBudgets`, for ``evaluate``'s label budgets (``--fractions``, ``--per_class``) and a linear
  evaluation's ``label_fraction``: ``train_targets()`` and ``select_train(indices)``;
- :class:`Described`, optional: ``mean``, ``std``, ``image_size``, ``in_channels``, recorded in checkpoints as the
  evaluation transform (without them, an encoder's user gives them).

:func:`require` checks one at fit start (:class:`~moco_lightning.run.FitSetup`, for each callback's
``data_contract``: the contracts it reads) and in the command line, with one line naming what the datamodule lacks.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from moco_lightning.errors import ConfigError


@runtime_checkable
class TrainingData(Protocol):
    def train_dataloader(self) -> Any: ...


@runtime_checkable
class EvaluationLoaders(Protocol):
    def eval_train_dataloader(self) -> Any: ...

    def eval_val_dataloader(self) -> Any: ...


@runtime_checkable
class Classes(Protocol):
    num_classes: int


@runtime_checkable
class EvaluationData(EvaluationLoaders, Classes, Protocol):
    """The evaluation loaders and the number of classes."""


@runtime_checkable
class LabelBudgets(Protocol):
    def train_targets(self) -> Any: ...

    def select_train(self, indices: Any) -> Any: ...


@runtime_checkable
class Described(Protocol):
    mean: Sequence[float]
    std: Sequence[float]
    image_size: int
    in_channels: int


def members(contract: type) -> list[str]:
    """The names ``contract`` asks for (its own and its bases'), in the order they are written."""
    names: list[str] = []
    for c in reversed(contract.__mro__):
        if getattr(c, "_is_protocol", False) and c is not Protocol:
            own = [*vars(c).get("__annotations__", {}), *(n for n, v in vars(c).items() if callable(v))]
            names += [n for n in own if not n.startswith("_") and n not in names]
    return names


def lacks(datamodule: Any, contract: type) -> list[str]:
    """What of ``contract`` ``datamodule`` lacks (methods with ``()``)."""
    missing = [n for n in members(contract) if getattr(datamodule, n, None) is None]
    return [f"{n}()" if callable(getattr(contract, n, None)) else n for n in missing]


def require(datamodule: Any, contract: type, reader: str, remedy: Optional[str] = None) -> None:
    """One line when ``datamodule`` lacks part of ``contract``, naming it and ``reader`` (what reads it)."""
    if datamodule is None:
        raise ConfigError(
            f"{reader} reads the datamodule's {', '.join(lacks(None, contract))}, and the fit has no datamodule: "
            f"trainer.fit(model, datamodule=dm){'; ' + remedy if remedy else ''}"
        )
    missing = lacks(datamodule, contract)
    if missing:
        raise ConfigError(
            f"{type(datamodule).__name__} lacks {', '.join(missing)}, which {reader} reads "
            f"(moco_lightning.data_contract.{contract.__name__}): add {'them' if len(missing) > 1 else 'it'}"
            + (f", or {remedy}" if remedy else "")
        )
