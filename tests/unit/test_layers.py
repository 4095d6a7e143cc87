"""The layers of docs/architecture.md, checked over every import statement of the tree.

Bottom to top: the shared kernel (``storage/kernel``), then ``storage`` and
``replication``, then ``federation_sender``, then ``homeserver``, then
``workers`` and ``spark_jobs``. An import may only point down (or stay inside its own layer), so
there is no cycle between packages, the kernel imports nothing of ours, and
``homeserver`` finds worker roles and reports as plug-ins instead of importing them. Imports
inside functions count too: a lazy import is still a dependency.

The same holds one level down, in every folder of the tree: its direct children (each
sub-folder, each module) import each other without a cycle, so each folder's children can be
read bottom to top too (``test_no_cycle_between_the_children_of``).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

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


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path = ROOT) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import in the file, at any depth; ``from package import
    module`` names the module itself (``from storage import on_reactor``: ``storage.on_reactor``)."""
    yield from _imports(path, root)


@functools.cache
def _imports(path: Path, root: Path) -> tuple[tuple[int, str], ...]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path, root).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path, root)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module:
                module = node.module
            else:
                continue
            submodules = [f"{module}.{a.name}" for a in node.names if _is_module(root, f"{module}.{a.name}")]
            if len(submodules) < len(node.names):
                found.append((node.lineno, module))
            found.extend((node.lineno, submodule) for submodule in submodules)
    return tuple(found)


def _is_module(root: Path, module: str) -> bool:
    path = root.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


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


# --- one level down: no cycle between the children of a folder ----------------------------

#: (importing child, imported child) -> one import that makes the edge, as "file:line: module".
Edges = Mapping[tuple[str, str], str]


def child_edges(folder: Path, root: Path = ROOT) -> dict[tuple[str, str], str]:
    """The imports between ``folder``'s direct children: each sub-folder and each module is one
    node, and an import anywhere below a child (lazy ones too) is an edge of that child. The
    folder's own ``__init__.py`` is the folder itself, not a child, and is left out."""
    package = ".".join(folder.relative_to(root).parts)
    edges: dict[tuple[str, str], str] = {}
    for path in sorted(folder.rglob("*.py")):
        inside = path.relative_to(folder).parts
        if inside == ("__init__.py",):
            continue
        source = inside[0].removesuffix(".py")
        for line, target in imports(path, root):
            if not target.startswith(package + "."):
                continue
            child = target[len(package) + 1 :].split(".", 1)[0]
            if child != source:
                edges.setdefault((source, child), f"{path.relative_to(root)}:{line}: {target}")
    return edges


def strongly_connected(edges: Edges) -> list[list[str]]:
    """The groups of two or more nodes that reach each other (Tarjan), each sorted."""
    successors: dict[str, list[str]] = {}
    for source, target in sorted(edges):
        successors.setdefault(source, []).append(target)
        successors.setdefault(target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in successors[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in successors:
        if node not in index:
            visit(node)
    return sorted(groups)


def a_cycle(group: list[str], edges: Edges) -> list[str]:
    """A shortest cycle through the group's first node, staying inside the group: [a, b, ..., a]."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for source, target in sorted(edges):
                if source != node or target not in members:
                    continue
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{group} is not strongly connected")  # pragma: no cover


def child_cycles(folder: Path, root: Path = ROOT) -> list[str]:
    """One message per group of ``folder``'s children that import each other in a cycle: a
    cycle through them, and the import that makes each of its edges."""
    edges = child_edges(folder, root)
    name = folder.relative_to(root).as_posix()
    messages = []
    for group in strongly_connected(edges):
        cycle = a_cycle(group, edges)
        among = f" (cycle among {', '.join(group)})" if len(group) > len(cycle) - 1 else ""
        lines = [f"{name}/: {' -> '.join(cycle)}{among}"]
        lines += [f"    {a} -> {b}: {edges[a, b]}" for a, b in zip(cycle, cycle[1:])]
        messages.append("\n".join(lines))
    return messages


def folders_with_children(root: Path = ROOT) -> list[str]:
    """Every folder of the packages, at any depth, with at least one child module or sub-folder."""
    found = []
    for package in PACKAGES:
        for folder in sorted({path.parent for path in (root / package).rglob("*.py")}):
            if any(path.name != "__init__.py" for path in folder.glob("*.py")) or any(
                sub.is_dir() and any(sub.rglob("*.py")) for sub in folder.iterdir()
            ):
                found.append(folder.relative_to(root).as_posix())
    return found


@pytest.mark.parametrize("folder", folders_with_children())
def test_no_cycle_between_the_children_of(folder: str) -> None:
    cycles = child_cycles(ROOT / folder)
    if cycles:
        pytest.fail("children of a folder import each other in a cycle:\n" + "\n".join(cycles), pytrace=False)


def write_tree(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


PROBE_TREE = {
    "pkg/__init__.py": "",
    "pkg/top.py": "from .sub.deeper.leaf import value\n",
    "pkg/alone.py": "from pkg.top import value\n",
    "pkg/sub/__init__.py": "",
    "pkg/sub/deeper/__init__.py": "",
    "pkg/sub/deeper/leaf.py": "value = 1\n\n\ndef later():\n    from pkg import top\n    return top\n",
}


def test_the_cycle_check_sees_a_cycle(tmp_path: Path) -> None:
    """The check is not vacuous: a cycle between a module (importing relatively) and a
    sub-folder, closed by a lazy ``from package import module`` deep in the sub-folder, is
    reported with both imports, and the module that only imports one of them is not."""
    root = write_tree(tmp_path / "cyclic", PROBE_TREE)
    assert child_cycles(root / "pkg", root) == [
        "pkg/: sub -> top -> sub\n"
        "    sub -> top: pkg/sub/deeper/leaf.py:5: pkg.top\n"
        "    top -> sub: pkg/top.py:1: pkg.sub.deeper.leaf"
    ]
    # One level down there is none: leaf.py's import of pkg.top leaves pkg/sub/.
    assert child_cycles(root / "pkg" / "sub", root) == []
    # Without the lazy import, there is none at all.
    acyclic = write_tree(tmp_path / "acyclic", {**PROBE_TREE, "pkg/sub/deeper/leaf.py": "value = 1\n"})
    assert child_cycles(acyclic / "pkg", acyclic) == []


def test_every_folder_with_children_is_checked() -> None:
    folders = folders_with_children()
    assert {"storage", "storage/kernel", "storage/stores", "replication", "homeserver/http/client_api"} <= set(folders)
    assert "storage/schema" not in folders  # only an __init__.py: no children
