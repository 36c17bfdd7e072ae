"""Cheap health signals of contrastive training, logged under ``diag/``.

- Alignment and uniformity (Wang & Isola, "Understanding Contrastive Representation Learning
  through Alignment and Uniformity on the Hypersphere", ICML 2020, https://arxiv.org/abs/2005.10242):
  ``align = E ||q - k||²`` over positive pairs (lower: views agree) and
  ``uniform = log E exp(-2 ||q_i - q_j||²)`` over pairs of distinct samples (lower: spread on the
  sphere; collapse drives it to 0). Both use the paper's defaults (alpha = 2, t = 2).
- ``diag/q_std``: mean per-dimension standard deviation of the normalised queries (Chen & He,
  SimSiam, https://arxiv.org/abs/2011.10566, §4.1): ~1/sqrt(dim) when healthy, 0 when collapsed.
- For MoCo-like modules (He et al. 2020, https://arxiv.org/abs/1911.05722, §3.2 "Momentum
  update"): the key encoder's relative parameter change per optimizer step,
  ``||θ_k(t) − θ_k(t−1)|| / ||θ_k(t−1)||`` (≈ (1 − m)·||θ_q − θ_k|| / ||θ_k||: too large and the keys
  are inconsistent, zero and the key encoder is frozen), and the mean age in steps of the keys in
  the queue (how stale the negatives are: about K / batch size steps once the queue is full).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightly.utils.debug import std_of_l2_normalized
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn

from moco_lightning.errors import ConfigError

from ._utils import log_now

__all__ = ["RepresentationDiagnostics", "alignment", "mean_queue_age", "uniformity"]


def alignment(q: Tensor, k: Tensor, alpha: float = 2.0) -> Tensor:
    """``E ||q_i - k_i||^alpha`` over the rows of two L2-normalised (N, D) tensors (Wang & Isola 2020)."""
    return (q.float() - k.float()).norm(dim=1).pow(alpha).mean()


def uniformity(x: Tensor, t: float = 2.0) -> Tensor:
    """``log E_{i<j} exp(-t ||x_i - x_j||²)`` over the rows of an L2-normalised (N, D) tensor (Wang & Isola 2020)."""
    return torch.pdist(x.float(), p=2).pow(2).mul(-t).exp().mean().log()


def mean_queue_age(enqueued_at: Tensor, step: int) -> tuple[float, float]:
    """``(mean age in steps of the written slots, fraction of slots written)``; slots at -1 were never written."""
    filled = enqueued_at >= 0
    if not bool(filled.any()):
        return float("nan"), 0.0
    return float((step - enqueued_at[filled]).float().mean()), float(filled.float().mean())


class RepresentationDiagnostics(Callback):
    """Logs ``diag/alignment``, ``diag/uniformity``, ``diag/q_std``, ``diag/key_rel_change``,
    ``diag/queue_age`` and ``diag/queue_filled`` every ``every_n_steps`` optimizer steps.

    Reads ``q`` and ``k`` (L2-normalised embeddings of the two views) from the dict returned by
    ``training_step`` (MoCo and BYOL return ``{"loss", "features", "q", "k"}``); without them those
    three are skipped. The key-encoder change needs the module's ``momentum_copies()``
    (``{"backbone": "key_backbone", ...}``, as :class:`moco_lightning.Pretraining` has); the queue age
    needs a ``dictionary`` submodule with a buffer ``enqueued_at`` (the global step at which each slot
    was written, -1 for never: :class:`moco_lightning.modules.dictionary.KeyQueue`). The callback only reads the
    module.

    For the key-encoder change a flat copy of its parameters is kept only from the step before a
    logging step to the logging step (one copy, every ``every_n_steps`` steps).

    Args:
        every_n_steps: log when ``trainer.global_step % every_n_steps == 0``.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._snapshot: Optional[Tensor] = None
        self._snapshot_step = -1
        self._last_logged = -1
        self.history: list[dict[str, float]] = []

    @staticmethod
    def key_encoder_parameters(pl_module: nn.Module) -> list[Tensor]:
        """The parameters of the module's momentum copies (none without ``momentum_copies()``)."""
        copies = getattr(pl_module, "momentum_copies", dict)()
        return [p for name in copies.values() for p in pl_module.get_submodule(name).parameters()]

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, n = trainer.global_step, self.every_n_steps
        key_params = self.key_encoder_parameters(pl_module)
        metrics: dict[str, float] = {}
        if step % n == 0 and step != self._last_logged:
            self._last_logged = step
            with torch.no_grad():
                metrics.update(self._embedding_metrics(outputs))
                if key_params and self._snapshot is not None and step > self._snapshot_step:
                    now = _flat(key_params)
                    change = (now - self._snapshot).norm() / self._snapshot.norm().clamp_min(1e-12)
                    metrics["diag/key_rel_change"] = float(change) / (step - self._snapshot_step)
                    self._snapshot = None
                queue = getattr(pl_module, "dictionary", None)
                enqueued_at = getattr(queue, "enqueued_at", None) if isinstance(queue, nn.Module) else None
                if isinstance(enqueued_at, Tensor):
                    age, filled = mean_queue_age(enqueued_at, step)
                    metrics["diag/queue_age"], metrics["diag/queue_filled"] = age, filled
        if key_params and (step + 1) % n == 0 and self._snapshot_step != step:
            # the next optimizer step is a logging step: keep θ_k as it is now
            self._snapshot = _flat(key_params)
            self._snapshot_step = step
        if metrics:
            self.history.append({"step": step, **metrics})
            log_now(trainer, metrics)

    @staticmethod
    def _embedding_metrics(outputs: Any) -> dict[str, float]:
        if not isinstance(outputs, dict) or outputs.get("q") is None:
            return {}
        q = outputs["q"].detach()
        metrics = {"diag/q_std": float(std_of_l2_normalized(q.float()))}
        if q.shape[0] > 1:
            metrics["diag/uniformity"] = float(uniformity(q))
        k = outputs.get("k")
        if k is not None and k.shape == q.shape:
            metrics["diag/alignment"] = float(alignment(q, k.detach()))
        return metrics


def _flat(params: list) -> torch.Tensor:
    """One fp32 vector of all parameters; reshape (not view) copes with channels-last weights."""
    return torch.cat([p.detach().reshape(-1).float() for p in params])
