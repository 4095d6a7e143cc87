"""docs/workers.md carries docker/nginx.conf's routing word for word: operators copy the
snippet, the integration test runs the file; the two must not drift apart."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def routing_of_nginx_conf() -> str:
    """docker/nginx.conf from ``upstream main`` to the end of the server block, dedented."""
    text = (REPO / "docker" / "nginx.conf").read_text(encoding="utf-8")
    start = text.index("    upstream main")
    end = text.rindex("}")  # closes the http block
    return textwrap.dedent(text[start:end]).strip()


def test_the_docs_snippet_is_the_nginx_conf_routing() -> None:
    docs = (REPO / "docs" / "workers.md").read_text(encoding="utf-8")
    snippets = re.findall(r"```nginx\n(.*?)```", docs, flags=re.S)
    assert snippets, "docs/workers.md has no nginx snippet"
    assert snippets[0].strip() == routing_of_nginx_conf()
