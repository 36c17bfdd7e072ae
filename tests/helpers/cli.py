"""The command line in a test: in this process (a subprocess costs ~10 s of imports here), or as a subprocess
(kills, signals, several processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]


def in_process(*args: str, model: Optional[type] = None, quiet: bool = False) -> Any:
    """``moco-lightning *args`` in this process (``model``: the CLI over that module class, e.g.
    ``LinearClassifier``; default the pretraining methods, MoCo unless the config names another); the CLI object.
    ``quiet``: warnings ignored."""
    from moco_lightning import MoCo, Pretraining
    from moco_lightning.cli import run_cli

    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        if model is None:
            return run_cli(Pretraining, list(args), default_model=MoCo)
        return run_cli(model, list(args))


def built(config: Any, *overrides: str) -> Any:
    """The CLI of ``moco-lightning fit --config config *overrides`` built (model, datamodule, Trainer), not run."""
    from moco_lightning import MoCo, Pretraining
    from moco_lightning.cli import make_cli

    return make_cli(Pretraining, ["--config", str(config), *overrides], MoCo, run=False)


def cli_main(*args: str) -> int:
    """``moco-lightning *args`` through its ``main`` in this process (every command: export, evaluate, linear...);
    its exit code."""
    from moco_lightning.cli import main

    try:
        main(list(args))
    except SystemExit as e:
        return e.code
    return 0


def subprocess_env(**extra: str) -> dict:
    """A subprocess's environment: the tests' helpers importable (config class paths ``helpers.callbacks...``), one
    thread (runs with other thread counts sum their floats in another order: not bit-equal), unbuffered output."""
    return dict(os.environ, PYTHONPATH=str(ROOT / "tests"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)


def run(args: list, cwd: Any = None, timeout: int = 240, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """``args`` as a subprocess (``moco-lightning ...`` as ``python -m moco_lightning ...`` when it starts with
    "moco-lightning"), its output captured."""
    if args and args[0] == "moco-lightning":
        args = [sys.executable, "-m", "moco_lightning", *args[1:]]
    return subprocess.run(args, cwd=cwd, env=env or subprocess_env(), capture_output=True, text=True, timeout=timeout)


def run_module_forked(
    module: str, args: list, cwd: Any = ROOT, timeout: int = 300, env: Optional[dict] = None
) -> subprocess.CompletedProcess:
    """``python -m module *args`` in a child forked from this process: the module run as ``__main__`` (``runpy``,
    as ``-m`` does) with this process's imports already done (a fresh interpreter spends ~6-9 s importing torch,
    Lightning and torchvision before the first line of a benchmark or a fit). ``env``: the child's environment (as
    :func:`run` gives it: :func:`subprocess_env`), its torch threads ``OMP_NUM_THREADS``, as in a fresh interpreter.
    Its output captured (Lightning's log lines included); killed after ``timeout`` seconds
    (``subprocess.TimeoutExpired``, as :func:`subprocess.run`); a child ended by a signal has ``-signum`` as its
    return code, as :func:`subprocess.run` gives it."""
    import runpy

    def main() -> None:
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)

    return run_forked(main, [module, *args], cwd, timeout, env)


def run_script_forked(script: str, cwd: Any = ROOT, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -c script`` as :func:`run_module_forked` runs a module (the environment of :func:`subprocess_env`)."""
    return run_forked(lambda: exec(compile(script, "<string>", "exec"), {"__name__": "__main__"}), ["-c", script],
                      cwd, timeout, subprocess_env())  # fmt: skip


def run_forked(
    main: Any, name: list, cwd: Any = ROOT, timeout: int = 300, env: Optional[dict] = None
) -> subprocess.CompletedProcess:
    """``main()`` in a forked child, as :func:`run_module_forked` describes; ``name``: the command it stands for."""
    import logging
    import multiprocessing
    import tempfile

    def child(out: str, err: str) -> None:
        with open(out, "w") as o, open(err, "w") as e:
            os.dup2(o.fileno(), 1)
            os.dup2(e.fileno(), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        for name in (None, *logging.Logger.manager.loggerDict):  # handlers made on import hold pytest's stream
            for handler in getattr(logging.getLogger(name), "handlers", []):
                if type(handler) is logging.StreamHandler:
                    handler.stream = sys.stderr  # not setStream: it flushes the old stream, maybe a closed capture
        if env is not None:
            import torch

            os.environ.clear()
            os.environ.update(env)
            torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))
        os.chdir(cwd)
        code = 0
        try:
            main()
        except SystemExit as stop:  # as the interpreter: an int is the code, None 0, anything else printed, 1
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
        except KeyboardInterrupt:  # as the interpreter: a traceback and exit code 1
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        process = multiprocessing.get_context("fork").Process(target=child, args=(out, err))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(name, timeout)
        with open(out) as o, open(err) as e:
            stdout, stderr = o.read(), e.read()
    return subprocess.CompletedProcess(name, process.exitcode, stdout, stderr)
