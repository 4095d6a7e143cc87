"""Install Twisted's asyncio reactor on a uvloop event loop, with TLS loaded on first use.

This module owns two decisions about the reactor a Tributary process runs. Which
reactor: ``install_reactor()`` must be called by an entry point before anything
imports ``twisted.internet.reactor`` (``prometheus_client.twisted`` does, for one),
so this module imports nothing from Twisted at module level. When TLS is loaded:
pyOpenSSL, cryptography and service_identity (and h2, which Twisted only speaks
over TLS) cost about 15 MiB of RSS, yet only TLS listeners and outbound
federation use them, so ``load_tls()`` imports them on first use, not at start-up.

It deliberately knows nothing of certificates, listeners or federation: callers
use Twisted's TLS APIs as usual (``reactor.listenSSL``, ``wrapClientTLS``,
``Agent``), and those load TLS themselves. Only code that builds a TLS protocol
by hand (``TLSMemoryBIOFactory`` over ``listenTCP``) should call ``load_tls()``
first, or its listener will not offer HTTP/2.
"""

# tests: tests/unit/test_reactor.py

from __future__ import annotations

import asyncio
import importlib
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class ReactorAlreadyInstalled(RuntimeError):
    """Another reactor was installed before ours could be."""


# What install_reactor() keeps from being imported; load_tls() imports them.
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


def install_reactor() -> Any:
    """Install the asyncio reactor on uvloop and return it; idempotent.

    Returns the reactor object. Raises ReactorAlreadyInstalled when some import
    already installed a different reactor, which would silently cost the
    uvloop speed-up.
    """
    if "twisted.internet.reactor" in sys.modules:
        from twisted.internet import reactor
        from twisted.internet.asyncioreactor import AsyncioSelectorReactor

        if isinstance(reactor, AsyncioSelectorReactor):
            return reactor
        raise ReactorAlreadyInstalled(
            f"a {type(reactor).__name__} was installed before the asyncio reactor; "
            "install_reactor() must run before anything imports twisted.internet.reactor"
        )

    import uvloop

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    # Once pyOpenSSL is imported (by whatever ran before us) there is nothing to defer.
    with _hidden(_DEFERRED_PACKAGES if "OpenSSL" not in sys.modules else ()) as hidden:
        from twisted.internet import asyncioreactor

        asyncioreactor.install(loop)
        for name in _TLS_NAMES:
            importlib.import_module(name)
    if "OpenSSL" in hidden:
        _install_tls_stand_ins()
    from twisted.internet import reactor

    return reactor


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
