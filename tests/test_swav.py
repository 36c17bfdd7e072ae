import os

import pytest
import torch
import torch.nn.functional as F
from helpers.data import tiny_data
from helpers.distributed import free_port, gloo_rank, run_ranks
from helpers.models import tiny
from helpers.trainers import cpu_trainer
from lightly.loss.swav_loss import sinkhorn
from lightning.pytorch import Callback

from moco_lightning import SwAV


def codes_by_hand(scores, iterations, eps):
    """Sinkhorn-Knopp (SwAV, Algorithm 1 of the official code): alternately give every prototype 1/K and every
    sample 1/B of the mass; each sample's code then sums to 1."""
    q = torch.exp(scores / eps).T  # K x B
    q /= q.sum()
    k, b = q.shape
    for _ in range(iterations):
        q /= q.sum(dim=1, keepdim=True) * k
        q /= q.sum(dim=0, keepdim=True) * b
    return (q * b).T


def test_codes_sum_to_the_sinkhorn_marginals(seeded):
    model = tiny(SwAV, n_prototypes=10)
    scores = F.normalize(torch.randn(40, 8), dim=1) @ F.normalize(torch.randn(10, 8), dim=1).T
    codes = sinkhorn(scores, model.hparams.sinkhorn_iterations, model.hparams.sinkhorn_epsilon)
    torch.testing.assert_close(codes, codes_by_hand(scores, 3, 0.05))
    torch.testing.assert_close(codes.sum(1), torch.ones(40))  # every sample: one unit of assignment
    converged = sinkhorn(scores, 200, 0.05)
    torch.testing.assert_close(converged.sum(0), torch.full((10,), 40 / 10), atol=1e-3, rtol=0)  # equal partition
    assert (codes.sum(0) - 4).abs().max() < (torch.softmax(scores / 0.05, 1).sum(0) - 4).abs().max()


def test_loss_is_the_swapped_prediction_over_global_and_local_views(seeded):
    model = tiny(SwAV, n_prototypes=10, temperature=0.1)
    g1, g2 = torch.randn(4, 1, 28, 28), torch.randn(4, 1, 28, 28)
    l1, l2 = torch.randn(4, 1, 12, 12), torch.randn(4, 1, 12, 12)
    out = model.views_loss([g1, g2, l1, l2])
    c = F.normalize(model.prototypes.layer.weight, dim=1)  # views_loss() normalised them in place

    def scores(views):
        z = F.normalize(model.projection_head(model.backbone(torch.cat(views))), dim=1)
        return list((z @ c.T).chunk(len(views)))

    high, low = scores([g1, g2]), scores([l1, l2])

    def ce(s, q):
        return -(q * F.log_softmax(s / 0.1, dim=1)).sum(1).mean()

    terms = []
    for i in range(2):  # the codes of global view i, predicted by every other view
        q = codes_by_hand(high[i].detach(), 3, 0.05)
        others = [high[1 - i], *low]
        terms.append(sum(ce(s, q) for s in others) / len(others))
    torch.testing.assert_close(out["loss"], sum(terms) / 2)
    assert model.prototypes.layer.bias is None
    torch.testing.assert_close(model.prototypes.layer.weight.norm(dim=1), torch.ones(10))


class PrototypeWeights(Callback):
    def __init__(self):
        self.after_step = []

    def on_train_batch_end(self, trainer, model, outputs, batch, batch_idx):
        self.after_step.append(model.prototypes.layer.weight.detach().clone())


def test_prototypes_are_frozen_for_the_first_epoch_then_learn(seeded):
    model = tiny(SwAV, freeze_prototypes_epochs=0.5)  # 4 batches per epoch: the first 2 steps
    record = PrototypeWeights()
    cpu_trainer(max_steps=4, callbacks=[record]).fit(model, tiny_data())
    w = record.after_step
    torch.testing.assert_close(w[0], w[1], rtol=0, atol=1e-6)  # steps 0 and 1: renormalised (to 1 ulp), not updated
    assert (w[1] - w[2]).abs().max() > 1e-4 and (w[2] - w[3]).abs().max() > 1e-4  # then they learn
    assert any(not torch.equal(a, b) for a, b in zip(model.backbone.parameters(), tiny(SwAV).backbone.parameters()))


def test_multi_crop_batches_train_with_their_local_views_through_the_trainer(seeded):
    """Through the Trainer: each step's loss gets the 2 global and 2 local views, and the local views change it (a
    step that dropped them passed the old test, which checked only a finite loss)."""
    model = tiny(SwAV)
    original, seen = model.views_loss, []

    def recording(views, index=None):
        with torch.no_grad():  # first (the prototypes are normalised in place by each call): the global views alone
            without_local = original(views[:2])["loss"]
        out = original(views, index)
        seen.append(([tuple(v.shape[-2:]) for v in views], out["loss"].item(), without_local))
        return out

    model.views_loss = recording
    trainer = cpu_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(model, tiny_data(local_views=2, local_size=12))
    assert len(seen) == 2 and all(shapes == [(28, 28)] * 2 + [(12, 12)] * 2 for shapes, _, _ in seen)
    assert all(abs(loss - without_local.item()) > 1e-4 for _, loss, without_local in seen)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def test_bad_prototypes_name_the_field():
    with pytest.raises(ValueError, match="SwAV: n_prototypes=0"):
        tiny(SwAV, n_prototypes=0)


def _sinkhorn_worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, port):
        model = tiny(SwAV, n_prototypes=10)
        scores = torch.randn(8, 10, generator=torch.Generator().manual_seed(0)).tanh()  # the global batch
        crit = model.criterion
        codes = sinkhorn(
            scores[4 * rank : 4 * rank + 4], crit.sinkhorn_iterations, crit.sinkhorn_epsilon,
            gather_distributed=crit.sinkhorn_gather_distributed,
        )  # fmt: skip
        torch.save(codes, os.path.join(out_dir, f"codes_{rank}.pt"))


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_ddp_codes_are_computed_over_the_global_batch(tmp_path):
    """Each rank's codes of its 4 images equal its rows of one process's codes of all 8: the equal partition over
    the prototypes is of the global batch."""
    run_ranks(_sinkhorn_worker, free_port(), str(tmp_path))
    scores = torch.randn(8, 10, generator=torch.Generator().manual_seed(0)).tanh()
    together = torch.cat([torch.load(tmp_path / f"codes_{i}.pt") for i in (0, 1)])
    torch.testing.assert_close(together, codes_by_hand(scores, 3, 0.05))
    assert not torch.allclose(together[:4], codes_by_hand(scores[:4], 3, 0.05))  # not one rank's alone


def test_scores_and_loss_are_fp32_under_bf16_autocast(seeded):
    """The prototype Linear used to autocast to bf16, and Sinkhorn's exp(s/0.05) ran in bf16 (5.84375 vs 5.8456)."""
    model = tiny(SwAV)
    model.train()
    model.prototypes.normalize()
    views = [torch.randn(16, 1, 28, 28), torch.randn(16, 1, 28, 28)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores, _ = model.scores(views)
        loss = model.views_loss(views)["loss"]
    assert all(s.dtype == torch.float32 for s in scores) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, model.criterion(scores, []).squeeze(), rtol=1e-6, atol=1e-6)


class PrototypesAtEachStep(Callback):
    """Each rank's prototypes (unit rows) at the start and after every step, saved at the end."""

    def __init__(self, out_dir):
        self.out_dir, self.seen = out_dir, []

    def on_train_start(self, trainer, pl_module):
        self.seen.append(F.normalize(pl_module.prototypes.layer.weight.detach(), dim=1).clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(pl_module.prototypes.layer.weight.detach().clone())

    def on_train_end(self, trainer, pl_module):
        torch.save(self.seen, os.path.join(self.out_dir, f"prototypes{trainer.global_rank}.pt"))


@pytest.mark.slow  # a subprocess / several processes
def test_ddp_prototypes_stay_identical_on_both_ranks_and_unchanged_while_frozen(tmp_path):
    """A 2-rank SwAV fit (gloo, spawn), prototypes frozen for the first epoch (2 steps): they do not move while frozen,
    move after, and are the same on both ranks at every step (each rank sees other images: a prototype gradient that
    DDP did not all-reduce, as after a requires_grad toggle, would make them drift apart)."""
    from lightning.pytorch.strategies import DDPStrategy

    model = tiny(SwAV, n_prototypes=10, freeze_prototypes_epochs=1.0)
    ddp = DDPStrategy(start_method="spawn", find_unused_parameters=False)
    trainer = cpu_trainer(max_steps=4, max_epochs=2, devices=2, strategy=ddp, limit_val_batches=0)
    trainer.callbacks.append(PrototypesAtEachStep(str(tmp_path)))
    trainer.fit(model, tiny_data(batch_size=16, train_subset=64))  # 2 steps an epoch on each rank
    r0, r1 = (torch.load(tmp_path / f"prototypes{r}.pt") for r in (0, 1))
    assert len(r0) == len(r1) == 5
    for a, b in zip(r0, r1):
        assert torch.equal(a, b)
    torch.testing.assert_close(r0[1], r0[0])  # frozen: the start's unit rows
    torch.testing.assert_close(r0[2], r0[0])
    assert not torch.allclose(r0[3], r0[0]) and not torch.allclose(r0[4], r0[3])  # unfrozen: they learn
