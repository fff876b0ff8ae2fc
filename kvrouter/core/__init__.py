"""The router's decisions, without I/O: prompts' block hashes (``hashing``), what each instance holds
(``index``), its KV events read and followed (``kv_events``), where a request goes (``placement``), the
upstream pools and the copies of a request each upstream gets (``pools``), the first token from the prefill
(``first_token``)."""
