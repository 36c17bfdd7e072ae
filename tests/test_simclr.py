import os

import pytest
import torch
import torch.nn.functional as F
from helpers.data import tiny_data
from helpers.distributed import free_port, gloo_rank, run_ranks
from helpers.models import tiny
from helpers.trainers import cpu_trainer

from moco_lightning import SimCLR


def nt_xent(z0, z1, t):
    """By hand: each of the 2N embeddings against its other view (positive) and the 2N - 2 others (negatives)."""
    z = F.normalize(torch.cat([z0, z1]), dim=1)
    n = len(z0)
    sims = z @ z.T / t
    sims.fill_diagonal_(float("-inf"))  # not its own negative
    labels = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(sims, labels)


def test_loss_is_nt_xent_over_both_views_with_2n_minus_2_negatives(seeded):
    model = tiny(SimCLR, temperature=0.3)
    x0, x1 = torch.randn(6, 1, 28, 28), torch.randn(6, 1, 28, 28)
    out = model.views_loss([x0, x1])
    z0, z1 = model.projection_head(model.backbone(torch.cat([x0, x1]))).chunk(2)  # BN over the same 2N images
    torch.testing.assert_close(out["loss"], nt_xent(z0, z1, 0.3))
    from lightly.loss import NTXentLoss

    torch.testing.assert_close(model.criterion(z0, z1), NTXentLoss(temperature=0.3)(z0, z1))  # lightly's, the same
    assert out["features"].shape == (6, 16) and model(x0).shape == (6, 16)


def test_trains_and_its_weights_move(seeded):
    model = tiny(SimCLR)
    before = [p.clone() for p in model.backbone.parameters()]
    trainer = cpu_trainer(max_steps=3)
    trainer.fit(model, tiny_data())
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, model.backbone.parameters()))


def test_bad_temperature_names_the_field():
    with pytest.raises(ValueError, match="SimCLR: temperature=0"):
        tiny(SimCLR, temperature=0)


def _gather_worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, port):
        model = tiny(SimCLR, temperature=0.5)
        g = torch.Generator().manual_seed(0)
        z0, z1 = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)  # the global batch
        mine = slice(3 * rank, 3 * rank + 3)
        a, b = z0[mine].clone().requires_grad_(), z1[mine].clone().requires_grad_()
        loss = model.criterion(a, b)
        loss.backward()
        torch.save({"loss": loss.detach(), "grad": a.grad}, os.path.join(out_dir, f"simclr_{rank}.pt"))


@pytest.mark.slow  # several processes
def test_ddp_negatives_are_the_global_batch(tmp_path):
    """Two ranks of 3 images: each rank's loss uses all 2 x 6 - 2 = 10 negatives, and the mean over ranks is the
    loss of one process with the whole batch of 6; gradients flow through the gathered embeddings."""
    run_ranks(_gather_worker, free_port(), str(tmp_path))
    r = [torch.load(tmp_path / f"simclr_{i}.pt") for i in (0, 1)]
    g = torch.Generator().manual_seed(0)
    z0, z1 = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    z0.requires_grad_()
    whole = nt_xent(z0, z1, 0.5)
    whole.backward()
    torch.testing.assert_close((r[0]["loss"] + r[1]["loss"]) / 2, whole.detach())
    # each rank's rows get the gradient of the whole batch's loss (x 2 ranks: DDP then averages): a gather that cut
    # the gradient of the other rank's queries (its rows as their negatives) gives another one
    for i in (0, 1):
        torch.testing.assert_close(r[i]["grad"], 2 * z0.grad[3 * i : 3 * i + 3])


def test_local_views_are_refused_not_silently_dropped(seeded):
    views = [torch.randn(4, 1, 28, 28), torch.randn(4, 1, 28, 28), torch.randn(4, 1, 12, 12)]
    with pytest.raises(
        ValueError, match="SimCLR uses two views, but the batch has 3: set the datamodule's local_views"
    ):
        tiny(SimCLR).views_loss(views)


def test_logits_and_loss_are_fp32_under_bf16_autocast(seeded):
    """lightly's NT-Xent einsum gives bf16 logits under autocast; the loss must equal the fp32 one of the same z."""
    model = tiny(SimCLR, temperature=0.1)
    model.train()
    x0, x1 = torch.randn(16, 1, 28, 28), torch.randn(16, 1, 28, 28)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.views_loss([x0, x1])["loss"]
        z0, z1 = model.projection_head(model.backbone(torch.cat([x0, x1]))).float().chunk(2)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, model.criterion(z0, z1), rtol=1e-6, atol=1e-6)
