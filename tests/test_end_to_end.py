"""The end-to-end mechanism: no key encoder, gradients through both views."""

import torch
from helpers.models import tiny_moco

from moco_lightning import EndToEnd


def test_batch_dictionary_has_no_key_encoder_and_gradients_through_both_views(seeded):
    model = tiny_moco(EndToEnd)
    assert not hasattr(model, "key_backbone") and not hasattr(model, "key_projection_head")
    assert not any(k.startswith("key_") for k in model.state_dict())
    x1, x2 = torch.randn(8, 1, 28, 28, requires_grad=True), torch.randn(8, 1, 28, 28, requires_grad=True)
    model.views_loss([x1, x2])["loss"].backward()
    assert x1.grad.abs().sum() > 0 and x2.grad.abs().sum() > 0
