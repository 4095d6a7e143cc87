"""Process-wide logging: one line per record, with the process name and the request or destination context.

``setup_logging`` installs one handler on the root logger (stderr), in the
``text`` or ``json`` format the config names (``log_format``), and routes
Twisted's log into it. Context comes from a ``ContextVar``: the HTTP server
wraps each request in ``with log_context(request=..., method=...)`` (and adds
the servlet with ``set_log_context`` once routed), and code working for one
remote server wraps the work in ``with log_context(destination=...)``. Records
carry it as ``record.context``; text lines show it in brackets after the
logger name, JSON lines as fields.

Twisted runs each coroutine in its own copy of the context, so two requests
never see each other's fields. But asyncio snapshots the current context
whenever a callback is scheduled, and the reactor's timers are scheduled from
whatever code runs, so a snapshot taken inside a request can carry its fields
into unrelated callbacks. Each ``log_context`` block therefore closes its
scope on exit: a snapshot of a finished block shows no fields.
"""

# tests: tests/unit/test_logging_setup.py

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Final

from storage.kernel.logcontext import LOG_FIELDS, LogContext, current_log_context, log_context, set_log_context

__all__ = ["LOG_FIELDS", "LogContext", "current_log_context", "log_context", "set_log_context", "setup_logging"]


class ContextFilter(logging.Filter):
    """Puts the process name and the current ``LogContext`` on every record."""

    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def filter(self, record: logging.LogRecord) -> bool:
        record.process_name = self.process_name
        context = current_log_context()
        record.context = context
        fields = context.render()
        record.context_text = f" [{fields}]" if fields else ""
        return True


TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(process_name)s %(name)s%(context_text)s: %(message)s"


class TextFormatter(logging.Formatter):
    """``2026-01-01 12:00:00,123 INFO main homeserver.http.access [GET-7 GET sync]: ...``, in UTC.

    A traceback or a message with line breaks stays on the record's one line,
    its line breaks written as ``\\n``, so that a line is always a record.
    """

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self.converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\r", "\\r").replace("\n", "\\n")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, process, logger, msg, the context fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "process": getattr(record, "process_name", None),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        context = getattr(record, "context", None)
        if isinstance(context, LogContext):
            entry.update(context.fields())
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def make_handler(fmt: str, process_name: str, stream: Any = None) -> logging.Handler:
    """A stream handler (stderr by default) writing ``fmt`` (``text`` or ``json``) lines."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(ContextFilter(process_name))
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    return handler


def setup_logging(level: str = "INFO", fmt: str = "text", *, process_name: str = "main") -> None:
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(make_handler(fmt, process_name))
    root.setLevel(level)

    from twisted.logger import ILogObserver, STDLibLogObserver, globalLogBeginner

    observer: ILogObserver = STDLibLogObserver()
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False, discardBuffer=True)
