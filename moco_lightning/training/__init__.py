"""The run's state around a method: the fit-start plan (``plan``), checkpoints and their safe reading
(``checkpoint``, ``checkpoint_io``), earlier versions' formats (``compat``), what a resumed or extended run carries
(``run_state``, ``log_history``), preemption and the NaN guard (``preemption``, ``nan_guard``) and
the precision chosen for a device (``precision``).

Imports: :mod:`moco_lightning.modules` and the package's helpers (``errors``, ``_lightning``); never the methods,
the run's callbacks (:mod:`moco_lightning.run`, which drive these), the
downstream side or the CLI.
"""
