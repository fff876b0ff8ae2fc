"""Ports of LLM-DataDist's official Python samples (``examples/python/llm_datadist/`` of hicann/hixl),
written here, each role a separate OS process on this host (loopback), on ``kvpush.compat.llm_datadist``.

What the samples get from the NPU and ``torch.distributed`` is stood in for by CPU torch tensors and
``harness.Ctx`` (barriers, a few shared integers such as ports). Each port checks the bytes the
sample only logs. ``placement`` is the sample's ``Placement.DEVICE`` or ``HOST`` (see
``test_sample_flows``).
"""
