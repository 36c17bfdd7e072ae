"""The algorithms' parts, one small module per concept: InfoNCE and the other losses (``loss``), the queue of
negative keys (``queue``) and the memory bank (``memory_bank``), the momentum (EMA) update and its schedules
(``momentum``), projection and prediction heads (``heads``), split BatchNorm for shuffle BN (``split_bn``), the
collectives of DDP (``distributed``), the backbones (``backbones``), the batch's views (``batches``) and the
optimizers and learning-rate schedules (``optim``).

Imports: torch, torchvision, lightly and :mod:`moco_lightning.errors` only; nothing from the methods, the training
run, the downstream side or the CLI.
"""
