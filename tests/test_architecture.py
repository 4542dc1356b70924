"""The layers of ARCHITECTURE.md, checked against the code: every import points down a layer, the
control plane never loads JAX, and no library module or function grows past one job's size."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "resilient_jax")

# Module (or package) -> layer, lowest first; the longest matching prefix decides. A module may
# import its own package, or a module of a strictly lower layer. Keep equal to ARCHITECTURE.md.
LAYERS: dict[str, int] = {
    "resilient_jax.contracts": 0,
    "resilient_jax.config": 1,
    "resilient_jax.events": 1,
    "resilient_jax.topology": 2,
    "resilient_jax.chaos.spec": 2,
    "resilient_jax.perf": 2,
    "resilient_jax.control": 3,
    "resilient_jax.goodput": 3,
    "resilient_jax.mesh": 4,
    "resilient_jax.model": 4,
    "resilient_jax.executables": 4,
    "resilient_jax.agreement": 4,
    "resilient_jax.data": 5,
    "resilient_jax.decode": 5,
    "resilient_jax.train": 6,
    "resilient_jax.checkpoint": 7,
    "resilient_jax.health": 7,
    "resilient_jax.worker": 7,
    "resilient_jax.elastic": 7,
    "resilient_jax.chaos": 8,
    "resilient_jax.hf": 8,
    "resilient_jax.rehearsal": 8,
    "resilient_jax.precompile": 9,
    "resilient_jax.run": 9,
    "resilient_jax.sample": 9,
    "resilient_jax.testing": 10,
}
JAX_FREE = (
    "resilient_jax.control",
    "resilient_jax.goodput",
    "resilient_jax.chaos.spec",
    "resilient_jax.perf",
)
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "grain", "tensorstore")
MAX_LINES = 600
MAX_FUNCTION_LINES = 60
# Functions allowed past MAX_FUNCTION_LINES: the config's defaults, one assignment per key, are
# read as a table.
LONG_FUNCTIONS = {"resilient_jax.config.defaults.default_config"}


def _modules() -> dict[str, str]:
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


def _owner(module: str) -> str:
    """The longest LAYERS key that `module` is or lies under."""
    keys = [k for k in LAYERS if module == k or module.startswith(k + ".")]
    if not keys:
        raise AssertionError(f"{module} has no layer in LAYERS (and ARCHITECTURE.md)")
    return max(keys, key=len)


def _imports(module: str, path: str) -> list[tuple[int, str]]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod when it is a module
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
            out.append((node.lineno, base))
    return [(line, name) for line, name in out if name.startswith("resilient_jax")]


def _target(name: str, modules: dict[str, str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_every_module_has_a_layer_and_imports_only_lower_layers():
    modules = _modules()
    wrong: set[str] = set()
    for module, path in sorted(modules.items()):
        if module == "resilient_jax":  # the package's face: a docstring and a version
            continue
        mine = _owner(module)
        for line, name in _imports(module, path):
            target = _target(name, modules)
            if target is None or target == module or target == "resilient_jax":
                continue
            theirs = _owner(target)
            if theirs == mine or LAYERS[theirs] < LAYERS[mine]:
                continue
            wrong.add(
                f"{os.path.relpath(path, REPO)}:{line} imports {target} "
                f"(layer {LAYERS[theirs]} {theirs}) from layer {LAYERS[mine]} {mine}"
            )
    assert not wrong, "imports that do not point down a layer:\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize("module", JAX_FREE)
def test_control_plane_and_reports_never_load_jax(module):
    code = (
        f"import sys, {module}\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "", f"importing {module} loads {out.stdout.strip()}"


def test_library_modules_stay_small():
    long = {}
    for path in _modules().values():
        with open(path) as f:
            if (n := sum(1 for _ in f)) > MAX_LINES:
                long[os.path.relpath(path, REPO)] = n
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_library_functions_stay_short():
    long = {}
    for module, path in _modules().items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                name = f"{module}.{node.name}"
                if n > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS:
                    long[f"{os.path.relpath(path, REPO)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def _message_names_spelled_here(tree: ast.Module) -> list[tuple[int, str]]:
    """Module-level message-name constants, and dict literals whose `type` is a bare string."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.startswith(
                    ("MSG_", "CMD_", "PHASE_")
                ):
                    found.append((node.lineno, target.id))
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == "type"
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, str)
                ):
                    found.append((node.lineno, f'{{"type": {value.value!r}}}'))
    return found


_MESSAGE_NAMES = (
    "WorkerMessage",
    "AgentMessage",
    "AgentCommand",
    "StandbyMessage",
    "QuorumMessage",
    "TierRequest",
)


def _untyped_messages_here(tree: ast.Module) -> list[tuple[int, str]]:
    """Dict literals that carry a message name as their `type` (a message built by hand instead
    of as a typed `wire.Message`)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values, strict=True):
            if (
                isinstance(key, ast.Constant)
                and key.value == "type"
                and isinstance(value, ast.Attribute)
                and isinstance(value.value, ast.Name)
                and value.value.id in _MESSAGE_NAMES
            ):
                found.append((node.lineno, f"{{'type': {value.value.id}.{value.attr}}}"))
    return found


def test_every_message_on_the_wire_is_typed():
    """Every message the library sends is a `control.wire.Message` dataclass, encoded and decoded
    in one place: no dict literal carries a message name."""
    untyped = []
    for path in _modules().values():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        untyped += [
            f"{os.path.relpath(path, REPO)}:{n} {what}" for n, what in _untyped_messages_here(tree)
        ]
    assert not untyped, "messages built by hand:\n" + "\n".join(untyped)


def test_message_names_are_spelled_only_in_contracts():
    """Names that cross a process boundary are spelled once, in `contracts/messages.py`."""
    spelled = []
    for module, path in _modules().items():
        if module.startswith("resilient_jax.contracts"):
            continue
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        spelled += [
            f"{os.path.relpath(path, REPO)}:{n} {what}"
            for n, what in _message_names_spelled_here(tree)
        ]
    assert not spelled, "message names outside contracts/:\n" + "\n".join(spelled)


def test_the_architecture_page_stays_one_page():
    """ARCHITECTURE.md is read in one sitting: at most 8 KB, no line over 160 characters (the
    detail of each part is in its module's docstring)."""
    with open(os.path.join(REPO, "ARCHITECTURE.md")) as f:
        text = f.read()
    long_lines = [n for n, line in enumerate(text.splitlines(), 1) if len(line) > 160]
    assert len(text.encode()) <= 8 * 1024 and not long_lines, (len(text.encode()), long_lines)
