"""Same host, one copy, one-sided: Linux cross-memory attach (``process_vm_writev`` / ``_readv``).

Why this and not a shared-memory mapping: CMA copies straight from the prefill process's block
memory into the decode process's registered blocks, whatever that memory is (numpy arrays, torch
tensors, raw addresses from another allocator), in one kernel copy per layer (batched iovecs, at most
IOV_MAX entries per call), near a single-thread memcpy (docs/perf/notes.md). A shared mapping would
reach memcpy speed but only for caches kvpush allocated itself, and it maps a peer's memory into this
process for the link's lifetime; CMA needs neither.

Safety, in layers:
- same host is decided from the boot id plus the pid and network namespaces (``host_identity``):
  two network namespaces count as two hosts, as they would be in a cluster;
- the peer's identity is pinned with a pidfd opened at link time and checked against the peer's
  process start time; before every copy the pidfd is polled, so a dead peer (or a reused pid) is
  an error, never a write into a stranger's memory;
- a probe read of a token the peer placed in its memory proves both identity and permission
  (ptrace rules, users, containers) before the link uses this path; a refusal falls back to TCP;
- the engine asks the receiver for every transfer first (it validates against its registry and
  pins the cache), so only ranges the receiver's registry describes are ever written or read.

Copies run in a worker thread (ctypes releases the GIL), so the event loop and the caller's compute
keep running while the kernel copies.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import errno
import hmac
import os
import select
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvpush.layout import FEW, IoVec

from .base import Capabilities, Mover, Offer, PeerWatch, TransportError
from .iovec import IOV_MAX, LIBC

CAPABILITIES = Capabilities(name="cma", one_sided=True, same_host_only=True, standing_grants=True)
INLINE_COPY_BYTES = 256 << 10
try:
    _writev = LIBC.process_vm_writev
    _readv = LIBC.process_vm_readv
    for _function in (_writev, _readv):
        _function.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                              ctypes.c_ulong)
        _function.restype = ctypes.c_ssize_t
    AVAILABLE = hasattr(os, "pidfd_open")
except AttributeError:  # not Linux
    AVAILABLE = False


class CmaError(TransportError):
    """A copy failed: the peer died (ESRCH), refused (EPERM) or a range was not mapped (EFAULT)."""

    @property
    def peer_gone(self) -> bool:
        return self.errno == errno.ESRCH


def _read_text(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def host_identity() -> str:
    """Equal for two processes exactly when CMA between them can work and they share a network."""
    parts = [_read_text("/proc/sys/kernel/random/boot_id")]
    for namespace in ("pid", "net"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{namespace}"))
        except OSError:
            parts.append("?")
    return "|".join(parts)


def process_start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), or -1."""
    stat = _read_text(f"/proc/{pid}/stat")
    if not stat:
        return -1
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19])


class Probe:
    """A token in this process's memory that a peer reads to prove it can reach us, and a second
    secret that never crosses the wire: a peer that echoes it has read it from our memory, which is
    what a standing grant (lease) requires."""

    def __init__(self) -> None:
        self.token = os.urandom(32)
        self.buffer = ctypes.create_string_buffer(self.token, len(self.token))
        self.secret = os.urandom(32)
        self.secret_buffer = ctypes.create_string_buffer(self.secret, len(self.secret))

    def describe(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "start": process_start_time(os.getpid()),
                "probe_addr": ctypes.addressof(self.buffer), "token": self.token.hex(),
                "secret_addr": ctypes.addressof(self.secret_buffer), "leases": 1}


class CmaPeer:
    """The peer process, pinned by a pidfd. Raises CmaError from the constructor when it cannot be
    reached (wrong identity, permission, not the same host)."""

    def __init__(self, description: dict[str, Any]) -> None:
        if not AVAILABLE:
            raise CmaError(errno.ENOSYS, "cross-memory attach is not available on this platform")
        try:
            self.pid = int(description["pid"])
            start = int(description["start"])
            probe_addr = int(description["probe_addr"])
            token = bytes.fromhex(str(description["token"]))
        except (KeyError, TypeError, ValueError):
            raise CmaError(errno.EINVAL, "malformed same-host description") from None
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except OSError as error:
            raise CmaError(error.errno, f"pidfd_open({self.pid}): {error.strerror}") from None
        self._poller = select.poll()
        self._poller.register(self.pidfd, select.POLLIN)
        try:
            if process_start_time(self.pid) != start:
                raise CmaError(errno.ESRCH, f"pid {self.pid} is not the peer process (start time differs)")
            got = np.zeros(len(token), np.uint8)
            self.read(IoVec.of_ints((got.ctypes.data, len(token))), IoVec.of_ints((probe_addr, len(token))))
            if got.tobytes() != token:
                raise CmaError(errno.EACCES, "probe read returned the wrong token: not the peer's memory")
            self.leases = int(description.get("leases", 0)) >= 1 and "secret_addr" in description
            self.secret = b""
            if self.leases:  # read the peer's in-memory secret: our proof of reach when asking for leases
                secret = np.zeros(32, np.uint8)
                self.read(IoVec.of_ints((secret.ctypes.data, 32)), IoVec.of_ints((int(description["secret_addr"]), 32)))
                self.secret = secret.tobytes()
        except BaseException:
            os.close(self.pidfd)
            raise

    def alive(self) -> bool:
        """False once the peer process has exited (its pidfd turns readable)."""
        return not self._poller.poll(0)

    def _copy(self, function: Any, name: str, local: IoVec, remote: IoVec) -> int:
        """One kernel copy per IOV_MAX entries; local and remote entries pair up one to one."""
        if not self.alive():
            raise CmaError(errno.ESRCH, f"peer process {self.pid} has exited")
        if local.entries != remote.entries:
            raise CmaError(errno.EINVAL, f"{name}: {local.entries} local entries for {remote.entries} remote ones")
        pieces: Iterable[tuple[int, int, int]]
        if local.entries <= FEW:  # a few entries: both sides' struct iovecs in one array, one call
            both = array.array("Q", local.ints() + remote.ints())
            local_address = both.buffer_info()[0]
            pieces, remote_address = ((local_address, local.entries, local.nbytes),), local_address + 16 * local.entries
        else:
            pieces, remote_address = local.chunks(IOV_MAX), remote.native()[0]
        total = entry = 0
        for local_address, count, expected in pieces:
            done = function(self.pid, local_address, count, remote_address + 16 * entry, count, 0)
            if done < 0:
                code = ctypes.get_errno()
                raise CmaError(code, f"{name}(pid {self.pid}): {os.strerror(code)}")
            if done != expected:
                raise CmaError(errno.EFAULT, f"{name}(pid {self.pid}): copied {done} of {expected} bytes")
            total += done
            entry += count
        return total

    def write(self, local: IoVec, remote: IoVec) -> int:
        """Copy local -> peer (blocking; call from a worker thread for big copies)."""
        return self._copy(_writev, "process_vm_writev", local, remote)

    def read(self, local: IoVec, remote: IoVec) -> int:
        """Copy peer -> local (blocking)."""
        return self._copy(_readv, "process_vm_readv", local, remote)

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class CmaMover:
    """Moves a granted layer with one kernel copy in a worker thread (see ``kvpush.onesided``)."""

    capabilities = CAPABILITIES

    def __init__(self, peer: CmaPeer, name: str) -> None:
        self.peer = peer
        self.lease_proof = peer.secret.hex() if peer.leases else ""
        self._queued = 0
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kvpush-cma-{name}")

    def start(self, is_read: bool, local: IoVec, remote: IoVec, cache_id: int, first_tensor: int,
              rkeys: Any, runs_per_tensor: int) -> Any:
        copy = self.peer.read if is_read else self.peer.write
        if local.nbytes <= INLINE_COPY_BYTES and not self._queued:  # (an inline copy never overtakes queued ones)
            # small (decode-time) transfers: a thread hand-off would cost more than the copy
            future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            try:
                future.set_result(copy(local, remote))
            except CmaError as error:
                future.set_exception(error)
            return future
        self._queued += 1
        job = asyncio.wrap_future(self.executor.submit(copy, local, remote))
        job.add_done_callback(self._dequeue)
        return job

    def _dequeue(self, _: Any) -> None:
        self._queued -= 1

    def close(self) -> None:
        try:
            self.executor.submit(self.peer.close)  # after copies in flight, which still use the pidfd
        except RuntimeError:  # the interpreter is shutting down: no copy can run any more
            self.peer.close()
        self.executor.shutdown(wait=False)


class CmaOffer:
    """The probe this process offers one link: a peer that reads it proves it can reach us."""

    def __init__(self) -> None:
        self.probe = Probe()
        self.wire: dict[str, Any] = {"host": host_identity(), **self.probe.describe()}

    def proves_reach(self, proof: str) -> bool:
        return bool(proof) and hmac.compare_digest(proof, self.probe.secret.hex())


class PidWatch:
    """A pidfd on the same-host peer that was granted one-sided access."""

    def __init__(self, pidfd: int) -> None:
        self.pidfd = pidfd
        self._poller = select.poll()
        self._poller.register(pidfd, select.POLLIN)

    def alive(self) -> bool:
        return self.pidfd >= 0 and not self._poller.poll(0)

    def fileno(self) -> int:
        return self.pidfd

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class CmaTransport:
    """The same-host one-sided transport of one engine (``transports.base.OneSidedTransport``)."""

    capabilities = CAPABILITIES
    registrar = None

    def offer(self) -> Offer | None:
        return CmaOffer()

    def refusal(self, peer_offer: Any) -> str | None:
        if not isinstance(peer_offer, dict):
            return "the peer offered no same-host path"
        if peer_offer.get("host") != host_identity():
            return "the peer is on another host (or network/pid namespace)"
        return None

    def connect(self, peer_offer: Any, peer_name: str, on_error: Any) -> Mover:
        try:
            return CmaMover(CmaPeer(peer_offer), peer_name)
        except CmaError as error:
            raise CmaError(error.errno, f"the kernel refused cross-memory attach: {error}") from None

    def watch(self, peer_offer: Any) -> PeerWatch | None:
        """A pidfd of the peer process, if it is still the process that made the offer."""
        if not isinstance(peer_offer, dict):
            return None
        try:
            pid, start = int(peer_offer["pid"]), int(peer_offer["start"])
            pidfd = os.pidfd_open(pid)
        except (KeyError, TypeError, ValueError, OSError):
            return None
        if process_start_time(pid) != start:  # already gone and the pid reused
            os.close(pidfd)
            return None
        return PidWatch(pidfd)

    def close(self) -> None:
        pass


def open_transport(loop: asyncio.AbstractEventLoop, explicit: bool) -> tuple[CmaTransport | None, str]:
    """This engine's same-host transport, or why there is none (an explicit ``cma`` that cannot work
    is refused per link, where the reason names the peer)."""
    if not AVAILABLE:
        return None, "cross-memory attach is not available on this platform"
    return CmaTransport(), ""
