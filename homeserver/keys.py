"""This server's long-lived secrets: its ed25519 signing key and its TLS certificate.

Both are created on first start when absent: the signing key with signedjson
(file mode 0600, the format other homeservers' tools read), and a self-signed
certificate for TLS listeners that have none configured.
"""

# tests: tests/integration/test_process.py

from __future__ import annotations

import datetime
import logging
import os
import secrets
import string
from pathlib import Path
from typing import Any

from signedjson.key import generate_signing_key, read_signing_keys, write_signing_keys
from signedjson.types import SigningKey

logger = logging.getLogger(__name__)


class KeyFileError(Exception):
    """A key or certificate file exists but cannot be used."""


def _new_key_version() -> str:
    alphabet = string.ascii_letters + string.digits
    return "a_" + "".join(secrets.choice(alphabet) for _ in range(4))


def load_or_create_signing_key(path: Path) -> SigningKey:
    """The first signing key in ``path``, generating the file when it does not exist."""
    if path.exists():
        try:
            with open(path, encoding="utf-8") as f:
                keys = read_signing_keys(f)
        except Exception as e:
            raise KeyFileError(f"cannot read signing key {path}: {e}") from e
        if not keys:
            raise KeyFileError(f"signing key file {path} holds no key")
        return keys[0]
    key = generate_signing_key(_new_key_version())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        write_signing_keys(f, [key])
    logger.info("generated signing key ed25519:%s in %s", key.version, path)
    return key


def ensure_self_signed_certificate(cert_path: Path, key_path: Path, server_name: str) -> None:
    """Write a self-signed certificate for ``server_name`` unless both files exist."""
    if cert_path.exists() and key_path.exists():
        return
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    host = server_name.rsplit(":", 1)[0] if not server_name.endswith("]") else server_name
    host = host.strip("[]")
    private_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    try:
        import ipaddress

        alt_name: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        alt_name = x509.DNSName(host)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName([alt_name]), critical=False)
        .sign(private_key, hashes.SHA256())
    )
    key_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            private_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    logger.info("generated a self-signed TLS certificate for %s in %s", host, cert_path)


def load_tls_options(cert_path: Path, key_path: Path) -> Any:
    """Twisted ``CertificateOptions`` for a listener, from PEM files, built from ``cryptography``
    objects (pyOpenSSL's own X509 and PKey types are deprecated)."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    from twisted.internet.ssl import CertificateOptions

    certificate = x509.load_pem_x509_certificate(cert_path.read_bytes())
    private_key = load_pem_private_key(key_path.read_bytes(), password=None)
    # Twisted's annotations still name pyOpenSSL's types; pyOpenSSL takes these since 24.3.
    options: Any = CertificateOptions
    return options(privateKey=private_key, certificate=certificate)
