"""Adapters that plug kvpush into serving engines, each a thin layer over a vendor-free core.

- ``kvpush.integrations.vllm_core``: the bookkeeping of vLLM's KV connector (messages, per-request
  state on both sides, deadlines); pure logic, importable without vLLM or torch.
- ``kvpush.integrations.vllm_settings``: what the connector reads from vLLM's objects (its settings, a
  worker's KV tensors as one blocks cache, a scheduler output's requests); vLLM-free.
- ``kvpush.integrations.vllm_bridge``: a worker's kvpush engine on its own event-loop thread and every
  call the connector makes on it; ``kvpush.integrations.vllm_worker``: the per-worker state. vLLM-free.
- ``kvpush.integrations.vllm``: ``KvpushConnector``, the ``KVConnectorBase_V1`` vLLM loads with
  ``kv_connector="KvpushConnector", kv_connector_module_path="kvpush.integrations.vllm"``.

- ``kvpush.integrations.sglang``: the SGLang plugin (entry point ``sglang.srt.plugins``) that makes ``kvpush`` a
  ``--disaggregation-transfer-backend``; ``kvpush.integrations.sglang_backend``: the backend's classes, SGLang's
  ``Common*`` with kvpush moving the pages; ``kvpush.integrations.sglang_core``: its SGLang-free core (the pool
  as kvpush blocks, heads between TP sizes, its messages and settings), sharing ``vllm_core``'s TP maths.

These modules use kvpush's public API only.
"""
