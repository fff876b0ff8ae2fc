"""How a kvpush call's failure reads in an engine's log and in the answers one side gives the other. Pure."""

from __future__ import annotations

import asyncio

from kvpush import LLMException


def describe_error(error: BaseException) -> str:
    if isinstance(error, LLMException):
        return f"{error.status_code.name}: {error}"
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    if isinstance(error, TimeoutError):
        return "timed out"
    return f"{type(error).__name__}: {error}"
