"""Every module of the product names the tests that cover it, and those files exist.

STYLE.md asks each module to start with a ``# tests: path[, path...]`` line (as
Twisted's ``test-case-name``), so a reader finds the tests from the code. A
header naming a file that does not exist misleads worse than none.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("storage", "replication", "federation_sender", "homeserver", "workers", "spark_jobs")
# The header, and the continuation lines of a long one ("#        more, paths").
HEADER = re.compile(r"^# tests: (.+(?:\n#\s+\S.*)*)$", re.M)


def modules() -> list[Path]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__init__.py" or path.parent.name == "schema":
                continue
            found.append(path)
    return found


def test_every_module_has_a_tests_header_naming_files_that_exist() -> None:
    problems = []
    for path in modules():
        match = HEADER.search(path.read_text(encoding="utf-8"))
        name = path.relative_to(ROOT)
        if match is None:
            problems.append(f"{name}: no '# tests:' header")
            continue
        for test in re.split(r"[\s,#]+", match.group(1).strip()):
            if not (ROOT / test).is_file():
                problems.append(f"{name}: names {test!r}, which does not exist")
    assert problems == []
    assert len(modules()) > 100
