"""Matrix errors: the one exception type every layer raises for what a client or peer must see.

Handlers, stores and the federation code raise ``MatrixError`` (or one of the
constructors below); the HTTP router is the one place that turns it into a
status and ``{"errcode", "error"}`` JSON. Nothing here knows about HTTP
requests.
"""

# tests: tests/unit/http/test_router.py

from __future__ import annotations

from typing import Any


class Unavailable(Exception):
    """Something this process depends on (its database) cannot be reached now: an outage,
    logged once where it is noticed, not a bug of whoever hit it. The HTTP router answers it
    with 503 and ``Retry-After: retry_after`` (whole seconds), and a background task that
    meets it fails without a traceback."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class MatrixError(Exception):
    """An error a client or peer should see as ``{"errcode": ..., "error": ...}``.

    ``extra`` fields are merged into the body (``retry_after_ms`` for
    ``M_LIMIT_EXCEEDED``, for one).
    """

    def __init__(self, status: int, errcode: str, error: str, **extra: Any) -> None:
        super().__init__(f"{status} {errcode}: {error}")
        self.status = status
        self.errcode = errcode
        self.error = error
        self.extra = extra

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"errcode": self.errcode, "error": self.error}
        body.update(self.extra)
        return body


def not_found(error: str = "Not found") -> MatrixError:
    return MatrixError(404, "M_NOT_FOUND", error)


def unrecognized(error: str = "Unrecognized request") -> MatrixError:
    return MatrixError(404, "M_UNRECOGNIZED", error)


def bad_json(error: str) -> MatrixError:
    return MatrixError(400, "M_BAD_JSON", error)


def invalid_param(error: str) -> MatrixError:
    return MatrixError(400, "M_INVALID_PARAM", error)


def missing_param(error: str) -> MatrixError:
    return MatrixError(400, "M_MISSING_PARAM", error)


def forbidden(error: str) -> MatrixError:
    return MatrixError(403, "M_FORBIDDEN", error)
