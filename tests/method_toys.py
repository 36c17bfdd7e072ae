"""Tiny SimCLR / BYOL / SwAV modules for the method tests (the conftest's tiny backbone, small heads)."""

from conftest import tiny_backbone


def tiny(cls, **kwargs):
    args = dict(backbone=tiny_backbone(), in_channels=1, image_size=28, hidden_dim=32, dim=8, lr=0.06)
    args["lr_schedule"] = "constant"
    if cls.__name__ == "SwAV":
        args.update(n_prototypes=10, freeze_prototypes_epochs=0.0)
    args.update(kwargs)
    return cls(**args)
