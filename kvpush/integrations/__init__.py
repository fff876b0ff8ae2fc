"""Adapters that let serving engines use kvpush (vLLM's KV connector): thin, over vLLM-free cores."""
