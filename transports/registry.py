"""Names -> transports, and what ``auto`` tries, in order, from their capabilities.

Adding a transport is one new module (implementing ``transports.base``) plus one line in
``_ONE_SIDED`` (or a new control transport here). The engine imports only this module and
``transports.base``; it never names a concrete transport.

``auto`` tries the one-sided transports whose capabilities say so, same-host ones first (the cheapest
path when the peer shares this host), then the ones that cross hosts, and falls back to the control
stream itself (TCP), which always works.
"""

from __future__ import annotations

import asyncio
import importlib
from dataclasses import dataclass

from .base import Capabilities, ControlTransport, OneSidedTransport

AUTO = "auto"


_CONTROL = "tcp"
# one-sided transports by name: the module that implements it
_ONE_SIDED: dict[str, str] = {"cma": "cma", "ucx": "ucx"}
_ALIASES = {"shm": "cma", "same-host": "cma"}


def transport_names() -> tuple[str, ...]:
    """Every name ``kvpush.transport`` accepts (aliases excluded), ``auto`` first."""
    return (AUTO, _CONTROL, *_ONE_SIDED)


def canonical_transport(name: str) -> str | None:
    """The transport a name (or alias) means, or None for an unknown name."""
    name = _ALIASES.get(name, name)
    return name if name in transport_names() else None


def capabilities(name: str) -> Capabilities:
    """A transport's capabilities (importing its module, which loads no native library)."""
    module = importlib.import_module(f"transports.{_CONTROL if name == _CONTROL else _ONE_SIDED[name]}")
    caps: Capabilities = module.CAPABILITIES
    return caps


def auto_order() -> list[str]:
    """The one-sided transports ``auto`` tries, in order: same-host ones first."""
    names = list(_ONE_SIDED)
    return sorted(names, key=lambda name: not capabilities(name).same_host_only)


def control() -> ControlTransport:
    """The control transport every link runs its frame stream on."""
    from . import tcp
    transport: ControlTransport = tcp.TcpControl()
    return transport


@dataclass
class Opened:
    """The one-sided transports an engine opened, in the order it tries them, and why the others
    it would have tried are not there."""

    transports: list[OneSidedTransport]
    unavailable: list[str]

    def close(self) -> None:
        for transport in self.transports:
            transport.close()
        self.transports = []


def open_one_sided(wanted: str, loop: asyncio.AbstractEventLoop) -> Opened:
    """Open what ``wanted`` (a canonical name) may use. An explicit transport that cannot be opened
    raises ``TransportError``; under ``auto`` it is skipped with its reason."""
    if wanted == _CONTROL:
        return Opened([], [])
    explicit = wanted != AUTO
    names = [wanted] if explicit else auto_order()
    opened = Opened([], [])
    try:
        for name in names:
            module = importlib.import_module(f"transports.{_ONE_SIDED[name]}")
            transport, reason = module.open_transport(loop, explicit)
            if transport is not None:
                opened.transports.append(transport)
            else:
                opened.unavailable.append(reason)
    except BaseException:
        opened.close()
        raise
    return opened
