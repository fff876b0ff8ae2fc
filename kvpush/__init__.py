"""kvpush: push paged KV-cache blocks between LLM serving processes (LLM-DataDist's model, async)."""

from .access import BlockAccess
from .cache_manager import CacheManager
from .config import LLMConfig
from .datadist import LLMDataDist
from .notify import MAX_MESSAGE_BYTES, Delivery, Inbox
from .options import AUTH_TOKEN_ENV, is_loopback
from .probe import probe
from .status import LLMException, LLMStatusCode
from .types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LLMClusterInfo,
    LLMRole,
    Placement,
    RemoteAccess,
)

__version__ = "0.1.0"

__all__ = [
    "AUTH_TOKEN_ENV",
    "BlockAccess",
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "DataType",
    "Delivery",
    "Inbox",
    "KvCacheExtParam",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "MAX_MESSAGE_BYTES",
    "Placement",
    "RemoteAccess",
    "__version__",
    "is_loopback",
    "probe",
]
