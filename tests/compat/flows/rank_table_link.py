"""The rank-table link of the pull samples (``pull_sample_common.link``): ``LLMDataDist.link`` with a
rank table of two ranks (cluster 1 rank 0, cluster 2 rank 1), then ``query_register_mem_status`` until
OK. On this host both ranks are 127.0.0.1; the port rank 0 listens on is the device entry's
``device_port`` (the test picks a free one)."""

from __future__ import annotations

import json
import logging
import time

from flows.harness import HOST_IP, Ctx
from kvpush.compat.llm_datadist import LLMConfig, LLMDataDist, LLMRole, RegisterMemStatus

RANK0_PORT = 0  # Ctx slot: where rank 0 (cluster 1) listens
MEM_POOL_SIZE = 64 * 1024 * 1024

log = logging.getLogger("rank_table")


def init_llm_datadist(role: LLMRole, cluster_id: int, enable_mem_pool: bool = True) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.enable_cache_manager = True
    if enable_mem_pool:
        llm_config.mem_pool_cfg = f'{{"memory_size": {MEM_POOL_SIZE}}}'
    datadist.init(llm_config.generate_options())
    return datadist


def rank_table(ctx: Ctx) -> str:
    return json.dumps({
        "server_count": "1",
        "status": "completed",
        "version": "1.2",
        "server_list": [{
            "device": [
                {"device_id": "0", "device_ip": HOST_IP, "device_port": str(ctx.get(RANK0_PORT)), "rank_id": "0"},
                {"device_id": "1", "device_ip": HOST_IP, "rank_id": "1"},
            ],
            "host_ip": HOST_IP,
            "server_id": "1",
        }],
    })


def link(ctx: Ctx, datadist: LLMDataDist) -> int:
    comm_id = datadist.link("link", {1: 0, 2: 1}, rank_table(ctx))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ret = datadist.query_register_mem_status(comm_id)
        if ret == RegisterMemStatus.OK:
            log.info("query_register_mem_status ok")
            return comm_id
        if ret == RegisterMemStatus.FAILED:
            raise RuntimeError("link failed")
        time.sleep(0.05)  # the sample checks once a second
    raise RuntimeError("link still preparing after 30 s")
