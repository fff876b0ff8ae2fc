"""Compatibility facades over kvpush's async engine.

``kvpush.compat.llm_datadist`` offers Huawei LLM-DataDist's names with its blocking signatures, so
code written for ``llm_datadist`` runs after changing only its import::

    from kvpush.compat.llm_datadist import LLMDataDist, LLMRole, LLMConfig, CacheDesc, ...
"""

from . import llm_datadist

__all__ = ["llm_datadist"]
