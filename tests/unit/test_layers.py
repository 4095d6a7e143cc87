"""The layers of docs/architecture.md, checked over every import statement of the tree.

Bottom to top: the shared kernel (``storage/kernel``), then ``storage`` and
``replication``, then ``federation_sender``, then ``homeserver``, then
``workers`` and ``spark_jobs``. An import may only point down (or stay inside its own layer), so
there is no cycle between packages, the kernel imports nothing of ours, and
``homeserver`` finds worker roles and reports as plug-ins instead of importing them. Imports
inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("storage", "replication", "federation_sender", "homeserver", "workers", "spark_jobs")

# layer -> the layers it may import (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    "kernel": frozenset(),
    "storage": frozenset({"kernel"}),
    "replication": frozenset({"kernel", "storage"}),
    "federation_sender": frozenset({"kernel", "storage"}),
    "homeserver": frozenset({"kernel", "storage", "replication", "federation_sender"}),
    "workers": frozenset({"kernel", "storage", "replication", "federation_sender", "homeserver"}),
    # The reports sit on top like workers: they read the homeserver's config and tables,
    # and `tributary report` finds them as plug-ins.
    "spark_jobs": frozenset({"kernel", "storage", "homeserver"}),
}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if parts[:2] == ["storage", "kernel"]:
        return "kernel"
    return parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                yield node.lineno, ".".join([*base, *([node.module] if node.module else [])])
            elif node.module:
                yield node.lineno, node.module


def violations() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = layer_of(module_name(path))
            assert source is not None
            for line, target in imports(path):
                target_layer = layer_of(target)
                if target_layer is None or target_layer == source:
                    continue
                if target_layer not in ALLOWED[source]:
                    found.append(f"{path.relative_to(ROOT)}:{line}: {source} imports {target} ({target_layer})")
    return found


def test_every_import_points_down_the_layers() -> None:
    assert violations() == []


def test_the_layer_table_itself_has_no_cycle() -> None:
    seen: set[str] = set()
    order: list[str] = []

    def visit(layer: str, path: tuple[str, ...]) -> None:
        assert layer not in path, f"cycle: {' -> '.join((*path, layer))}"
        if layer in seen:
            return
        for lower in ALLOWED[layer]:
            visit(lower, (*path, layer))
        seen.add(layer)
        order.append(layer)

    for layer in ALLOWED:
        visit(layer, ())
    assert order.index("kernel") == 0


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The check is not vacuous: an upward import in a module is reported."""
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    from workers.roles import GENERIC\n", encoding="utf-8")
    assert [(line, target) for line, target in imports_of_text(module)] == [(2, "workers.roles")]
    assert layer_of("workers.roles") == "workers" and "workers" not in ALLOWED["homeserver"]
    assert layer_of("storage.kernel.errors") == "kernel" and layer_of("storage.tokens") == "storage"


def imports_of_text(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
