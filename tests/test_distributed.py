"""MoCo under DDP, with 2 processes on CPU (gloo): the queue, shuffle BN, split BN, uneven batches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import free_port, gloo_rank, run_ranks
from helpers.models import no_bn_backbone, tiny_moco
from helpers.trainers import cpu_trainer
from lightning.pytorch import Callback, LightningDataModule, seed_everything
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

from moco_lightning import MoCo
from moco_lightning.modules.dictionary import KeyQueue
from moco_lightning.modules.distributed import concat_all_gather, shuffle_across_ranks, unshuffle_across_ranks
from moco_lightning.modules.split_bn import SplitBatchNorm2d, convert_split_bn
from moco_lightning.run import NanStop

pytestmark = pytest.mark.slow  # several processes

B, STEPS = 4, 3  # per-rank batch, optimizer steps


class Pairs(Dataset):
    def __init__(self, v1, v2):
        self.v1, self.v2 = v1, v2

    def __len__(self):
        return len(self.v1)

    def __getitem__(self, i):
        return (self.v1[i], self.v2[i]), 0


class GlobalBatches(LightningDataModule):
    """Global batch g is rows [g*2B, (g+1)*2B) in order; with 2 ranks, rank r gets its r-th half."""

    def __init__(self, per_rank: int):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.v1 = torch.randn(2 * B * STEPS, 1, 8, 8, generator=g)
        self.v2 = torch.randn(2 * B * STEPS, 1, 8, 8, generator=g)
        self.per_rank = per_rank

    def train_dataloader(self):
        rank, world = self.trainer.global_rank, self.trainer.world_size
        idx = [
            i
            for s in range(STEPS)
            for i in range(s * 2 * B + rank * self.per_rank, s * 2 * B + (rank + 1) * self.per_rank)
        ]
        assert world * self.per_rank == 2 * B
        return DataLoader(Pairs(self.v1[idx], self.v2[idx]), batch_size=self.per_rank, shuffle=False)


class Record(Callback):
    def __init__(self, out_dir):
        self.out_dir, self.losses = out_dir, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def on_train_end(self, trainer, pl_module):
        torch.save(
            {
                "queue": pl_module.dictionary.keys.clone(),
                "ptr": pl_module.dictionary.ptr.item(),
                "losses": self.losses,
                "backbone": {k: v.clone() for k, v in pl_module.backbone.state_dict().items()},
                "key_backbone": {k: v.clone() for k, v in pl_module.key_backbone.state_dict().items()},
                "ddp_ignores": sorted(getattr(trainer.strategy.model, "parameters_to_ignore", [])),
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}-of{trainer.world_size}.pt"),
        )


def test_ddp_queue_identical_on_ranks_and_equal_to_one_process(tmp_path):
    def model():
        seed_everything(0, verbose=False)
        return tiny_moco(backbone=no_bn_backbone(), image_size=8, queue_size=20, momentum=0.9, lr=0.5, shuffle_bn="off")

    cpu_trainer(max_steps=STEPS, callbacks=[Record(str(tmp_path))], limit_val_batches=0).fit(
        model(), GlobalBatches(2 * B)
    )
    ddp = DDPStrategy(start_method="spawn", find_unused_parameters=False)
    cpu_trainer(
        max_steps=STEPS,
        devices=2,
        strategy=ddp,
        callbacks=[Record(str(tmp_path))],
        limit_val_batches=0,
        use_distributed_sampler=False,
    ).fit(model(), GlobalBatches(B))
    single, r0, r1 = (
        torch.load(tmp_path / f, weights_only=True) for f in ("rank0-of1.pt", "rank0-of2.pt", "rank1-of2.pt")
    )
    # bit-identical dictionary on both ranks, 3 steps x 8 keys into K=20: wrapped around to slot 4
    assert torch.equal(r0["queue"], r1["queue"]) and r0["ptr"] == r1["ptr"] == single["ptr"] == (STEPS * 2 * B) % 20
    # DDP does not re-broadcast the queue from rank 0 (which would hide a missing gather): the ranks agree by themselves
    assert {"dictionary.keys", "dictionary.ptr", "dictionary.enqueued_at"} <= set(r0["ddp_ignores"])
    # ... and the same keys, in the same slots, as one process fed the same global batches
    torch.testing.assert_close(r0["queue"], single["queue"], rtol=1e-5, atol=1e-6)
    # the same loss (mean of the ranks' means) and the same query-encoder and key-encoder updates
    assert [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])] == pytest.approx(single["losses"], rel=1e-5)
    for name in single["backbone"]:
        torch.testing.assert_close(r0["backbone"][name], single["backbone"][name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r0["key_backbone"][name], single["key_backbone"][name], rtol=1e-5, atol=1e-6)
        assert torch.equal(r0["backbone"][name], r1["backbone"][name])


def _collectives_worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, port):
        results = {}
        # uneven batches: rank 0 holds 5 rows, rank 1 holds 3
        n = 5 if rank == 0 else 3
        x = torch.arange(n * 4, dtype=torch.float).view(n, 4) + 100 * rank
        gathered = concat_all_gather(x)
        results["gathered"] = gathered
        torch.manual_seed(rank)  # deliberately different global RNG per rank: the queue must not care
        queue = KeyQueue(6, 4)
        dist.broadcast(queue.keys, 0)  # what MoCo.on_fit_start does
        queue.enqueue(gathered, step=1)
        results["queue"], results["ptr"] = queue.keys.clone(), queue.ptr.item()
        # shuffle BN: the unshuffled output of a per-row function equals the unshuffled computation
        f = nn.Linear(4, 3)
        torch.manual_seed(0)
        f.reset_parameters()
        shuffled, state = shuffle_across_ranks(x, torch.Generator().manual_seed(7))
        results["shuffled"] = shuffled
        results["roundtrip"] = unshuffle_across_ranks(f(shuffled), state)
        results["direct"] = f(x)
        torch.save(results, os.path.join(out_dir, f"collectives{rank}.pt"))


def test_uneven_batches_gather_enqueue_and_shuffle_bn_inverse(tmp_path):
    run_ranks(_collectives_worker, free_port(), str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"collectives{r}.pt") for r in (0, 1))
    x0 = torch.arange(20, dtype=torch.float).view(5, 4)
    x1 = torch.arange(12, dtype=torch.float).view(3, 4) + 100
    expected = torch.cat([x0, x1])
    assert torch.equal(r0["gathered"], expected) and torch.equal(r1["gathered"], expected)
    # 8 keys into K=6: every key enqueued exactly once, in rank order; identical queues
    assert torch.equal(r0["queue"], r1["queue"]) and r0["ptr"] == r1["ptr"] == 8 % 6
    assert torch.equal(r0["queue"], torch.cat([expected[6:8], expected[2:6]]))
    # each rank encodes as many rows as it gave, drawn from both ranks, and gets its own rows back
    assert r0["shuffled"].shape == (5, 4) and r1["shuffled"].shape == (3, 4)
    assert sorted(torch.cat([r0["shuffled"], r1["shuffled"]])[:, 0].tolist()) == sorted(expected[:, 0].tolist())
    assert (r0["shuffled"][:, 0] >= 100).any() or (r1["shuffled"][:, 0] < 100).any()
    for r in (r0, r1):
        assert torch.equal(r["roundtrip"], r["direct"])


class KeyEncoderInputs(Callback):
    """Each rank's key views (``x_k`` of its batch) and what its key encoder was given, step by step."""

    def __init__(self, out_dir):
        self.out_dir, self.x_k, self.encoded = out_dir, [], []

    def on_train_start(self, trainer, pl_module):
        pl_module.key_backbone.register_forward_pre_hook(lambda m, args: self.encoded.append(args[0].detach().clone()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.x_k.append(batch[0][1].detach().clone())

    def on_train_end(self, trainer, pl_module):
        torch.save(
            {"x_k": self.x_k, "encoded": self.encoded}, os.path.join(self.out_dir, f"keys{trainer.global_rank}.pt")
        )


def shuffle_bn_fit(out: Path, tag: str, callbacks: list, ckpt_path: Optional[Path] = None) -> None:
    """A 2-rank MoCo fit with shuffle BN across ranks, 4 steps of 2 x 16 images, a checkpoint every 2 steps in
    ``out / tag`` (resumed from ``ckpt_path``)."""
    from helpers.data import tiny_data
    from lightning.pytorch.callbacks import ModelCheckpoint

    seed_everything(0, verbose=False)
    model = tiny_moco(shuffle_bn="ddp", queue_size=48)
    ddp = DDPStrategy(start_method="spawn", find_unused_parameters=False)
    saver = ModelCheckpoint(dirpath=out / tag, every_n_train_steps=2, save_top_k=-1)
    trainer = cpu_trainer(max_steps=4, devices=2, strategy=ddp, callbacks=[*callbacks, saver], limit_val_batches=0,
                          enable_checkpointing=True)  # fmt: skip
    trainer.fit(model, tiny_data(train_subset=128), ckpt_path=None if ckpt_path is None else str(ckpt_path))


@pytest.fixture(scope="module")
def shuffle_bn_run(tmp_path_factory) -> Path:
    """One :func:`shuffle_bn_fit` ("whole"), read by the shuffle-BN test and the resume test (one spawned pair of
    processes fewer; they share an xdist group)."""
    out = tmp_path_factory.mktemp("shuffle_bn_run")
    shuffle_bn_fit(out, "whole", [Record(str(out)), KeyEncoderInputs(str(out)), DrawFromGlobalRNG(str(out), "whole"),
                                  Counted(str(out))])  # fmt: skip
    return out


@pytest.mark.xdist_group("shuffle_bn_run")
def test_ddp_shuffle_bn_training_runs_and_keeps_queues_equal(shuffle_bn_run):
    """Shuffle BN across ranks: each rank's key encoder encodes a sub-batch drawn from the key views of *both* ranks
    (a shuffle that is drawn but not applied, or "ddp" treated as "off", leaves each rank its own rows), and the
    queues stay identical."""
    tmp_path = shuffle_bn_run
    r0, r1 = (torch.load(tmp_path / f"rank{r}-of2.pt", weights_only=True) for r in (0, 1))
    assert torch.equal(r0["queue"], r1["queue"]) and r0["ptr"] == 4 * 2 * 16 % 48
    for name, value in r0["key_backbone"].items():  # the same key encoder weights on both ranks
        if not name.endswith(("running_mean", "running_var", "num_batches_tracked")):
            assert torch.equal(value, r1["key_backbone"][name]), name
    # each rank's BN saw its own shuffled sub-batch: local statistics differ, as in the paper
    assert not torch.equal(r0["key_backbone"]["1.running_mean"], r1["key_backbone"]["1.running_mean"])
    k0, k1 = (torch.load(tmp_path / f"keys{r}.pt") for r in (0, 1))
    for step in range(4):
        own = [k0["x_k"][step], k1["x_k"][step]]
        for rank, keys in enumerate((k0, k1)):
            encoded = keys["encoded"][step]
            assert encoded.shape == own[rank].shape  # as many rows as the rank gave

            from_mine, from_other = (
                sum(any(torch.equal(row, other) for other in x) for row in encoded) for x in (own[rank], own[1 - rank])
            )
            assert from_mine + from_other == len(encoded) and from_mine > 0 and from_other > 0, (step, rank)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_split_bn_equals_bn_on_each_sub_batch(memory_format):
    torch.manual_seed(0)
    x = (torch.randn(12, 3, 5, 5) * 3 + 1).contiguous(memory_format=memory_format)
    split, plain = SplitBatchNorm2d(3, num_splits=3, momentum=0.1), nn.BatchNorm2d(3, momentum=0.1)
    with torch.no_grad():
        split.weight.uniform_(0.5, 2)
        split.bias.uniform_(-1, 1)
    plain.load_state_dict(split.state_dict(), strict=False)
    out = split(x)
    assert out.is_contiguous(memory_format=memory_format)  # channels-last stays channels-last for the next conv
    stats_mean, stats_var = [], []
    for chunk, y in zip(x.chunk(3), out.chunk(3)):
        ref = nn.BatchNorm2d(3, momentum=0.1)
        ref.load_state_dict(plain.state_dict())
        torch.testing.assert_close(y, ref(chunk), rtol=1e-5, atol=1e-5)
        stats_mean.append(ref.running_mean)
        stats_var.append(ref.running_var)
    torch.testing.assert_close(split.running_mean, torch.stack(stats_mean).mean(0))
    torch.testing.assert_close(split.running_var, torch.stack(stats_var).mean(0))
    assert not torch.allclose(out, plain(x), atol=1e-3)  # differs from whole-batch statistics
    split.eval()
    plain.eval()
    plain.load_state_dict(split.state_dict(), strict=False)
    torch.testing.assert_close(split(x), plain(x))


def test_convert_split_bn_keeps_torchvision_state_dict_keys():
    import torchvision

    model = torchvision.models.resnet18()
    keys = {k: v.shape for k, v in model.state_dict().items()}
    convert_split_bn(model, 4)
    assert isinstance(model.bn1, SplitBatchNorm2d) and model.layer1[0].bn1.num_splits == 4
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    with pytest.raises(ValueError, match="does not split into bn_splits=4"):
        model(torch.randn(6, 3, 32, 32))


def test_auto_shuffle_bn_is_split_on_one_device_and_key_shuffle_is_inverted(seeded):
    from helpers.data import tiny_data

    checked = {}

    class WhileFitting(Callback):  # split BN exists only while fitting (after fit: the user's BatchNorm2d again)
        def on_train_end(self, trainer, model):
            assert model._shuffle == "split" and isinstance(model.key_backbone[1], SplitBatchNorm2d)
            # with BN in eval mode the shuffled key path equals the plain one: the permutation is inverted exactly
            model.eval()
            x = torch.randn(16, 1, 28, 28)
            plain = model.key(x)
            model.train()
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
            torch.testing.assert_close(model.key(x), plain)
            model.train()
            checked["done"] = True

    model = tiny_moco(shuffle_bn="auto", bn_splits=4)
    cpu_trainer(max_steps=1, limit_val_batches=0, callbacks=[WhileFitting()]).fit(model, tiny_data())
    assert checked == {"done": True}
    assert type(model.key_backbone[1]) is nn.BatchNorm2d


def test_ddp_shuffle_on_one_process_is_a_clear_error(seeded):
    from helpers.data import tiny_data

    with pytest.raises(ValueError, match="shuffle_bn='ddp' needs a distributed run"):
        cpu_trainer(max_steps=1).fit(tiny_moco(shuffle_bn="ddp"), tiny_data())


def _v3_loss_worker(rank: int, port: int, out_dir: str) -> None:
    from moco_lightning.modules.loss import info_nce

    with gloo_rank(rank, port):
        g = torch.Generator().manual_seed(rank)
        q = torch.nn.functional.normalize(torch.randn(3, 4, generator=g), dim=1)
        k = torch.nn.functional.normalize(torch.randn(3, 4, generator=g), dim=1).requires_grad_()
        loss, _, labels = info_nce(q, k, None, 0.2, scale=0.4)
        loss.backward()
        torch.save(
            {"q": q, "k": k.detach(), "loss": loss.detach(), "labels": labels, "k_grad": k.grad},
            os.path.join(out_dir, f"v3_{rank}.pt"),
        )


def test_v3_loss_uses_the_global_batch_with_labels_offset_by_rank(tmp_path):
    run_ranks(_v3_loss_worker, free_port(), str(tmp_path))
    r = [torch.load(tmp_path / f"v3_{i}.pt") for i in (0, 1)]
    keys = torch.cat([r[0]["k"], r[1]["k"]])
    for rank in (0, 1):
        labels = torch.arange(3) + 3 * rank
        assert torch.equal(r[rank]["labels"], labels)
        expected = 2 * 0.2 * torch.nn.functional.cross_entropy(r[rank]["q"] @ keys.T / 0.2, labels)
        torch.testing.assert_close(r[rank]["loss"], expected)
        assert r[rank]["k_grad"].abs().sum() > 0  # the local keys keep their gradient (end-to-end mechanism)


# --- GPU-readiness: collective decisions, per-rank state, no size exchanges ------------------------------------
class NaNOnRank1(LightningDataModule):
    """Two-view batches of B random images; rank 1's batch ``bad_batch`` holds a NaN (only rank 1 sees it)."""

    def __init__(self, bad_batch: int = 1):
        super().__init__()
        self.bad_batch = bad_batch

    def train_dataloader(self):
        g = torch.Generator().manual_seed(self.trainer.global_rank)
        v1, v2 = torch.randn(B * STEPS, 1, 8, 8, generator=g), torch.randn(B * STEPS, 1, 8, 8, generator=g)
        if self.trainer.global_rank == 1:
            v1[self.bad_batch * B] = float("nan")
        return DataLoader(Pairs(v1, v2), batch_size=B, shuffle=False)


class RecordsItsError(NanStop):
    """The NaN stop, writing the error it raises on each rank (spawned ranks run no on_exception hooks); a user's own
    instance of the type, used instead of the module's."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def on_train_batch_end(self, trainer, pl_module, *args):
        try:
            return super().on_train_batch_end(trainer, pl_module, *args)
        except Exception as e:
            with open(os.path.join(self.out_dir, f"exception{trainer.global_rank}.txt"), "w") as f:
                f.write(f"{type(e).__name__}: {e}\nstep {trainer.global_step}")
            raise


def test_ddp_nan_on_one_rank_stops_every_rank_with_the_message(tmp_path):
    seed_everything(0, verbose=False)
    model = tiny_moco(backbone=no_bn_backbone(), image_size=8, queue_size=16)
    ddp = DDPStrategy(start_method="spawn", find_unused_parameters=False)
    # the guard reads its flags after Lightning's logging steps (batches 2, 4, ...): here after the bad batch's own
    # step (global step 1 in the message; its optimizer step done, global_step 2), before any checkpoint
    trainer = cpu_trainer(
        max_steps=STEPS, devices=2, strategy=ddp, limit_val_batches=0, use_distributed_sampler=False,
        log_every_n_steps=2, callbacks=[RecordsItsError(str(tmp_path))],
    )  # fmt: skip
    with pytest.raises(Exception, match="FloatingPointError"):
        trainer.fit(model, NaNOnRank1(bad_batch=1))
    for rank in (0, 1):  # both ranks stopped with the clear message, at the same step (not a broken connection)
        text = (tmp_path / f"exception{rank}.txt").read_text()
        assert text.startswith("FloatingPointError: MoCo:") and "at global step 1 (epoch 0, batch 1)" in text, text
        assert "Every rank stopped" in text and text.endswith("step 2")
    assert "another rank" in (tmp_path / "exception0.txt").read_text()  # rank 0's own loss was finite


def test_ddp_refuses_on_nan_skip_at_fit_start(tmp_path):
    ddp = DDPStrategy(start_method="spawn", find_unused_parameters=False)
    trainer = cpu_trainer(max_steps=STEPS, devices=2, strategy=ddp, limit_val_batches=0, use_distributed_sampler=False)
    with pytest.raises(Exception, match=r"on_nan='skip' cannot be used with 2 processes"):
        trainer.fit(tiny_moco(backbone=no_bn_backbone(), image_size=8, on_nan="skip"), NaNOnRank1())


class DrawFromGlobalRNG(Callback):
    """Gives each rank its own global RNG stream at fit start (unless resuming) and records one draw per step."""

    def __init__(self, out_dir, tag):
        self.out_dir, self.tag, self.draws = out_dir, tag, []

    def setup(self, trainer, pl_module, stage):
        torch.manual_seed(100 + trainer.global_rank)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.draws.append((trainer.global_step, torch.randint(0, 2**30, (1,)).item()))

    def on_train_end(self, trainer, pl_module):
        torch.save(self.draws, os.path.join(self.out_dir, f"{self.tag}{trainer.global_rank}.pt"))


class Counted(Callback):
    """Counts, on each rank, the all_gather calls that exchange one integer: the row counts of an uneven gather."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def setup(self, trainer, pl_module, stage):
        original = dist.all_gather
        self.count = 0

        def counting(out, t, *args, **kwargs):
            if t.numel() == 1 and t.dtype == torch.long:
                self.count += 1
            return original(out, t, *args, **kwargs)

        dist.all_gather = counting

    def on_train_end(self, trainer, pl_module):
        torch.save(self.count, os.path.join(self.out_dir, f"counts{trainer.global_rank}.pt"))


@pytest.mark.xdist_group("shuffle_bn_run")
def test_ddp_resume_continues_each_ranks_own_rng_stream_and_exchanges_no_batch_sizes(shuffle_bn_run, tmp_path):
    """Resumed at step 2's checkpoint (as if killed there), each rank's global RNG draws what it drew in the run
    never stopped (each rank has its own stream); Lightning's DistributedSampler gives equal batches on both ranks,
    so the gathers exchange no batch sizes."""
    whole_run = shuffle_bn_run
    assert [torch.load(whole_run / f"counts{r}.pt") for r in (0, 1)] == [0, 0]
    step_2 = next((whole_run / "whole").glob("*step=2.ckpt"))  # as if killed after step 2
    shuffle_bn_fit(tmp_path, "resumed", [DrawFromGlobalRNG(str(tmp_path), "resumed")], ckpt_path=step_2)
    for rank in (0, 1):
        whole = dict(torch.load(whole_run / f"whole{rank}.pt"))
        resumed = dict(torch.load(tmp_path / f"resumed{rank}.pt"))
        assert sorted(resumed) == [2, 3] and all(resumed[s] == whole[s] for s in (2, 3)), (rank, whole, resumed)
    assert dict(torch.load(whole_run / "whole0.pt"))[2] != dict(torch.load(whole_run / "whole1.pt"))[2]


class RecordLRs(Callback):
    """The lr of each optimizer step, saved per rank at the end (the callback runs in spawned processes)."""

    def __init__(self, out_dir, tag):
        self.out_dir, self.tag, self.lrs = out_dir, tag, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_end(self, trainer, pl_module):
        torch.save(self.lrs, os.path.join(self.out_dir, f"{self.tag}{trainer.global_rank}.pt"))


def test_another_number_of_processes_continues_at_an_epochs_end_and_is_refused_mid_epoch(tmp_path):
    """2 processes -> 1 at an epoch's end: the queue goes on, the cosine lr continues from the point the run had
    reached (each step of 16 images counts for half a planned step of 32) at half the peak; mid-epoch, one line
    refuses it (the epoch's rest is 2 ranks' shards). 1 -> 2 at the next epoch's end goes on the same way."""
    import warnings

    from helpers.data import tiny_data
    from helpers.models import cosine
    from lightning.pytorch.callbacks import ModelCheckpoint

    from moco_lightning.errors import ConfigError

    def run(devices, tag, ckpt_path=None):
        seed_everything(0, verbose=False)
        model = tiny_moco(lr_schedule="cosine", queue_size=48)
        ddp = dict(devices=2, strategy=DDPStrategy(start_method="spawn", find_unused_parameters=False))
        saver = ModelCheckpoint(dirpath=tmp_path / tag, every_n_train_steps=1, save_top_k=-1, filename="{step}")
        trainer = cpu_trainer(max_epochs=4, callbacks=[saver, RecordLRs(str(tmp_path), tag)], limit_val_batches=0,
                              enable_checkpointing=True, **(ddp if devices == 2 else {}))  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, tiny_data(), ckpt_path=ckpt_path)
        return trainer

    run(2, "two")  # 2 steps of 2 x 16 images an epoch: 8 steps, a checkpoint after each (4: epoch 1's end)
    with pytest.raises(ConfigError, match=r"written 1 batches into an epoch by 2 process\(es\), and this run has 1"):
        run(1, "refused", ckpt_path=tmp_path / "two" / "step=3.ckpt")
    from helpers.models import tiny_backbone  # its weights load in one process all the same (export, evaluation)

    loaded = MoCo.load_from_checkpoint(tmp_path / "two" / "step=3.ckpt", backbone=tiny_backbone())
    saved = torch.load(tmp_path / "two" / "step=3.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(v, saved[k]) for k, v in loaded.state_dict().items())
    one = run(1, "one", ckpt_path=tmp_path / "two" / "step=4.ckpt")  # 4 steps of 16 an epoch: 2 epochs left
    assert one.global_step == 12
    lrs = torch.load(tmp_path / "one0.pt")
    for step in range(4, 12):
        position = 4 + (step - 4) / 2  # of the 8 planned steps of 32 images
        assert lrs[step] == pytest.approx(0.06 * 16 / 256 * cosine(position, 8, 1.0, 0.0), rel=1e-6), step
    queue = torch.load(tmp_path / "one" / "step=12.ckpt", weights_only=True)["state_dict"]["dictionary.ptr"]
    assert int(queue) == (4 * 32 + 8 * 16) % 48  # the 2-process run's keys, then 8 steps of 16
    run(2, "again", ckpt_path=tmp_path / "one" / "step=8.ckpt")  # epoch 2's end (position 6 of 8): 1 epoch left
    again = torch.load(tmp_path / "again0.pt")
    assert sorted(again) == [8, 9]
    for step in (8, 9):
        assert again[step] == pytest.approx(0.06 * 32 / 256 * cosine(6 + step - 8, 8, 1.0, 0.0), rel=1e-6), step


def test_the_process_group_is_destroyed_at_exit_before_the_interpreter_shuts_down(tmp_path):
    """A gloo group left to the interpreter's finalisation sometimes aborted a finished 2-rank fit at exit (SIGABRT,
    "terminate called without an active exception"): ``end_process_group_at_exit`` destroys it in an atexit handler.
    The handler registered first runs last and sees the group gone."""
    import subprocess
    import sys

    script = f"""
import atexit
import torch.distributed as dist
from moco_lightning.modules.distributed import end_process_group_at_exit
dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
atexit.register(lambda: print("at exit, initialized:", dist.is_initialized(), flush=True))
end_process_group_at_exit()
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "at exit, initialized: False"
