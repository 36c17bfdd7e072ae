"""The end-to-end mechanism of the MoCo paper (He et al. 2020, §3.2 and Fig. 2a): the keys come from the query
encoder itself, with gradients; the negatives are the other keys of the global batch, so the dictionary is as large
as the batch (SimCLR's design). No key encoder.

Select it in a config with ``model: {class_path: moco_lightning.EndToEnd, init_args: {...}}``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from torch import Tensor

from moco_lightning.errors import check_arguments
from moco_lightning.methods.contrastive import Contrastive, Terms
from moco_lightning.modules.dictionary import InBatch


class EndToEnd(Contrastive):
    """End-to-end: q and k from the same encoder, gradients through both; negatives = the rest of the global batch.
    Defaults: the MoCo paper's comparison of the three mechanisms (Fig. 3: v1's linear head and T 0.07).

    Args:
        head: ``"linear"`` (v1) or ``"mlp"`` (v2) projection head.
        symmetric: both views serve as query; loss = L(q1, k2) + L(q2, k1).
        temperature: T of the logits (v1: 0.07).
        **kwargs: ``dim``, ``hidden_dim``, ``temperature``, ``decay_norm_bias`` of
            :class:`~moco_lightning.methods.contrastive.Contrastive` and the backbone/optimizer arguments (no queue, no
            momentum, no shuffle BN: the keys come from the query encoder, in the same batch as their negatives).
    """

    STRUCTURAL = Contrastive.STRUCTURAL + ("head",)

    def __init__(
        self,
        head: Literal["linear", "mlp"] = "linear",
        symmetric: bool = False,
        temperature: float = 0.07,
        **kwargs: Any,
    ) -> None:
        check_arguments(type(self).__name__, EndToEnd.__init__, locals())
        super().__init__(temperature=temperature, **kwargs)
        self.dictionary = InBatch()

    def loss_terms(self, x_q: Tensor, x_k: Tensor, index: Optional[Tensor]) -> Terms:
        """q₁ against k₂ = the query encoder's embedding of x_k (with gradients), the batch's other keys as negatives;
        when symmetric, the second view's query is its key: nothing to recompute for L(q₂, k₁)."""
        h, q = self.query(x_q)
        k = self.query(x_k)[1]
        if not self.hparams.symmetric:
            return Terms(h, [(q, k, None)], [q], [k])
        return Terms(h, [(q, k, None), (k, q, None)], [q, k], [q, k])
