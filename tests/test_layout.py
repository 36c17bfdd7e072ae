"""The package's layout is its architecture: sub-packages import one way, no import circle anywhere, small files (the
old module names: test_compat.py)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: installed name of each source folder (setup.cfg's package_dir)
FOLDERS = {"moco_lightning": ROOT / "moco_lightning", "moco_lightning.datamodules": ROOT / "datamodules",
           "moco_lightning.callbacks": ROOT / "callbacks"}  # fmt: skip
#: the layers, lowest first: a module may import its own layer and the ones below it, never one above
LAYERS = [
    (
        "moco_lightning.errors",
        "moco_lightning._lightning",
        "moco_lightning.version",
        "moco_lightning.constants",
        "moco_lightning.data_contract",
    ),
    ("moco_lightning.modules",),
    ("moco_lightning.training",),
    ("moco_lightning.run",),
    ("moco_lightning.methods",),
    ("moco_lightning.datamodules",),
    ("moco_lightning.downstream",),
    ("moco_lightning.callbacks",),
    ("moco_lightning.cli", "moco_lightning"),  # the command line reads the package's public names
    ("moco_lightning.__main__",),
]


def modules() -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the library."""
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def layer(name: str) -> int:
    """Index in :data:`LAYERS` of the longest prefix of ``name``."""
    best = max(
        ((len(prefix), i) for i, group in enumerate(LAYERS) for prefix in group
         if name == prefix or name.startswith(f"{prefix}.")),
        default=(0, -1),
    )  # fmt: skip
    assert best[1] >= 0, f"{name} belongs to no layer: add it to LAYERS"
    return best[1]


def imports(name: str, path: Path, known: set, module_level: bool) -> set[str]:
    """The library modules ``name`` imports (in functions too unless ``module_level``; a ``__main__`` block never)."""
    tree = ast.parse(path.read_text())
    skipped = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)
               for x in ast.walk(n)}  # fmt: skip
    nodes = tree.body if module_level else ast.walk(tree)
    found = set()
    for node in nodes:
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            source = ".".join(p for p in (base, node.module) if p)
            targets = [f"{source}.{a.name}" for a in node.names]
            targets += [source] if set(targets) - known else []  # names from the module, not sub-modules
        else:
            continue
        found |= {t for t in targets if t in known}
    return found - {name}


def test_imports_go_down_the_layers_only():
    """errors < parts (modules) < run state (training) < methods < datamodules < downstream < callbacks < cli and
    the package's public names: the core never imports the callbacks, the datamodules or the command line."""
    found = modules()
    assert len(found) > 60 and "moco_lightning.methods.moco" in found and "moco_lightning.cli.app" in found
    upward = {
        f"{name} -> {target}"
        for name, path in found.items()
        for target in imports(name, path, set(found), module_level=False)
        if layer(target) > layer(name)
    }
    assert not upward, sorted(upward)


def test_no_import_circle():
    """No import cycle anywhere in the tree, the datamodules and callbacks included, and imports inside functions or
    under ``TYPE_CHECKING`` counted too (a module that imports one that imports it back half-initialises one, and a
    lazy import only hides the knot)."""
    found = modules()
    assert {"moco_lightning.datamodules.base", "moco_lightning.callbacks.knn"} <= set(found)
    graph = {name: imports(name, path, set(found), module_level=False) for name, path in found.items()}

    def reaches(start: str) -> set:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    cycles = sorted(m for m in graph if m in reaches(m))
    assert not cycles, cycles


def test_every_sub_package_says_what_lives_there_and_what_it_may_import():
    for name, path in modules().items():
        if path.name == "__init__.py" and name != "moco_lightning":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert len(doc) > 100 and "import" in doc.lower(), f"{path}: say what lives here and what it imports"


@pytest.mark.parametrize(("folder", "limit"), [("moco_lightning", 400), ("datamodules", 300), ("callbacks", 300),
                                               ("benchmarks", 400)])  # fmt: skip
def test_no_file_over_its_line_limit(folder, limit):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > limit}  # fmt: skip
    assert not long, long


def test_help_lists_every_subcommand(capsys):
    from moco_lightning.cli import COMMANDS, SUBCOMMANDS, main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out.split("\n\n")[0]
    for command in (*SUBCOMMANDS, *COMMANDS):
        assert command in usage, (command, usage)
    assert set(COMMANDS) >= {"evaluate", "export", "embed", "linear"}
