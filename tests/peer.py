"""A kvpush engine in its own OS process, driven by the tests over stdin/stdout.

Run as a script it serves JSON commands (one per line) and answers each with one ``@@CTL {json}``
line. Imported, ``Peer`` starts such a process and talks to it; every test that starts one ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

import numpy as np

CTL = "@@CTL "
HERE = os.path.abspath(__file__)


# -- the process side -------------------------------------------------------------------------------
async def _serve() -> None:
    import kvpush
    from kvpush import BlocksCacheKey, CacheDesc, CacheKey, DataType, LLMClusterInfo, LLMDataDist, LLMRole

    engine: LLMDataDist | None = None
    caches: dict[str, kvpush.Cache] = {}
    held: list[Any] = []
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def reply(body: dict[str, Any]) -> None:
        sys.stdout.write(CTL + json.dumps(body) + "\n")
        sys.stdout.flush()

    async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        nonlocal engine
        op = cmd["op"]
        if op == "init":
            engine = LLMDataDist(LLMRole(cmd.get("role", 2)), cmd["cluster_id"])
            await engine.init(cmd.get("options", {"llm.listenIpInfo": "127.0.0.1:0"}))
            return {"port": engine.listen_address[1] if engine.listen_address else None}
        assert engine is not None
        cm = engine.cache_manager
        if op == "allocate":
            desc = CacheDesc(cmd["num_tensors"], tuple(cmd["shape"]), DataType(cmd.get("dtype", 1)))
            key = BlocksCacheKey(engine.cluster_id, cmd["model_id"]) if cmd.get("model_id") is not None else None
            if cmd.get("blocks", True):
                access = kvpush.RemoteAccess(cmd.get("access", "open"))
                cache = cm.allocate_blocks_cache(desc, key, remote_access=access)
            else:  # "req_ids": the request ids of the cache keys naming its slots, in slot order
                cache = cm.allocate_cache(desc, [CacheKey(engine.cluster_id, r) for r in cmd.get("req_ids", [])])
            caches[cmd["name"]] = cache
            if cmd.get("seed") is not None:
                fill(cache.tensors, cmd["seed"])
            return {"cache_id": cache.cache_id}
        if op == "fill":
            fill(caches[cmd["name"]].tensors, cmd["seed"])
            return {}
        if op == "snapshot":
            np.save(cmd["path"], np.stack([t.view(np.uint8) for t in caches[cmd["name"]].tensors]))
            return {}
        if op == "unregister":
            cm.deallocate_cache(caches.pop(cmd["name"]))
            return {}
        if op == "keys":  # the request ids whose keys still name slots of the cache, by slot
            entry = engine.registry.get(caches[cmd["name"]].cache_id)
            return {"slots": {} if entry is None else {str(slot): name[1] for name, slot in entry.keys.items()}}
        if op == "links":
            return {"links": sorted(engine.links)}
        if op == "pins":  # how many transfers, grants or leases hold the cache
            entry = engine.registry.get(caches[cmd["name"]].cache_id)
            return {"pins": None if entry is None else entry.pins}
        if op == "cpu":  # CPU seconds this process has used
            return {"seconds": time.process_time()}
        if op == "link":
            info = LLMClusterInfo()
            info.remote_cluster_id = cmd["cluster_id"]
            info.append_remote_ip_info(cmd.get("host", "127.0.0.1"), cmd["port"])
            status, codes = await engine.link_clusters([info], timeout=cmd.get("timeout", 5000))
            return {"status": int(status), "codes": [int(c) for c in codes]}
        if op == "drop_privileges":  # become an unprivileged user: the kernel refuses it cross-memory attach
            "localhost".encode("idna")  # load what is imported lazily while the files are still readable
            await loop.getaddrinfo("127.0.0.1", 1)
            os.setgroups([])
            os.setresgid(cmd["uid"], cmd["uid"], cmd["uid"])
            os.setresuid(cmd["uid"], cmd["uid"], cmd["uid"])
            return {"uid": os.getuid()}
        if op == "link_info":
            return {"links": {str(c): {"transport": link.transport, "fallback_reason": link.fallback_reason}
                              for c, link in engine.links.items()}}
        if op == "try_push":  # report the terminal state instead of raising
            started = loop.time()
            try:
                await cm.push_blocks(BlocksCacheKey(cmd["cluster_id"], cmd.get("model_id", 0)), caches[cmd["name"]],
                                     cmd["src_blocks"], cmd["dst_blocks"])
                status = 0
            except kvpush.LLMException as error:
                status = int(error.status_code)
            return {"status": status, "seconds": loop.time() - started}
        if op == "allow":  # grant a peer write access to blocks of a GRANTED cache, for the process's life
            held.append(cm.allow(caches[cmd["name"]], cmd["peer"], cmd["blocks"]))
            return {}
        if op == "revoke":  # end every grant "allow" made (a request aborted: its blocks may go to another)
            for access in held:
                if isinstance(access, kvpush.BlockAccess):
                    access.revoke()
            return {}
        if op == "try_pull":  # report the terminal state instead of raising
            try:
                await cm.pull_blocks(BlocksCacheKey(cmd["cluster_id"], cmd.get("model_id", 0)), caches[cmd["name"]],
                                     cmd["src_blocks"], cmd["dst_blocks"])
                status = 0
            except kvpush.LLMException as error:
                status = int(error.status_code)
            return {"status": status}
        if op == "hold_pusher":  # prepare a request (its one-sided layers get granted) and push nothing yet
            held.append(cm.layer_pusher(BlocksCacheKey(cmd["cluster_id"], cmd.get("model_id", 0)), caches[cmd["name"]],
                                        cmd["src_blocks"], cmd["dst_blocks"]))
            return {"layers": held[-1].num_layers, "copies_here": held[-1].copies_here}
        if op == "push_many":  # many concurrent requests, each its own push_blocks
            key = BlocksCacheKey(cmd["cluster_id"], cmd.get("model_id", 0))
            jobs = [cm.push_blocks(key, caches[cmd["name"]], s, d) for s, d in cmd["requests"]]
            results = await asyncio.gather(*jobs, return_exceptions=True)
            return {"errors": [repr(r) for r in results if isinstance(r, BaseException)]}
        if op == "stats":
            return {"stats": {str(k): v for k, v in engine.link_stats().items()},
                    "fds": len(os.listdir("/proc/self/fd"))}
        if op == "push":
            await cm.push_blocks(BlocksCacheKey(cmd["cluster_id"], cmd.get("model_id", 0)), caches[cmd["name"]],
                                 cmd["src_blocks"], cmd["dst_blocks"])
            return {}
        if op == "finalize":
            await engine.finalize()
            return {}
        raise ValueError(f"unknown op {op}")

    reply({"ready": True, "pid": os.getpid()})
    while True:
        line = await reader.readline()
        if not line:
            break
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            if engine is not None:
                await engine.finalize()
            reply({"ok": True})
            break
        try:
            reply({"ok": True, **await handle(cmd)})
        except Exception as error:
            reply({"ok": False, "error": repr(error), "trace": traceback.format_exc()})


def fill(tensors: list[np.ndarray[Any, Any]], seed: int) -> None:
    """Deterministic bytes per (seed, tensor) that the tests regenerate with ``expected``."""
    for index, tensor in enumerate(tensors):
        raw = tensor.reshape(-1).view(np.uint8)
        raw[:] = pattern(seed, index, raw.nbytes)


def pattern(seed: int, tensor_index: int, nbytes: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng([seed, tensor_index]).integers(0, 256, nbytes, dtype=np.uint8)


# -- the test side ----------------------------------------------------------------------------------
class Peer:
    """A peer engine process. Use as a context manager; it is always ended on exit."""

    def __init__(self, cluster_id: int, options: dict[str, str] | None = None, role: int = 2,
                 wrapper: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        """``wrapper`` prefixes the command line (e.g. ``ip netns exec NAME`` to run on another "host");
        ``env`` adds environment variables."""
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen([*(wrapper or []), sys.executable, HERE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.cluster_id = cluster_id
        self.pid = self._read()["pid"]
        opts = {"llm.listenIpInfo": "127.0.0.1:0"} if options is None else options
        self.port = self.call("init", cluster_id=cluster_id, options=opts, role=role)["port"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"peer {self.cluster_id} exited (rc={self.proc.poll()})")
            if line.startswith(CTL):
                result: dict[str, Any] = json.loads(line[len(CTL):])
                return result
            sys.stderr.write(f"[peer {self.cluster_id}] {line}")

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        result = self._read()
        if not result.get("ok", False):
            raise RuntimeError(f"peer {op} failed: {result.get('error')}\n{result.get('trace')}")
        return result

    async def acall(self, op: str, **args: Any) -> dict[str, Any]:
        """``call`` without blocking the test's event loop (the peer may be talking to it)."""
        return await asyncio.to_thread(self.call, op, **args)

    def snapshot(self, name: str, tmp_path: Any) -> np.ndarray[Any, Any]:
        path = os.path.join(str(tmp_path), f"snap-{self.cluster_id}-{name}.npy")
        self.call("snapshot", name=name, path=path)
        return np.load(path)

    async def asnapshot(self, name: str, tmp_path: Any) -> np.ndarray[Any, Any]:
        return await asyncio.to_thread(self.snapshot, name, tmp_path)

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.signal(signal.SIGCONT)
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    asyncio.run(_serve())
