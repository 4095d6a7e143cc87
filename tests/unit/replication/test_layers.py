# tests: replication/
"""Replication sits below the composition root: it imports only itself, storage
(including storage.kernel) and third-party libraries, never homeserver,
workers or federation_sender. Checked on the source, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OURS = ("homeserver", "workers", "replication", "federation_sender", "storage", "spark_jobs")


def imported_packages(package: str) -> dict[str, set[str]]:
    """Our top-level packages imported by each module of ``package``."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names & set(OURS)
    return found


def test_replication_imports_only_itself_and_storage() -> None:
    modules = imported_packages("replication")
    assert "replication/config.py" in modules
    offending = {module: names - {"replication", "storage"} for module, names in modules.items()}
    assert {module: names for module, names in offending.items() if names} == {}
