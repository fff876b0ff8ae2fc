"""Adapters that plug kvpush into serving engines, each a thin layer over a vendor-free core.

- ``kvpush.integrations.vllm_core``: the bookkeeping of vLLM's KV connector (messages, per-request
  state on both sides, deadlines); pure logic, importable without vLLM or torch.
- ``kvpush.integrations.vllm_worker``: the connector's worker side (the kvpush engine on its own
  event-loop thread, the per-worker state); vLLM-free too.
- ``kvpush.integrations.vllm``: ``KvpushConnector``, the ``KVConnectorBase_V1`` vLLM loads with
  ``kv_connector="KvpushConnector", kv_connector_module_path="kvpush.integrations.vllm"``.

These modules use kvpush's public API only.
"""
