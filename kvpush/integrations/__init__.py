"""Adapters that plug kvpush into serving engines: a room per engine, each a thin layer over a vendor-free core,
and the pure modules both share.

- ``kvpush.integrations.vllm``: ``KvpushConnector``, the KV connector vLLM loads with
  ``kv_connector="KvpushConnector", kv_connector_module_path="kvpush.integrations.vllm"`` (its books in
  ``vllm.core``: pure, importable without vLLM or torch).
- ``kvpush.integrations.sglang``: the SGLang plugin (entry point ``sglang.srt.plugins``) that makes ``kvpush`` a
  ``--disaggregation-transfer-backend`` (its SGLang-free core in ``sglang.core``).

Shared, pure: ``families`` (which blocks, pages and state slots of each model family move: full attention, MLA,
sliding windows, recurrent state), ``topology`` (KV heads over tensor-parallel ranks; what two instances'
geometries allow), ``config`` (the settings and request parameters both engines take), ``errors``; and
``liveness`` (is a peer gone) and ``sched_group`` (a worker's scheduling group).

These modules use kvpush's public API only.
"""
