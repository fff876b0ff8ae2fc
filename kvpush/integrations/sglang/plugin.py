"""The SGLang plugin: ``--disaggregation-transfer-backend kvpush`` without patching SGLang.

SGLang runs every entry point of the group ``sglang.srt.plugins`` before it parses arguments and again in
each scheduler process (``sglang.srt.plugins.load_plugins``); kvpush's (``pyproject.toml``) is
``register``. It does three things, each idempotent, none of them importing torch or kvpush's engine:

1. adds ``kvpush`` to SGLang's list of backend choices (``add_disagg_transfer_backend_choices``);
2. adds a ``KVPUSH`` member to SGLang's ``TransferBackend`` enum, which SGLang builds from the argument's
   value in several processes (``TransferBackend("kvpush")``);
3. wraps ``get_kv_class`` so that, for that member, it hands SGLang kvpush's manager, sender, receiver and
   bootstrap-server classes (``kvpush.integrations.sglang.backend``, imported only then), in the module
   that defines it and in every already-imported module that imported it by name.

``SGLANG_PLUGINS=kvpush`` restricts SGLang to this plugin; nothing else is needed to select it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from enum import Enum
from typing import Any

from .core import BACKEND_NAME

log = logging.getLogger(__name__)

# the SGLang modules that bind ``get_kv_class`` by name (from ... import get_kv_class); tests check this list
# against the installed SGLang's sources
KV_CLASS_USERS = (
    "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.managers.disagg_service",
)
_WRAPPED = "__kvpush_wrapped__"


def register() -> None:
    """The entry point SGLang calls: make ``kvpush`` a transfer backend (idempotent)."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation import utils

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    add_enum_member(utils.TransferBackend, BACKEND_NAME.upper(), BACKEND_NAME)
    wrapped = wrap_get_kv_class(utils.get_kv_class)
    for name in KV_CLASS_USERS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "get_kv_class"):
            module.get_kv_class = wrapped  # type: ignore[attr-defined]
    log.debug("kvpush: SGLang transfer backend %r registered", BACKEND_NAME)


def add_enum_member(enum_class: type[Enum], name: str, value: str) -> Enum:
    """``enum_class(value)`` and ``enum_class.<name>`` return a new member (its existing one if there is);
    identity, hashing and ``isinstance`` behave as for the members the class was built with."""
    existing = enum_class._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(enum_class)
    member._name_ = name
    member._value_ = value
    enum_class._value2member_map_[value] = member
    enum_class._member_map_[name] = member
    enum_class._member_names_.append(name)
    type.__setattr__(enum_class, name, member)  # Enum's own __setattr__ refuses new members
    return member


def wrap_get_kv_class(original: Callable[..., Any]) -> Callable[..., Any]:
    """``get_kv_class`` answering kvpush's classes for the kvpush backend and SGLang's for the others."""
    if getattr(original, _WRAPPED, False):
        return original

    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        if getattr(transfer_backend, "value", transfer_backend) == BACKEND_NAME:
            return kv_class(class_type)
        return original(transfer_backend, class_type)

    get_kv_class.__doc__ = original.__doc__
    get_kv_class.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(get_kv_class, _WRAPPED, True)
    return get_kv_class


def kv_class(class_type: Any) -> type:
    """kvpush's class for SGLang's ``KVClassType`` ``class_type`` (the backend imported on first use)."""
    from sglang.srt.disaggregation.base import KVArgs

    from . import backend

    classes: dict[str, type] = {"kvargs": KVArgs, "manager": backend.KvpushKVManager,
                                "sender": backend.KvpushKVSender, "receiver": backend.KvpushKVReceiver,
                                "bootstrap_server": backend.KvpushKVBootstrapServer}
    return classes[getattr(class_type, "value", class_type)]
