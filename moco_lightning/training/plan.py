"""The optimizer and the plan of a run's schedules (lr, momentum) over its optimizer steps.

- lr is given per 256 images and scaled by the global batch, per-device batch × devices × accumulation (He et al.
  2020, §4: "lr 0.03 for batch 256"; Goyal et al. 2017's linear scaling rule).
- :class:`StepPlan`: the steps the schedules are planned over, kept in the checkpoint. A run resumed with another
  length (``--trainer.max_epochs N+k``: "train longer") follows, from the step it resumes at, the schedules of a
  run planned for its new length, as if it had been planned so from the start; another global batch rescales the
  lr. :func:`change_length` (a budget measured inside a running fit) stretches the rest of the schedules instead.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Optional, Sequence

import torch

from moco_lightning._lightning import batches_done_in_epoch, ensure_train_dataloader
from moco_lightning.errors import ConfigError
from moco_lightning.modules import optim


class StepPlan:
    """The optimizer steps a run's lr and momentum schedules are planned over.

    :meth:`position` maps an optimizer step to its place on the schedules planned over ``planned`` steps; it is the
    step itself unless the length changed:

    - :meth:`replan` (a run resumed with another length): from ``step`` on, the schedules are those of a run planned
      for ``total`` steps, as if it had been planned so from the start (``planned`` becomes ``total``). A finished
      run extended with ``max_epochs N+k`` thus trains its added steps on the cosine of N+k epochs (at step s, the
      lr that run would have) instead of the end of the finished one (lr 0). Warm-up and milestones keep their steps.
    - :meth:`stretch` (a fit in progress given another length, :func:`change_length`): what is left of the planned
      schedules is stretched over the steps up to ``total``, piecewise linear through one knot per change
      (continuous at ``step``, the planned end at ``total``).

    Saved in the checkpoint, with the global batch the lr was scaled for.
    """

    def __init__(self, planned: float, warmup: int, milestones: Sequence[int], global_batch: int) -> None:
        self.planned, self.total, self.warmup, self.milestones = planned, planned, warmup, list(milestones)
        self.global_batch = global_batch  # what the lr is scaled for now
        self.unit_batch = global_batch  # the images of one planned step (the batch the run was planned with)
        self.knots: list[tuple[int, float]] = [(0, 0.0)]  # (step, position on the planned schedule)

    def position(self, step: int) -> float:
        if not math.isfinite(self.planned):
            return float(step)
        last_step, last_pos = self.knots[-1]
        if step >= last_step:
            span = self.total - last_step
            return last_pos + (step - last_step) * ((self.planned - last_pos) / span if span > 0 else 1.0)
        for (s0, p0), (s1, p1) in zip(self.knots, self.knots[1:]):
            if s0 <= step < s1:
                return p0 + (step - s0) * (p1 - p0) / (s1 - s0)
        return float(step)

    def replan(self, step: int, total: float, planned: Optional[float] = None) -> None:
        """From ``step`` on, the schedules of a run planned for ``planned`` steps (default ``total``: a run resumed with
        another length), reached at ``total``; the steps from ``step`` on advance by ``(planned - position(step)) /
        (total - step)`` each (another global batch: the share of a planned step that one new step is)."""
        here = self.position(step)
        self.knots, self.planned, self.total = [(step, here)], total if planned is None else planned, total

    def stretch(self, step: int, total: float) -> None:
        """From ``step`` on, what is left of the planned schedules spans the steps up to ``total``."""
        self.knots.append((step, self.position(step)))
        self.total = total

    def state_dict(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_state(cls, state: dict) -> "StepPlan":
        plan = cls(state["planned"], state["warmup"], state["milestones"], state["global_batch"])
        plan.total, plan.knots = state["total"], [tuple(k) for k in state["knots"]]
        plan.unit_batch = state.get("unit_batch", state["global_batch"])
        return plan


def configure_optimizers(module: Any, saved_plan: dict | None) -> tuple[dict, StepPlan]:
    """The optimizer of ``module.trained_modules()`` and its per-step lr schedule; a resumed run (``saved_plan``:
    the checkpoint's) keeps the plan it was written with."""
    hp, trainer = module.hparams, module.trainer
    batch = global_batch_size(module)
    optimizer = optim.build_optimizer(
        hp.optimizer,
        module.trained_modules(),
        hp.lr * batch / 256,
        hp.weight_decay,
        hp.sgd_momentum,
        hp.decay_norm_bias,
    )
    spe = steps_per_epoch(trainer)
    if saved_plan:
        plan = StepPlan.from_state(saved_plan)
    else:
        warmup, milestones = round(hp.warmup_epochs * spe), [m * spe for m in hp.lr_milestones]
        plan = StepPlan(trainer.estimated_stepping_batches, warmup, milestones, batch)
    if hp.lr_schedule == "cosine" and not math.isfinite(plan.planned):
        raise ConfigError("lr_schedule='cosine' needs a finite run: set trainer.max_epochs or trainer.max_steps")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, plan, hp.lr_schedule))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}, plan


def per_device_batch_size(module: Any) -> int:
    """The training batch of each process (one micro-batch)."""
    trainer = module.trainer
    return global_batch_size(module) // (trainer.world_size * trainer.accumulate_grad_batches)


def check_batch_size(module: Any) -> None:
    """A fit-start check: a pretraining batch holds at least 2 images on each process."""
    per_device = per_device_batch_size(module)
    if per_device < 2:
        raise ConfigError(
            f"{type(module).__name__} needs at least 2 images per batch, and the training batch of each process holds "
            f"{per_device} (data.batch_size): BatchNorm's statistics, the contrast between images and the codes of a "
            "batch need several; raise data.batch_size"
        )


def training_images(module: Any) -> Optional[int]:
    """The images the training loader serves in an epoch, all ranks together (its dataset's length), or None when
    that is not known (an iterable dataset, a loader without one)."""
    try:
        return len(module.trainer.train_dataloader.dataset)
    except (TypeError, AttributeError):
        return None


def check_accumulation(module: Any) -> None:
    """A fit-start check: gradient accumulation that changes during the run (``GradientAccumulationScheduler``) is
    refused: the lr (per 256 images, scaled by the global batch) and the lr and momentum schedules are planned over
    the run's optimizer steps at one accumulation (Lightning's ``estimated_stepping_batches`` ignores the
    scheduler), so they would end early or late and the lr would fit another batch."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    trainer = module.trainer
    for callback in trainer.callbacks:
        if not isinstance(callback, GradientAccumulationScheduler):
            continue
        last = trainer.max_epochs if trainer.max_epochs not in (None, -1) else math.inf
        factors = {callback.get_accumulate_grad_batches(epoch) for epoch in range(int(min(last, 1000)))}
        if len(factors) > 1:
            raise ConfigError(
                f"{type(module).__name__}: GradientAccumulationScheduler({callback.scheduling}) changes the gradient "
                "accumulation during the run, and the lr (given per 256 images, scaled by the global batch) and the "
                "lr and momentum schedules are planned over the optimizer steps of one accumulation; use "
                f"Trainer(accumulate_grad_batches={max(factors)}) (a constant accumulation) instead"
            )


def redirect_lr_finder(module: Any) -> None:
    """A ``LearningRateFinder`` (``Tuner.lr_find``) that would write its suggestion, an optimizer lr, into ``lr`` (per
    256 images) writes it into the module's ``optimizer_lr`` instead, which converts; one told to write into ``lr``
    is refused in one line."""
    from moco_lightning._lightning import lr_finder_attribute

    name = lr_finder_attribute(module.trainer, "optimizer_lr")
    if name in ("lr", "learning_rate", "hparams.lr"):
        raise ConfigError(
            f"{type(module).__name__}: lr_find(attr_name={name!r}) would write the optimizer's lr into lr, which is "
            "given per 256 images (the optimizer uses lr x global batch / 256): use attr_name='optimizer_lr' (or leave "
            "it unset), which converts"
        )


def lr_factor(plan: StepPlan, schedule: str, step: int) -> float:
    """The multiplier of the peak lr at optimizer ``step`` (``LambdaLR``'s), at the step's position on the plan as it is
    now (a resume may re-plan it): linear warm-up from 0 (``j / warmup``, as the official MoCo v3 code), then cosine
    to 0 (v2, v3), ×0.1 at each milestone (v1) or constant."""
    j = plan.position(step)
    if j < plan.warmup:
        return j / plan.warmup
    if schedule == "cosine":
        span = plan.planned - plan.warmup
        return (1 + math.cos(math.pi * min(j - plan.warmup, span) / max(span, 1))) / 2
    if schedule == "step":
        return 0.1 ** sum(j >= m for m in plan.milestones)
    return 1.0


def continue_plan(module: Any, plan: StepPlan) -> None:
    """On resume (``on_train_start``, everything restored): a run given another length follows the schedules planned
    for its new length from this step on; a run whose epochs hold another number of steps (other devices, another
    batch size, resumed at an epoch's end, ``max_epochs`` setting the end) continues its schedules from the point it
    had reached, each new step counting for its share of the planned ones; another global batch rescales the lr
    (given per 256 images). Each with a warning that says what changed, the step the run ends at and the lr."""
    trainer, step = module.trainer, module.global_step
    total, batch = steps_at_end(trainer, step), global_batch_size(module)
    ratio = batch / plan.global_batch
    by_steps = trainer.max_steps != -1 and total == trainer.max_steps  # max_steps sets the end: a length in steps
    share = 1.0 if by_steps else batch / plan.unit_batch  # what a step from now on counts for, in planned steps
    if math.isfinite(plan.planned) and step < total and (total != plan.total or share != 1):
        before, here = plan.total, plan.position(step)
        length = here + (total - step) * share  # the run's new length, in the steps of the planned schedules
        longer = abs(length - plan.planned) >= 1  # another length, not only another batch
        plan.replan(step, total, length if longer else plan.planned)
        factors = [lr_factor(plan, module.hparams.lr_schedule, s) for s in (step, int(total) - 1)]
        for config in trainer.lr_scheduler_configs:  # the restored lr is the old plan's: this step's on the new one
            scheduler = config.scheduler
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                group["lr"] = base * factors[0]
        peak = module.hparams.lr * batch / 256
        now, last = peak * factors[0], peak * factors[1]
        lrs = f"{module.hparams.lr_schedule} lr: {now:.4g} now, {last:.4g} at the last step"
        if longer:
            what = f"the lr and momentum schedules are those of a run planned for this length ({lrs})"
        else:
            what = (
                f"the lr and momentum schedules continue from where the run was ({here:g} of {plan.planned:g} "
                f"planned steps of {plan.unit_batch} images), each step of {batch} images counting for {share:g} "
                f"({lrs})"
            )
        warnings.warn(
            f"resumed at step {step}, the run now ends at step {int(total)} (the checkpoint's run was planned for "
            f"{before:g} steps): from step {step} on, {what}",
            stacklevel=2,
        )
    if ratio != 1:
        for config in trainer.lr_scheduler_configs:
            config.scheduler.base_lrs = [lr * ratio for lr in config.scheduler.base_lrs]
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= ratio
                if "initial_lr" in group:
                    group["initial_lr"] *= ratio
        warnings.warn(
            f"the global batch is {batch}, the checkpoint's run used {plan.global_batch}: lr (given per 256 "
            f"images) is rescaled by {ratio:g} to {module.hparams.lr * batch / 256:g} at the peak",
            stacklevel=2,
        )
        plan.global_batch = batch


def change_length(module: Any, total: int) -> None:
    """A fit in progress now ends at optimizer step ``total`` (e.g. a wall-time budget measured in the run): the
    rest of the lr and momentum schedules stretches over the steps left (:meth:`StepPlan.stretch`: continuous now,
    the planned end at ``total``), and the trainer stops there."""
    from moco_lightning._lightning import set_max_steps

    module.step_plan.stretch(module.global_step, total)
    set_max_steps(module.trainer, total)


def steps_at_end(trainer: Any, step: int) -> float:
    """The global step at which this (resumed) run will stop: max_steps, or the end of max_epochs from the
    position restored in the current epoch, whichever comes first (at ``on_train_start``)."""
    end = math.inf
    if trainer.max_epochs not in (None, -1) and math.isfinite(trainer.num_training_batches):
        batches = trainer.num_training_batches
        epoch, done = trainer.current_epoch, batches_done_in_epoch(trainer)  # 0 at an epoch's end
        end = step + ((trainer.max_epochs - epoch) * batches - done) // trainer.accumulate_grad_batches
    return min(end, trainer.max_steps) if trainer.max_steps != -1 else end


def steps_per_epoch(trainer: Any) -> int:
    """Optimizer steps per epoch (training batches over gradient accumulation), at least 1."""
    return max(1, math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches))


def global_batch_size(module: Any) -> int:
    """Per-device batch × devices × accumulation, from the training loader (loaded here when not yet)."""
    trainer = module.trainer
    loader = ensure_train_dataloader(trainer)
    batch_size = getattr(loader, "batch_size", None) or getattr(
        getattr(loader, "batch_sampler", None), "batch_size", None
    )
    if batch_size is None:
        raise ConfigError(
            f"{type(module).__name__} scales lr (given per 256 images) by the global batch size, but the training "
            "dataloader has no batch_size attribute; use a torch DataLoader with batch_size set"
        )
    return batch_size * trainer.world_size * trainer.accumulate_grad_batches
