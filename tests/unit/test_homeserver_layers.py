"""The layers inside ``homeserver/`` and inside ``homeserver/handlers/`` (docs/architecture.md,
"Inside homeserver/"), checked over every import statement, lazy ones too.

Each child of the folder (a sub-folder, or a top-level module) sits in one layer; it may
import children of its own layer's lower neighbours only, as the tables below say. A new
child must be placed in a layer here (the test fails on one it does not know), so the
diagram in the docs cannot silently go stale.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_layers import ROOT, child_edges

# homeserver/: child -> the children it may import. Bottom to top, as the docs draw it.
_PURE = frozenset({"events"})
_OUTBOUND = _PURE | {"remote"}
_LEAF_SERVICES = _OUTBOUND | {"appservice", "media"}
_CONFIG = _LEAF_SERVICES | {"config"}
_SERVICES = _CONFIG | {"handlers"}
_FEDERATION = _SERVICES | {"federation"}
_HTTP = _FEDERATION | {"http"}
_ROUTING = _HTTP | {"routing"}
_ADMIN = _ROUTING | {"admin"}
HOMESERVER: dict[str, frozenset[str]] = {
    "events": frozenset(),
    "remote": _PURE,
    "appservice": _OUTBOUND,
    "media": _OUTBOUND,
    "config": _LEAF_SERVICES,
    "port_check": _CONFIG,
    "handlers": _CONFIG,
    "federation": _SERVICES,
    "http": _FEDERATION,
    "routing": _HTTP,
    "admin": _ROUTING,
    # Composition: the bundles of services the root builds (adapters never see them).
    "wiring": _FEDERATION,
    # Process-level modules the composition root uses.
    "keys": _ADMIN,
    "metrics": _ADMIN,
    "logging_setup": _ADMIN,
    "lazy_tls": frozenset(),
    "reactor": frozenset({"lazy_tls"}),
    # Composition.
    "roles": _CONFIG,
    "app": _ADMIN | {"wiring", "keys", "metrics", "roles", "logging_setup", "port_check"},
    "cli": _ADMIN | {"app", "roles", "keys", "metrics", "logging_setup", "port_check", "reactor", "lazy_tls"},
}

# homeserver/handlers/: the domain folders, bottom to top, and the modules at its top.
_ACCOUNTS = frozenset({"accounts", "ratelimit"})
HANDLERS: dict[str, frozenset[str]] = {
    "ratelimit": frozenset(),
    "server_info": frozenset(),
    "accounts": frozenset({"ratelimit"}),
    "writers": frozenset({"accounts"}),
    "ephemeral": _ACCOUNTS,
    "e2e": _ACCOUNTS | {"ephemeral"},
    "rooms": _ACCOUNTS,
    "push": _ACCOUNTS,
    "directory": _ACCOUNTS | {"rooms"},
    "sync": _ACCOUNTS | {"ephemeral", "e2e", "rooms"},
}


def children(folder: Path) -> list[str]:
    return sorted({p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
                  | {p.name for p in folder.iterdir() if p.is_dir() and any(p.rglob("*.py"))})


def layer_violations(folder: Path, allowed: dict[str, frozenset[str]], root: Path = ROOT) -> list[str]:
    base = ".".join(folder.relative_to(root).parts)
    problems = [f"{base}.{child} is in no layer: place it in the table of {__name__}"
                for child in children(folder) if child not in allowed]
    for (child, target), where in sorted(child_edges(folder, root).items()):
        if child in allowed and target not in allowed[child]:
            problems.append(f"{base}.{child} imports {base}.{target}, a layer above it ({where})")
    return problems


@pytest.mark.parametrize(("folder", "table"), [("homeserver", HOMESERVER), ("homeserver/handlers", HANDLERS)])
def test_every_import_points_down_the_layers_inside(folder: str, table: dict[str, frozenset[str]]) -> None:
    assert layer_violations(ROOT / folder, table) == []


def test_the_check_is_not_vacuous(tmp_path: Path) -> None:
    """An upward import, lazy or not, and an unplaced child are both reported."""
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "core.py").write_text("def f():\n    from pkg.high import g\n")
    (package / "high.py").write_text("from pkg.low.core import f\n")
    (package / "stray.py").write_text("")
    assert layer_violations(package, {"low": frozenset(), "high": frozenset({"low"})}, tmp_path) == [
        "pkg.stray is in no layer: place it in the table of tests.unit.test_homeserver_layers",
        "pkg.low imports pkg.high, a layer above it (pkg/low/core.py:2: pkg.high)",
    ]
