import math
import os

import pytest
import torch
import torch.nn.functional as F
from lightly.loss import NTXentLoss

from moco_lightning.modules.loss import info_nce


def fixed(n, c, seed):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, c, generator=g, dtype=torch.float64), dim=1)


def test_info_nce_equals_hand_computation():
    q, k, queue, t = fixed(3, 4, 0), fixed(3, 4, 1), fixed(5, 4, 2), 0.07
    expected = 0.0
    for i in range(3):
        pos = math.exp(float(q[i] @ k[i]) / t)
        neg = sum(math.exp(float(q[i] @ queue[j]) / t) for j in range(5))
        expected += -math.log(pos / (pos + neg))
    loss, sims, labels = info_nce(q, k, queue, t)
    assert abs(loss.item() - expected / 3) < 1e-6
    assert sims.shape == (3, 6) and labels.tolist() == [0, 0, 0]


def test_in_batch_negatives_when_no_queue():
    q, k, t = fixed(4, 8, 3), fixed(4, 8, 4), 0.2
    expected = 0.0
    for i in range(4):
        row = [math.exp(float(q[i] @ k[j]) / t) for j in range(4)]
        expected += -math.log(row[i] / sum(row))
    loss, sims, labels = info_nce(q, k, None, t)
    assert abs(loss.item() - expected / 4) < 1e-6
    assert labels.tolist() == [0, 1, 2, 3]
    loss_empty, _, _ = info_nce(q, k, torch.empty(0, 8, dtype=q.dtype), t)
    assert loss_empty.item() == loss.item()


def test_equals_lightly_ntxent_with_memory_bank():
    q, k, queue, t = fixed(6, 16, 5).float(), fixed(6, 16, 6).float(), fixed(32, 16, 7).float(), 0.2
    lightly_loss = NTXentLoss(temperature=t, memory_bank_size=(32, 16))
    bank = lightly_loss.memory_bank.bank
    lightly_loss.memory_bank.bank = queue.T.clone() if bank.shape == (16, 32) else queue.clone()
    ours, _, _ = info_nce(q, k, queue, t)
    theirs = lightly_loss(q, k)  # q does not require grad: lightly leaves its bank untouched
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_logits_are_fp32_under_half_inputs():
    """Catches fp16 similarities behind an fp32 loss: the similarities' dtype is asserted, and the loss is compared
    with a float64 hand computation of the same (fp16-rounded) vectors at 1e-5 (fp16 products miss by ~1e-3)."""
    q, k, queue = fixed(4, 8, 8).half(), fixed(4, 8, 9).half(), fixed(16, 8, 10).half()
    loss, sims, _ = info_nce(q, k, queue, 0.07)
    assert loss.dtype == sims.dtype == torch.float32
    q64, k64, queue64 = q.double(), k.double(), queue.double()
    expected = 0.0
    for i in range(4):
        pos = math.exp(float(q64[i] @ k64[i]) / 0.07)
        neg = sum(math.exp(float(q64[i] @ queue64[j]) / 0.07) for j in range(16))
        expected += -math.log(pos / (pos + neg)) / 4
    assert abs(loss.item() - expected) < 1e-5
    torch.testing.assert_close(sims[:, 1:].double(), q64 @ queue64.T, rtol=0, atol=1e-6)
    assert (q @ queue.T).dtype == torch.float16  # what the product would be without the upcast


def test_similarities_and_loss_are_fp32_under_bf16_autocast():
    q, k, queue = (fixed(64, 128, s).float() for s in (5, 6, 7))
    queue = fixed(4096, 128, 8).float()
    reference = info_nce(q, k, queue, 0.2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, sims, labels = info_nce(q, k, queue, 0.2)
        bf16_products = q @ queue.T  # what the product gives under autocast when nothing prevents it
    assert sims.dtype == loss.dtype == torch.float32 and bf16_products.dtype == torch.bfloat16
    torch.testing.assert_close(sims, reference[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(loss, reference[0], rtol=1e-6, atol=1e-6)
    # the error the fp32 path avoids: bf16 negatives are off by far more than the tolerance above
    assert (bf16_products.float() - reference[1][:, 1:]).abs().max() > 1e-3


def _end_to_end_worker(rank: int, port: str, out_dir: str) -> None:
    from helpers.distributed import gloo_rank

    with gloo_rank(rank, port):
        q, k = _end_to_end_batch()
        mine = slice(3 * rank, 3 * rank + 3)
        q_mine, k_mine = q[mine].clone().requires_grad_(), k[mine].clone().requires_grad_()
        loss, _, _ = info_nce(q_mine, k_mine, None, temperature=0.2)
        loss.backward()
        torch.save({"loss": loss.detach(), "k_grad": k_mine.grad}, os.path.join(out_dir, f"e2e_{rank}.pt"))


def _end_to_end_batch():
    g = torch.Generator().manual_seed(0)
    return F.normalize(torch.randn(6, 8, generator=g), dim=1), F.normalize(torch.randn(6, 8, generator=g), dim=1)


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_end_to_end_keys_get_the_single_process_gradient_on_two_ranks(tmp_path):
    """In-batch negatives with gradients (the end-to-end mechanism): a rank's keys are negatives of the other rank's
    queries too, so their gradient on each rank is the whole batch's (x 2: DDP averages), not only this rank's share."""
    from helpers.distributed import free_port, run_ranks

    run_ranks(_end_to_end_worker, free_port(), str(tmp_path))
    q, k = _end_to_end_batch()
    k.requires_grad_()
    whole, _, _ = info_nce(q, k, None, temperature=0.2)
    whole.backward()
    ranks = [torch.load(tmp_path / f"e2e_{i}.pt") for i in (0, 1)]
    torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, whole.detach())
    for i in (0, 1):
        torch.testing.assert_close(ranks[i]["k_grad"], 2 * k.grad[3 * i : 3 * i + 3])
