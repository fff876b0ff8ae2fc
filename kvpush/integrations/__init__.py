"""Adapters that plug kvpush into serving engines, each a thin layer over a vendor-free core.

- ``kvpush.integrations.vllm_core``: the bookkeeping of vLLM's KV connector (messages, per-request
  state on both sides, deadlines); pure logic, importable without vLLM or torch.
- ``kvpush.integrations.vllm_settings``: what the connector reads from vLLM's objects (its settings, a
  worker's KV tensors as one blocks cache, a scheduler output's requests); vLLM-free.
- ``kvpush.integrations.vllm_bridge``: a worker's kvpush engine on its own event-loop thread and every
  call the connector makes on it; ``kvpush.integrations.vllm_worker``: the per-worker state. vLLM-free.
- ``kvpush.integrations.vllm``: ``KvpushConnector``, the ``KVConnectorBase_V1`` vLLM loads with
  ``kv_connector="KvpushConnector", kv_connector_module_path="kvpush.integrations.vllm"``.

These modules use kvpush's public API only.
"""
