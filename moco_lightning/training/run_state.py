"""What a moco-lightning checkpoint holds besides the weights, and a run's save, restore and continuation.

``checkpoint["moco_lightning"]``: the format version, the library version that wrote it, the class that wrote it,
the step plan of the schedules, the momentum copies (``{"backbone": "key_backbone", ...}``), and the global RNG
states (torch, numpy, Python, CUDA) of **every** rank, so that a resumed run continues each rank's own random stream
(only rank 0 writes the file: the states are gathered from all ranks while saving). The module side is
:class:`Resumable`: what a pretraining module offers the save and the restore.
"""

from __future__ import annotations

import random
import warnings
from typing import Any, Mapping, Optional, Protocol

import numpy as np
import torch

from moco_lightning.constants import FORMAT_VERSION
from moco_lightning.errors import ConfigError
from moco_lightning.modules.distributed import gather_objects, rank, world_size
from moco_lightning.training.compat import imported_class, stem_of_cifar_stem
from moco_lightning.version import __version__


class Resumable(Protocol):
    """What :func:`save_state`, :func:`restore_state` and :func:`continue_run` use of a module (the pretraining
    modules: :class:`~moco_lightning.methods.base.Pretraining`)."""

    STRUCTURAL: tuple  # the settings that change the shape of the weights
    hparams: Any
    step_plan: Any  # Optional[StepPlan]: the schedules' plan, saved and restored

    def finish_step(self) -> None: ...  # the after-step work (momentum update, store), idempotent

    def momentum_copies(self) -> dict[str, str]: ...

    def attached_trainer(self) -> Any: ...  # the Trainer, or None outside a fit


def rng_states() -> dict:
    """This process's global RNG states, as CPU tensors and plain types (``torch.load(weights_only=True)`` reads
    them)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        states["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return states


def set_rng_states(states: Mapping) -> None:
    """Restores :func:`rng_states`; tensors may have been mapped to another device on load (``map_location``)."""
    torch.set_rng_state(states["torch"].cpu().to(torch.uint8))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = states["python"]  # a round trip through some loaders turns the tuples into lists
    random.setstate((version, tuple(internal), gauss))
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu().to(torch.uint8) for s in cuda])


def metadata(**extra: Any) -> dict:
    """``checkpoint["moco_lightning"]``; a collective under DDP (every rank's RNG states are gathered)."""
    meta = {"format_version": FORMAT_VERSION, "version": __version__, "rng_states": gather_objects(rng_states())}
    meta.update({k: v for k, v in extra.items() if v is not None})
    return meta


def check_format(meta: Optional[Mapping], who: str) -> None:
    """A newer format is refused; a checkpoint without the library's entry (a run without its
    :class:`~moco_lightning.run.CheckpointEntry`, ``run_callbacks=False``) loads as a plain Lightning one, with a
    warning."""
    if meta is None:
        warnings.warn(
            f"{who}: the checkpoint has no 'moco_lightning' entry (it was written without the library's "
            "CheckpointEntry callback: run_callbacks=False, or by another LightningModule): its weights load as they "
            "are, the class that wrote it unchecked; a resumed run starts new random streams and a new schedule plan",
            stacklevel=3,
        )
        return
    if meta["format_version"] < FORMAT_VERSION:  # read by a checkpoint IO of the user's own: not upgraded
        raise ConfigError(
            f"{who}: checkpoint format {meta['format_version']} (moco-lightning {meta['version']}) is read through "
            "moco-lightning's reader, which upgrades it: load it with load_from_checkpoint, or fit without a "
            "checkpoint IO plugin of your own"
        )
    if meta["format_version"] > FORMAT_VERSION:
        raise ConfigError(
            f"{who}: checkpoint format {meta['format_version']} (moco-lightning {meta['version']}) is newer than "
            f"this moco-lightning {__version__} reads (format {FORMAT_VERSION}): upgrade moco-lightning"
        )


def saved_class(checkpoint: Mapping) -> Optional[str]:
    """The class path of the module that wrote ``checkpoint`` (recorded since format 3; the CLI's ``_class_path``
    before), or None."""
    meta = checkpoint.get("moco_lightning") or {}
    return meta.get("module") or (checkpoint.get("hyper_parameters") or {}).get("_class_path")


def checkpoint_class(checkpoint: Mapping, cls: type, where: str, remedy: str) -> type:
    """The class to build for ``checkpoint`` asked of ``cls``: the class that wrote it when that is ``cls`` or an
    already imported subclass of it (``Pretraining.load_from_checkpoint`` of a MoCo run builds a MoCo); else one
    line naming both classes (``where``: the file or flag; ``remedy``: what to do, ``{saved}`` the class's name and
    ``{path}`` its path), before the weights meet the module
    (torch's error lists every missing and unexpected key). The one check of every entry point: resuming, loading,
    the CLI's ``--ckpt_path``."""
    saved = saved_class(checkpoint)
    if not saved:
        return cls
    found = imported_class(saved)
    if found is not None and issubclass(found, cls):
        return found
    if saved.rsplit(".", 1)[-1] == cls.__name__:  # the same name, its module not imported (nothing is for a say-so)
        return cls
    raise ConfigError(
        f"{where}: the checkpoint is a {saved} run, not a {cls.__module__}.{cls.__qualname__} one: "
        + remedy.format(saved=saved.rsplit(".", 1)[-1], path=saved)
    )


def check_class(checkpoint: Mapping, cls: type) -> None:
    """:func:`checkpoint_class` when a run resumes or loads its weights into a module built already."""
    checkpoint_class(
        checkpoint,
        cls,
        cls.__name__,
        "resume it with {saved} (or its own config), or start a new run without ckpt_path",
    )


def check_structure(saved: Mapping, current: Mapping, fields: tuple, who: str) -> None:
    """One error naming every structural hyper-parameter in which a checkpoint and a model differ."""
    differ = [
        f"{k}: checkpoint {saved[k]!r}, model {current[k]!r}"
        for k in fields
        if k in saved and k in current and saved[k] != current[k]
    ]
    if differ:
        raise ConfigError(
            f"{who}: the checkpoint does not fit this model (" + "; ".join(differ) + "). Build the model with the "
            "checkpoint's settings (load_from_checkpoint does) or start a new run."
        )


def check_world_size(checkpoint: dict, meta: Mapping, who: str) -> None:
    """A checkpoint written inside an epoch resumes with the processes that wrote it: the rest of that epoch is this
    many ranks' shards of the sampler's order, which another number of processes would split otherwise (images
    trained twice or never). At an epoch's end any number goes on (the queue is every rank's, the lr and the
    schedules follow the new global batch)."""
    from moco_lightning._lightning import close_finished_epoch, saved_mid_epoch

    saved = meta.get("rng_states")
    then = len(saved) if isinstance(saved, (list, tuple)) else None
    if then is None or then == world_size():
        return
    close_finished_epoch(checkpoint)  # written at an epoch's last batch: that epoch is over, whatever its new length
    done = saved_mid_epoch(checkpoint)
    if done:
        raise ConfigError(
            f"{who}: the checkpoint was written {done} batches into an epoch by {then} process(es), and this run has "
            f"{world_size()}: the rest of that epoch is split among {then} ranks and cannot be continued by "
            f"{world_size()}; resume it with {then} (trainer.devices x num_nodes), or from a checkpoint written at an "
            "epoch's end (any number of processes)"
        )


def this_ranks_rng_states(meta: Mapping) -> Optional[dict]:
    """The saved RNG states of this rank."""
    saved = meta.get("rng_states")
    if saved is None:
        return None
    if len(saved) != world_size():
        warnings.warn(
            f"the checkpoint holds the RNG states of {len(saved)} process(es) and this run has {world_size()}: "
            "ranks without saved states start new random streams",
            stacklevel=2,
        )
        return saved[rank()] if rank() < len(saved) else None
    return saved[rank()]


def save_state(module: Resumable, checkpoint: dict) -> None:
    """The entry of a checkpoint being saved (:class:`~moco_lightning.run.CheckpointEntry`): the step being saved
    finished first (a callback's save at step N runs before the module's ``on_train_batch_end``: the checkpoint then
    holds N momentum updates and N steps' keys), then the metadata."""
    trainer = module.attached_trainer()
    if trainer is not None and trainer.training:
        module.finish_step()
        saved = checkpoint["state_dict"]
        saved.update({k: v for k, v in module.state_dict().items() if k in saved})
    plan = module.step_plan.state_dict() if module.step_plan is not None else None
    cls = type(module)
    checkpoint["moco_lightning"] = metadata(
        step_plan=plan,
        momentum_copies=module.momentum_copies(),
        module=f"{cls.__module__}.{cls.__qualname__}",
        eval_transform=eval_transform_of(getattr(trainer, "datamodule", None)),
    )


def eval_transform_of(datamodule: Any) -> Optional[dict]:
    """What the encoder's evaluation images are (``mean``, ``std``, ``image_size``, ``in_channels``, ``resize``):
    recorded in checkpoints and exports, so that features of new images are taken as in training; None for a
    datamodule that does not say."""
    values = {k: getattr(datamodule, k, None) for k in ("mean", "std", "image_size", "in_channels")}
    if any(v is None for v in values.values()):
        return None
    values["mean"], values["std"] = [float(v) for v in values["mean"]], [float(v) for v in values["std"]]
    # an image folder resizes its shorter side to eval_resize (None: size / 0.875) and centre-crops; in-memory
    # datasets are their whole image at image_size
    resize = datamodule.eval_resize if hasattr(datamodule, "eval_resize") else values["image_size"]
    return {**values, "resize": resize}


def check_checkpoint(module: Resumable, checkpoint: dict, resuming: bool) -> None:
    """A checkpoint read for ``module`` (by the Trainer's ``ckpt_path``, :class:`~moco_lightning.run.SafeCheckpoints`,
    or ``load_from_checkpoint``), before its weights meet the module: an older format upgraded in place, a newer
    one refused, the class that wrote it and its structure checked; when ``resuming`` a fit, the processes of a run
    cut mid-epoch."""
    who = type(module).__name__
    meta = checkpoint.get("moco_lightning")
    check_format(meta, who)
    check_class(checkpoint, type(module))
    current = dict(module.hparams)
    stem_of_cifar_stem(current)  # the module's own cifar_stem=True is stem "cifar", as the checkpoint's
    check_structure(checkpoint.get("hyper_parameters", {}), current, module.STRUCTURAL, who)
    if resuming and meta is not None:
        check_world_size(checkpoint, meta, who)


def resume_of(checkpoint: Mapping) -> dict:
    """What a run resumed from ``checkpoint`` continues: this rank's RNG states and the schedules' plan."""
    meta = checkpoint.get("moco_lightning") or {}
    return {"rng": this_ranks_rng_states(meta), "plan": meta.get("step_plan")}


def continue_run(module: Resumable, resume: dict) -> None:
    """At ``on_train_start`` of a resumed run: this rank's global RNGs continue where they were saved, the training
    loader at its next batch, the schedules as planned (stretched to another length, rescaled for another batch)."""
    from moco_lightning import _lightning
    from moco_lightning.training import plan

    if resume.get("rng") is not None:
        set_rng_states(resume["rng"])
    _lightning.load_pending_loader_states(module.trainer)
    if resume.get("plan") and module.trainer.ckpt_path and module.step_plan is not None:
        plan.continue_plan(module, module.step_plan)
