"""MoCo v3 beside the official builder: the loss, the order of the encoders, the heads' initialisation, in-batch keys
with multi-crop."""

import copy

import torch
import torch.nn.functional as F
from helpers.models import tiny_moco
from torch import nn

from moco_lightning import MoCo, MoCoV3


# --- MoCo v3 and the paper's other dictionaries ---------------------------------------------
def test_v3_loss_equals_hand_computation_and_predictor_is_query_only(seeded):
    T = 0.5
    model = tiny_moco(MoCoV3, hidden_dim=16, temperature=T, momentum=0.99, momentum_schedule="cosine", optimizer="lars")
    assert (
        isinstance(model.projection_head.layers[-1], torch.nn.BatchNorm1d)
        and not model.projection_head.layers[-1].affine
    )
    assert not any(n.startswith("key_prediction") for n, _ in model.named_parameters())
    x1, x2 = torch.randn(6, 1, 28, 28), torch.randn(6, 1, 28, 28)
    model.train()
    loss = model.views_loss([x1, x2])["loss"]

    def q_of(x):
        return F.normalize(model.prediction_head(model.projection_head(model.backbone(x))), dim=1)

    def k_of(x):
        with torch.no_grad():
            return F.normalize(model.key_projection_head(model.key_backbone(x)), dim=1)

    labels = torch.arange(6)
    expected = (
        2
        * T
        * (F.cross_entropy(q_of(x1) @ k_of(x2).T / T, labels) + F.cross_entropy(q_of(x2) @ k_of(x1).T / T, labels))
    )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_v3_key_encoder_sees_x1_then_x2_as_the_official_builder(seeded):
    """The official v3 forward computes k1 = f_k(x1), then k2 = f_k(x2): the key encoder's BatchNorm running
    statistics follow that order (the other order, this library before, ends 3.5e-2 away after 4 steps)."""
    model = tiny_moco(MoCoV3, hidden_dim=16, optimizer="lars")
    x1, x2 = torch.randn(6, 1, 28, 28) + 2, torch.randn(6, 1, 28, 28) - 2
    official, swapped = copy.deepcopy(model.key_backbone), copy.deepcopy(model.key_backbone)
    model.train()
    model.views_loss([x1, x2])
    with torch.no_grad():
        official(x1), official(x2)
        swapped(x2), swapped(x1)
    bn = [m for m in model.key_backbone.modules() if isinstance(m, nn.BatchNorm2d)][0]
    bn_official = [m for m in official.modules() if isinstance(m, nn.BatchNorm2d)][0]
    bn_swapped = [m for m in swapped.modules() if isinstance(m, nn.BatchNorm2d)][0]
    torch.testing.assert_close(bn.running_mean, bn_official.running_mean, rtol=0, atol=1e-7)
    assert not torch.allclose(bn.running_mean, bn_swapped.running_mean, rtol=0, atol=1e-4)


def test_v3_resnets_start_with_zero_initialised_residual_branches():
    """As the official v3 (torchvision's zero_init_residual=True): the last BN of every block starts at 0, the key
    encoder is a copy; v2 and zero_init_residual=False keep torchvision's init."""
    v3 = MoCoV3(backbone="resnet18", width=0.25, in_channels=1, cifar_stem=True, image_size=28, hidden_dim=16, dim=8)
    blocks = [m for m in v3.backbone.modules() if type(m).__name__ == "BasicBlock"]
    assert len(blocks) == 8 and all(torch.count_nonzero(b.bn2.weight) == 0 for b in blocks)
    assert all(torch.count_nonzero(b.bn1.weight) > 0 for b in blocks)
    for a, b in zip(v3.backbone.state_dict().values(), v3.key_backbone.state_dict().values()):
        assert torch.equal(a, b)
    for model in (
        MoCoV3(backbone="resnet18", width=0.25, hidden_dim=16, dim=8, zero_init_residual=False),
        MoCo(backbone="resnet18", width=0.25, hidden_dim=16, dim=8, queue_size=16),
    ):
        assert all(torch.count_nonzero(m.bn2.weight) > 0 for m in model.backbone.modules() if hasattr(m, "bn2"))


def test_multi_crop_without_a_queue_gathers_each_global_key_once(seeded, monkeypatch):
    """In-batch negatives (v3) with multi-crop: 2 global + 3 local views, symmetric, are 2 + 6 loss terms over 2
    global keys: 2 all-gathers a step (it was one per term, 8; 14 with 6 local views), and the same loss."""
    from moco_lightning import MoCoV3
    from moco_lightning.modules import loss as loss_module

    model = tiny_moco(MoCoV3)
    model.eval()
    g1, g2 = torch.randn(6, 1, 28, 28), torch.randn(6, 1, 28, 28)
    locals_ = [torch.randn(6, 1, 14, 14) for _ in range(3)]
    calls = []
    from moco_lightning.methods import contrastive

    real = loss_module.gather_keys
    counted = lambda x, eq=False: calls.append(x) or real(x, eq)  # noqa: E731
    monkeypatch.setattr(loss_module, "gather_keys", counted)  # inside info_nce
    monkeypatch.setattr(contrastive, "gather_keys", counted)  # views_loss's one gather per global key
    loss = model.views_loss([g1, g2, *locals_])["loss"]
    assert len(calls) == 2
    with torch.no_grad():
        k1, k2 = (F.normalize(model.key_projection_head(model.key_backbone(g)), dim=1) for g in (g1, g2))
    torch.testing.assert_close(calls[0], k2)  # the keys of the first term (q1, k2), then of (q2, k1)
    torch.testing.assert_close(calls[1], k1)
    q = [model.query(x)[1] for x in (g1, g2, *locals_)]
    t = model.hparams.temperature

    def ce(q, k):  # in-batch: the positive of row i is key i
        return F.cross_entropy(q @ k.T / t, torch.arange(len(q)))

    terms = [ce(q[0], k2), ce(q[1], k1)] + [ce(lq, k) for lq in q[2:] for k in (k2, k1)]
    torch.testing.assert_close(
        loss, 2 * torch.stack(terms).mean() * 2 * model.hparams.temperature, rtol=1e-5, atol=1e-6
    )
