"""Status codes and the exception every kvpush call raises for a documented failure.

The numeric values are LLM-DataDist's, so code that compares ``status_code`` against numbers
taken from LLM-DataDist logs or headers keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum


class LLMStatusCode(IntEnum):
    """LLM-DataDist's status codes (same names, same numbers)."""

    LLM_SUCCESS = 0x0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROC_TIMEOUT = 0x5010B001
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
    LLM_NO_FREE_BLOCK = 0x5010B012
    LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C
    LLM_UNKNOWN_ERROR = -1

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
    """

    def __init__(
        self,
        status_code: LLMStatusCode,
        message: str = "",
        completed_layers: Sequence[int] = (),
    ) -> None:
        self.status_code = LLMStatusCode(status_code)
        self.completed_layers: list[int] = list(completed_layers)
        text = f"[{self.status_code.name}] {message}" if message else self.status_code.name
        super().__init__(text)


def param_invalid(message: str) -> LLMException:
    """The LLM_PARAM_INVALID exception (the most common one) in one short call."""
    return LLMException(LLMStatusCode.LLM_PARAM_INVALID, message)
