"""Shared-secret registration's pure parts: the MAC the reference server's tools compute, and
single-use, expiring nonces."""

# tests: homeserver/admin/servlets.py

from __future__ import annotations

import hashlib
import hmac

import pytest

from homeserver.admin.servlets import NONCE_LIFETIME_S, Nonces, shared_secret_mac
from storage.kernel.errors import MatrixError


def test_mac_is_hmac_sha1_over_nul_separated_fields_as_register_new_matrix_user_computes_it() -> None:
    # What the reference server's register_new_matrix_user script builds, written out by hand.
    expected = hmac.new(b"s3cret", b"abc\x00alice\x00pw\x00admin", hashlib.sha1).hexdigest()
    assert shared_secret_mac("s3cret", "abc", "alice", "pw", True) == expected
    not_admin = hmac.new(b"s3cret", b"abc\x00alice\x00pw\x00notadmin", hashlib.sha1).hexdigest()
    assert shared_secret_mac("s3cret", "abc", "alice", "pw", False) == not_admin
    typed = hmac.new(b"s3cret", b"abc\x00alice\x00pw\x00notadmin\x00bot", hashlib.sha1).hexdigest()
    assert shared_secret_mac("s3cret", "abc", "alice", "pw", False, "bot") == typed


def test_nonces_are_single_use_and_expire() -> None:
    now = [1000.0]
    nonces = Nonces(lambda: now[0])
    first, second = nonces.issue(), nonces.issue()
    assert first != second
    assert nonces.take(first) is True
    assert nonces.take(first) is False
    assert nonces.take("never issued") is False
    now[0] += NONCE_LIFETIME_S + 1
    assert nonces.take(second) is False


def test_outstanding_nonces_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import homeserver.admin.servlets as servlets

    monkeypatch.setattr(servlets, "MAX_NONCES", 3)
    now = [0.0]
    nonces = Nonces(lambda: now[0])
    for _ in range(3):
        nonces.issue()
    with pytest.raises(MatrixError) as refused:
        nonces.issue()
    assert refused.value.status == 429
    now[0] += NONCE_LIFETIME_S + 1  # the old ones expired: room again
    nonces.issue()
