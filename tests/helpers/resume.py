"""The bit-equal resume check every method passes."""

from __future__ import annotations

import torch

from .data import tiny_data
from .models import tiny
from .trainers import cpu_trainer


def assert_resumes_bit_equal(cls, tmp_path, **kwargs) -> None:
    """A run of ``cls`` killed mid-epoch (its step-3 checkpoint of 2 epochs of 4 steps) and resumed ends with the
    weights, buffers and optimizer state of the run that was never interrupted (warm-up + cosine lr: the schedule
    continues, it does not restart)."""
    import torch
    from lightning.pytorch import seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(ckpt_path=None, callbacks=()):
        seed_everything(0, verbose=False)
        model = tiny(cls, **{"lr_schedule": "cosine", "warmup_epochs": 0.5, **kwargs})
        trainer = cpu_trainer(
            max_epochs=2, callbacks=list(callbacks), enable_checkpointing=bool(callbacks), limit_val_batches=0
        )
        trainer.fit(model, tiny_data(), ckpt_path=ckpt_path)
        return model, trainer.optimizers[0].state_dict()

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=3, filename="{step}")
    straight, straight_opt = run(callbacks=[checkpoint])
    resumed, resumed_opt = run(ckpt_path=tmp_path / "step=3.ckpt")
    assert straight.global_step == resumed.global_step == 8
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    for i, state in straight_opt["state"].items():
        for key, value in state.items():
            assert torch.equal(value, resumed_opt["state"][i][key]), (i, key)


def key_state(model) -> dict:
    """Copies of a model's momentum copy and dictionary (state-dict names ``key_*``, ``dictionary.*``)."""
    return {k: v.clone() for k, v in model.state_dict().items() if k.startswith(("key_", "dictionary."))}


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_epoch_resume_bit_equal(tmp_path, model_fn, data_fn, **trainer_kwargs) -> None:
    """Two epochs straight, and the same run resumed from its first epoch's checkpoint: the same state at the end."""
    from lightning.pytorch import seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(ckpt_path=None, callbacks=()):
        seed_everything(0, verbose=False)
        model = model_fn()
        trainer = cpu_trainer(max_epochs=2, callbacks=list(callbacks), enable_checkpointing=bool(callbacks),
                              **trainer_kwargs)  # fmt: skip
        trainer.fit(model, data_fn(), ckpt_path=ckpt_path)
        return model

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    straight = run(callbacks=[checkpoint])
    resumed = run(ckpt_path=tmp_path / "epoch=0.ckpt")
    assert_states_equal(straight.state_dict(), resumed.state_dict())
