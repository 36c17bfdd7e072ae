"""What is done with a trained encoder: reading it from a checkpoint or an export (``encoder``), exporting it
(``export``, with ``detection`` and ``deployment``), its features and kNN classification (``features``), embedding
a folder (``embed``), the evaluation protocol (``evaluate``), linear evaluation and fine-tuning (``linear_eval``) and
the evaluation's plots (``pictures``).

Imports: the core (:mod:`moco_lightning.modules`, :mod:`moco_lightning.training`, :mod:`moco_lightning.methods`) and
the datamodules' public names; never the callbacks or the CLI (the callbacks use these features, not the reverse).
"""
