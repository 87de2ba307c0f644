"""The package's layering: every module imports first, and no import runs up a layer or closes a circle.

Layers are folders, bottom to top (a module may import its own layer and the ones below):

0. foundation -- ``seedckpt/utils`` (the user-facing error, progress, tensor helpers);
1. models -- ``models/``: one folder per family, its hooks, the registry;
2. checkpoint -- ``seedckpt/checkpoint``: bytes, formats, manifests, integrity, atomic publishing;
   no model, no fine-tuning;
3. features -- ``config``, ``data``, ``parallel``, ``materialize``, ``finetune``;
4. commands -- ``train`` (the trainer and its state), ``cli`` and the package's public API
   (``seedckpt.load_model``).

Every module must be in exactly one layer, and the package holds nothing but these folders, so a
new module is placed on purpose.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

from tests.dist import HANG_S

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("seedckpt", "models")

LAYERS = [
    ("foundation", ["seedckpt.utils", "seedckpt.utils.*"]),
    ("models", ["models", "models.*"]),
    ("checkpoint", ["seedckpt.checkpoint", "seedckpt.checkpoint.*"]),
    (
        "features",
        [
            f"seedckpt.{folder}{part}"
            for folder in ("config", "data", "parallel", "materialize", "finetune")
            for part in ("", ".*")
        ],
    ),
    ("commands", ["seedckpt"] + [f"seedckpt.{folder}{part}" for folder in ("train", "cli") for part in ("", ".*")]),
]


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def layer_of(module: str) -> int:
    matches = [i for i, (_, patterns) in enumerate(LAYERS) if any(fnmatch(module, p) for p in patterns)]
    assert len(matches) == 1, f"{module} must be in exactly one layer of tests/test_layers.py, is in {matches}"
    return matches[0]


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``module`` imports anywhere in its file (function-level imports too: a
    lazy import that closes a circle only moves the failure to the first call)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {name for name in found if name in known}


def test_every_module_is_in_one_layer():
    for module in modules():
        layer_of(module)


def test_no_import_runs_up_a_layer():
    known = modules()
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, path in known.items()
        for target in imports(module, path, set(known))
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "imports that run up a layer:\n" + "\n".join(upward)


def test_no_import_circles():
    known = modules()
    graph = {module: imports(module, path, set(known)) - {module} for module, path in known.items()}
    circles, state = [], {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join(trail[trail.index(target) :] + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


# One child per module, forked from an interpreter that has imported the third-party libraries but
# none of ours: each child's first import of the project is that module (an interpreter start per
# module would cost ~3 s each here).
_IMPORT_EACH_FIRST = """
import os, sys, traceback
import torch, torch.distributed.checkpoint, torch.distributed.fsdp, torch.distributed.pipelining, safetensors
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            __import__(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(name)
print("FAILED:" + ",".join(failed))
"""


def test_every_module_imports_first():
    names = sorted(name for name in modules() if not name.endswith(".__main__"))  # those run a command
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH_FIRST, *names], cwd=REPO, capture_output=True, text=True, timeout=HANG_S
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "FAILED:", result.stdout + result.stderr[-3000:]


def test_the_package_is_folders():
    """``seedckpt/`` holds its ``__init__`` and the layer folders, no loose module."""
    loose = [p.name for p in (REPO / "seedckpt").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside a folder: {loose}"
