"""Status codes and the exception every kvpush call raises for a documented failure.

The numeric values are LLM-DataDist's, so code that compares ``status_code`` against numbers
taken from LLM-DataDist logs or headers keeps working. ``str(code)`` is ``"LLMStatusCode.NAME"``, as
in LLM-DataDist; ``int(code)`` and ``%d`` give the number.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum


class LLMStatusCode(IntEnum):
    """LLM-DataDist's status codes (same names, same numbers)."""

    LLM_SUCCESS = 0x0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROC_TIMEOUT = 0x5010B001
    LLM_WAIT_PROCESS_TIMEOUT = 0x5010B001  # LLM-DataDist's Python name for the same code
    LLM_KV_CACHE_NOT_EXIST = 0x5010B002
    LLM_REPEAT_REQUEST = 0x5010B003
    LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004
    LLM_PARAM_INVALID = 0x5010B005
    LLM_ENGINE_FINALIZED = 0x5010B006
    LLM_NOT_YET_LINK = 0x5010B007
    LLM_ALREADY_LINK = 0x5010B008
    LLM_LINK_FAILED = 0x5010B009
    LLM_UNLINK_FAILED = 0x5010B00A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00C
    LLM_PROCESSING_LINK = 0x5010B00D
    LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00E
    LLM_PREFIX_ALREADY_EXIST = 0x5010B00F
    LLM_PREFIX_NOT_EXIST = 0x5010B010
    LLM_SEQ_LEN_OVER_LIMIT = 0x5010B011
    LLM_SEQ_LENOVERLIMIT = 0x5010B011  # LLM-DataDist's Python spelling of the same code
    LLM_NO_FREE_BLOCK = 0x5010B012
    LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C
    LLM_DEVICE_MEM_ERROR = 507053  # the runtime's ACL_ERROR_RT_DEVICE_MEM_ERROR, as LLM-DataDist reports it
    LLM_SUSPECT_REMOTE_ERROR = 507057  # ACL_ERROR_RT_SUSPECT_REMOTE_ERROR
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    @classmethod
    def from_wire(cls, value: int) -> LLMStatusCode:
        """Map a number received from a peer to a code; unknown numbers become LLM_FAILED."""
        try:
            return cls(value)
        except ValueError:
            return cls.LLM_FAILED


class LLMException(RuntimeError):
    """A kvpush call failed for a documented reason.

    ``status_code`` says which; the message names the call and the reason. Transfers that ran
    layer by layer also carry ``completed_layers``: the (source-side) layer indices whose every
    byte is known to be in the destination's memory when the exception was raised.

    Two ways to make one, both kept:

    - kvpush's: ``LLMException(status_code, message="", completed_layers=())``; ``str()`` is
      ``"[LLM_NAME] message"``;
    - LLM-DataDist's: ``LLMException(*args, status_code=LLMStatusCode.LLM_SUCCESS)`` (e.g.
      ``LLMException("pull failed", status_code=LLMStatusCode.LLM_TIMEOUT)``); ``str()`` is the message,
      and the code defaults to LLM_SUCCESS exactly as there.

    A first positional argument that is an ``int`` (an ``LLMStatusCode`` or its number), or
    ``message=`` given as a keyword, selects the first form; anything else the second.
    """

    status_code: LLMStatusCode
    completed_layers: list[int]

    def __init__(self, *args: object, status_code: int | None = None, message: str | None = None,
                 completed_layers: Sequence[int] = ()) -> None:
        if message is not None:  # kvpush's form with the message by keyword
            if len(args) > 1:
                raise TypeError("LLMException: message given twice")
            code = args[0] if args else (LLMStatusCode.LLM_FAILED if status_code is None else status_code)
            args, status_code = (code, message), None
        if status_code is None and args and isinstance(args[0], int) and not isinstance(args[0], bool):
            code = LLMStatusCode(args[0])
            message = str(args[1]) if len(args) > 1 else ""
            layers = args[2] if len(args) > 2 else completed_layers
            if len(args) > 3:
                raise TypeError("LLMException(status_code, message, completed_layers) takes at most 3 arguments")
            self.status_code = code
            self.completed_layers = [int(layer) for layer in layers]  # type: ignore[attr-defined]
            super().__init__(f"[{code.name}] {message}" if message else code.name)
            return
        self.status_code = LLMStatusCode(LLMStatusCode.LLM_SUCCESS if status_code is None else status_code)
        self.completed_layers = [int(layer) for layer in completed_layers]
        super().__init__(*args)

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt from the final text and attributes, whichever form made it (pickling across processes).
        return (_rebuild, (type(self), self.args, int(self.status_code), self.completed_layers))


def _rebuild(cls: type[LLMException], args: tuple[object, ...], status_code: int,
             completed_layers: list[int]) -> LLMException:
    error = cls.__new__(cls)
    RuntimeError.__init__(error, *args)
    error.status_code = LLMStatusCode(status_code)
    error.completed_layers = list(completed_layers)
    return error


def param_invalid(message: str) -> LLMException:
    """The LLM_PARAM_INVALID exception (the most common one) in one short call."""
    return LLMException(LLMStatusCode.LLM_PARAM_INVALID, message)
