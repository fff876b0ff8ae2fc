"""An instance that registers itself in etcd and stays until killed (a process a test can SIGKILL).

    python tests/fleet/register.py etcd://127.0.0.1:P ROLE ID URL [TTL]
"""

from __future__ import annotations

import asyncio
import sys

from kvpush.fleet import Instance, parse_discovery
from kvpush.fleet.etcd import Registrar


async def main(discovery: str, role: str, instance_id: str, url: str, ttl: int) -> None:
    instance = Instance(instance_id, role, url, "tiny", "compat-1", () if role == "decode" else ("127.0.0.1:14579",))
    registrar = Registrar(parse_discovery(discovery), instance, ttl=ttl, refresh_s=0.3)
    task = asyncio.create_task(registrar.run())
    await registrar.registered.wait()
    print("registered", flush=True)
    await task


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else 3))
