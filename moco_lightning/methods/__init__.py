"""The pretraining methods as LightningModules: the thin ``Pretraining`` base (``base``), the two-encoder contrastive
core (``contrastive``) and its small subclasses, each overriding what its paper changes: MoCo v1/v2 (``moco``),
MoCo v3 (``v3``), the end-to-end and memory-bank baselines of the MoCo paper (``end_to_end``, ``memory_bank_moco``),
SimCLR, BYOL and SwAV (``simclr``, ``byol``, ``swav``).

Imports: :mod:`moco_lightning.modules` and :mod:`moco_lightning.training`; never the downstream side or the CLI.
"""
