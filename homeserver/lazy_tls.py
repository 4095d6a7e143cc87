"""Keep Twisted's TLS stack out of a process until it first uses TLS: a patch of Twisted.

What it patches. Twisted decides at import time whether it can do TLS: ``twisted.internet.tcp``,
``posixbase``, ``endpoints`` and ``twisted.web.client`` try ``import OpenSSL`` and, without it,
leave their TLS names ``None``, give TCP connections mixins without ``startTLS``, and wrap
two ``twisted.web.client`` methods (``_requireSSL``) to raise NotImplementedError;
``twisted.web.http`` likewise tries ``import h2``. ``twisted_imported_without_tls()`` imports
those modules with pyOpenSSL and h2 hidden, then puts stand-ins in the TLS names
(``_TLS_NAMES``), in ``tcp._TLSConnectionMixin.startTLS``, and unwraps the two methods; the
first call or attribute read of a stand-in runs ``load_tls()``, which imports pyOpenSSL and
puts Twisted's real objects back, also in the places above (as if pyOpenSSL had always been there).

Why. pyOpenSSL, ``cryptography`` and ``service_identity`` (and h2, which Twisted only speaks
over TLS) are about 14 MiB of RSS, yet only TLS listeners and outbound federation use them.
Commit 40248ab measured RSS after start 72 -> 58.7 MiB with this (docs/client-api.md: 12.6 MiB
for pyOpenSSL and what it brings, 1.2-1.5 MiB for h2). Re-measured on Twisted 26.10.0, importing
``homeserver.app`` and ``homeserver.cli`` after ``install_reactor()``: 67.3 MiB, against 81.2 MiB
with pyOpenSSL imported first (which turns this off). ``load_tls()`` itself took 50-110 ms on the
shared 2-core machine; what that saves at start-up was not measured reliably there (whole
start-ups varied by more), so memory is the reason.

What breaks if Twisted changes. This leans on Twisted's import-time probing and on private
names: the module attributes in ``_TLS_NAMES``, ``tcp._TLSConnectionMixin``/``_TLSClientMixin``/
``_TLSServerMixin`` and ``twisted.internet._newtls``'s mixins, the ``__wrapped__`` that
``_requireSSL`` leaves, ``http.H2_ENABLED``/``H2Connection``. If one is renamed, the stand-in is
set where nothing reads it, and the TLS entry point that read the old name fails as Twisted
does without pyOpenSSL ("OpenSSL not available", NotImplementedError, no ``startTLS``);
tests/unit/test_lazy_tls.py makes a TLS connection each way to catch that. If Twisted stops
importing pyOpenSSL eagerly, this module should go.

Callers use Twisted's TLS APIs as usual (``reactor.listenSSL``, ``wrapClientTLS``, ``Agent``,
``startTLS``); only code that builds a TLS protocol by hand (``TLSMemoryBIOFactory`` over
``listenTCP``) should call ``load_tls()`` first, or its listener will not offer HTTP/2. This
module imports nothing from Twisted at module level, so ``homeserver/reactor.py`` can import it
before installing the reactor.
"""

# tests: tests/unit/test_lazy_tls.py

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# What twisted_imported_without_tls() keeps from being imported; load_tls() imports them.
# (h2: Twisted's HTTP/2 also needs ``priority``, which we do not install, so it
# was never enabled, but twisted.web.http imported h2's 1.4 MiB trying.)
_DEFERRED_PACKAGES = ("OpenSSL", "h2")

# Twisted modules that try ``import OpenSSL`` at import time and, without it, go on
# without TLS. Imported with pyOpenSSL hidden; each name below then gets a stand-in
# that loads TLS when first called or read, and ``load_tls()`` puts the real one back.
# Values are (module, attribute); attribute None means the module itself.
# (twisted.web.http, which tries ``import h2`` likewise, is handled in load_tls().)
_TLS_NAMES: dict[str, dict[str, tuple[str, str | None]]] = {
    "twisted.internet.posixbase": {  # listenSSL and connectSSL
        "tls": ("twisted.protocols.tls", None),
        "ssl": ("twisted.internet.ssl", None),
    },
    "twisted.internet.endpoints": {  # wrapClientTLS and the ssl:/tls: endpoint strings
        "SSLError": ("OpenSSL.SSL", "Error"),
        "Certificate": ("twisted.internet.ssl", "Certificate"),
        "CertificateOptions": ("twisted.internet.ssl", "CertificateOptions"),
        "KeyPair": ("twisted.internet.ssl", "KeyPair"),
        "PrivateCertificate": ("twisted.internet.ssl", "PrivateCertificate"),
        "optionsForClientTLS": ("twisted.internet.ssl", "optionsForClientTLS"),
        "trustRootFromCertificates": ("twisted.internet.ssl", "trustRootFromCertificates"),
        "SNIConnectionCreator": ("twisted.protocols._sni", "SNIConnectionCreator"),
        "_TLSServerEndpoint": ("twisted.protocols._sni", "TLSServerEndpoint"),
        "autoReloadingDirectoryOfPEMs": ("twisted.protocols._sni", "autoReloadingDirectoryOfPEMs"),
        "TLSMemoryBIOFactory": ("twisted.protocols.tls", "TLSMemoryBIOFactory"),
    },
    "twisted.web.client": {  # Agent's default HTTPS policy
        "SSL": ("OpenSSL.SSL", None),
        "CertificateOptions": ("twisted.internet.ssl", "CertificateOptions"),
        "optionsForClientTLS": ("twisted.internet.ssl", "optionsForClientTLS"),
        "platformTrust": ("twisted.internet.ssl", "platformTrust"),
    },
}

# twisted.web.client methods that its ``_requireSSL`` replaced, at import time, with
# ones raising NotImplementedError; the originals are kept as ``__wrapped__``.
_REQUIRE_SSL_METHODS = (("BrowserLikePolicyForHTTPS", "creatorForNetloc"), ("WebClientContextFactory", "getContext"))

# True while the Twisted modules above run on stand-ins.
_tls_deferred = False


@contextmanager
def twisted_imported_without_tls() -> Iterator[None]:
    """Install the reactor inside this block: Twisted's modules that probe for TLS are then
    imported with pyOpenSSL and h2 hidden, and given stand-ins that load TLS on first use.

    Does nothing to defer when pyOpenSSL was imported before (there is nothing to save).
    """
    with _hidden(_DEFERRED_PACKAGES if "OpenSSL" not in sys.modules else ()) as hidden:
        yield
        for name in _TLS_NAMES:
            importlib.import_module(name)
    if "OpenSSL" in hidden:
        _install_tls_stand_ins()


def load_tls() -> None:
    """Import pyOpenSSL and Twisted's TLS support, and give the Twisted modules
    imported without them their TLS names back; idempotent and cheap once done.

    Called by the stand-ins on first use. Raises ImportError when pyOpenSSL is
    not installed, where Twisted would have said TLS is unavailable.
    """
    global _tls_deferred
    if not _tls_deferred:
        return
    from twisted.internet import _newtls, interfaces
    from zope.interface import classImplements

    tcp: Any = importlib.import_module("twisted.internet.tcp")  # its TLS fallbacks are private
    resolved = {module: {name: _resolve(source) for name, source in names.items()}
                for module, names in _TLS_NAMES.items()}
    for module, values in resolved.items():
        for name, value in values.items():
            setattr(sys.modules[module], name, value)
    # twisted.internet.tcp fell back to mixins without startTLS: give them the real methods.
    for fallback, real in ((tcp._TLSConnectionMixin, _newtls.ConnectionMixin),
                           (tcp._TLSClientMixin, _newtls.ClientMixin),
                           (tcp._TLSServerMixin, _newtls.ServerMixin)):
        for name, value in vars(real).items():
            if not name.startswith("__"):
                setattr(fallback, name, value)
    tcp.ITLSTransport = interfaces.ITLSTransport
    classImplements(tcp.Connection, interfaces.ITLSTransport)  # type: ignore[misc]
    # HTTP/2 is only negotiated over TLS (Site offers it by ALPN when h2 imports).
    http: Any = importlib.import_module("twisted.web.http")
    if not http.H2_ENABLED:
        try:
            from twisted.web._http2 import H2Connection
        except ImportError:
            pass
        else:
            http.H2Connection, http.H2_ENABLED = H2Connection, True
    _tls_deferred = False


@contextmanager
def _hidden(packages: tuple[str, ...]) -> Iterator[frozenset[str]]:
    """Make importing ``packages`` fail inside the block; yields the ones it hid
    (not those already imported: keeping them out would save nothing)."""
    hidden = frozenset(name for name in packages if name not in sys.modules)
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield hidden
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def _install_tls_stand_ins() -> None:
    """Point the TLS names Twisted left empty at stand-ins that call ``load_tls()``."""
    global _tls_deferred
    from twisted.internet import interfaces, posixbase
    from twisted.web import client
    from zope.interface import classImplements

    tcp: Any = importlib.import_module("twisted.internet.tcp")  # its TLS fallbacks are private

    if posixbase.tls is not None:  # imported before us, with pyOpenSSL: nothing deferred
        return
    for module, names in _TLS_NAMES.items():
        for name, source in names.items():
            setattr(sys.modules[module], name, _LoadsTls(source))
    classImplements(posixbase.PosixReactorBase, interfaces.IReactorSSL)
    with warnings.catch_warnings():  # WebClientContextFactory is deprecated; we only unwrap it
        warnings.simplefilter("ignore", DeprecationWarning)
        for name, method in _REQUIRE_SSL_METHODS:
            cls = getattr(client, name)
            setattr(cls, method, getattr(cls, method).__wrapped__)
    tcp._TLSConnectionMixin.startTLS = _start_tls
    classImplements(tcp.Connection, interfaces.ITLSTransport)  # type: ignore[misc]
    _tls_deferred = True


def _start_tls(transport: Any, ctx: Any, normal: bool = True) -> None:
    """``ITLSTransport.startTLS`` of TCP connections until TLS is loaded."""
    load_tls()
    transport.startTLS(ctx, normal)


def _resolve(source: tuple[str, str | None]) -> Any:
    module = importlib.import_module(source[0])
    return module if source[1] is None else getattr(module, source[1])


class _LoadsTls:
    """Stands in for a TLS class, function or module of Twisted's: the first call or
    attribute read loads TLS, then acts on the real object."""

    def __init__(self, source: tuple[str, str | None]) -> None:
        self._source = source

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        load_tls()
        return _resolve(self._source)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probing: no reason to load TLS
            raise AttributeError(name)
        load_tls()
        return getattr(_resolve(self._source), name)

    def __repr__(self) -> str:
        module, attribute = self._source
        return f"<{module}{'.' + attribute if attribute else ''}, loaded on first use>"
