"""kvpush's own thin binding of UCX's UCP API (cffi, API mode), event driven on asyncio.

Only what kvpush needs: a context and worker (thread mode configurable, default single-threaded:
every call comes from the event loop thread), worker addresses exchanged over the engine's control
link, endpoints with an error callback, ``ucp_mem_map`` + ``ucp_rkey_pack`` of registered caches,
``ucp_ep_rkey_unpack``, and one batched native call that posts a layer's ``ucp_put_nbx`` (or
``ucp_get_nbx``) for every merged run and then one ``ucp_ep_flush_nbx`` whose callback completes
an asyncio future. No Python runs per run or per block.

Completion is event driven: the worker's event fd (``ucp_worker_get_efd``) is watched with
``loop.add_reader``; on an event the worker is progressed until idle and re-armed
(``ucp_worker_arm``). Arming can report BUSY forever after a peer died while progress finds nothing,
so retries are bounded and continue from a short timer, which is cancelled before the worker is
destroyed. An idle link costs no CPU.

Building: the binding's cffi cdefs (``ucp.cdef``) and C source (``ucp_shim.c``) are package data
next to this module, read at build time. The C part is compiled against the headers of the UCX
actually loaded (cffi API mode), on first use, into a cache directory (``KVPUSH_CACHE_DIR``, default
``~/.cache/kvpush``), keyed by the UCX location and version (its ``ucp_version.h``) and by the
contents of those two files, so struct layouts always match and an edited binding is rebuilt. It
needs cffi and a C compiler. Which UCX: the ``libucx-cu12`` wheel by default (``pip install
'kvpush[ucx]'``; no RDMA verbs in it); set ``KVPUSH_UCX_PREFIX=/opt/ucx`` (a prefix with
``include/ucp/api/ucp.h`` and ``lib/libucp.so``) to use a system UCX built with verbs on an RDMA host.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import logging
import os
import sys
import sysconfig
import threading
from collections.abc import Callable
from importlib import resources
from typing import Any

from kvpush.layout import IoVec

log = logging.getLogger(__name__)

# The binding's cffi cdefs and C source: package data of ``transports``, read at build time.
_CDEF_FILE, _SOURCE_FILE = "ucp.cdef", "ucp_shim.c"

UCS_OK = 0
_ARM_RETRIES = 16
_ADDRESS_MAX = 1 << 16
_RKEY_MAX = 1 << 12


class UcpUnavailable(Exception):
    """UCX cannot be used here; the message names what is missing."""


class UcpError(Exception):
    """A UCX call failed; ``status`` is the ucs_status_t, the message names it."""

    def __init__(self, what: str, status: int, text: str) -> None:
        super().__init__(f"{what}: {text} (ucs_status_t {status})")
        self.status = status


_loaded: tuple[Any, Any] | None = None
_load_error: str | None = None
_load_lock = threading.Lock()


def _locate() -> tuple[str, str, str]:
    """(include dir, lib dir, description) of the UCX to build against."""
    prefix = os.environ.get("KVPUSH_UCX_PREFIX")
    if prefix:
        include, lib = os.path.join(prefix, "include"), os.path.join(prefix, "lib")
        if not os.path.isfile(os.path.join(include, "ucp", "api", "ucp.h")):
            raise UcpUnavailable(f"KVPUSH_UCX_PREFIX={prefix} has no include/ucp/api/ucp.h")
        return include, lib, f"system UCX at {prefix}"
    try:
        import libucx
    except ImportError:
        raise UcpUnavailable("the UCX transport needs the 'libucx-cu12' package: pip install 'kvpush[ucx]'") from None
    root = os.path.dirname(libucx.__file__)
    return os.path.join(root, "include"), os.path.join(root, "lib"), f"libucx wheel {root}"


def _read_binding() -> tuple[str, str]:
    """(cdefs, C source) of the binding: the package data next to this module."""
    package = resources.files("transports")
    try:
        return (package.joinpath(_CDEF_FILE).read_text(encoding="utf-8"),
                package.joinpath(_SOURCE_FILE).read_text(encoding="utf-8"))
    except OSError as error:
        raise UcpUnavailable(f"the UCX binding's source is missing from the kvpush installation: {error}") from None


def _ucx_version_header(include: str) -> str:
    """ucp_version.h of the UCX built against (its API version): part of the cache key."""
    try:
        with open(os.path.join(include, "ucp", "api", "ucp_version.h"), encoding="utf-8") as header:
            return header.read()
    except OSError:
        return ""


def load() -> tuple[Any, Any]:
    """The compiled binding (ffi, lib), built on first use. Raises UcpUnavailable with the reason."""
    global _loaded, _load_error
    with _load_lock:
        if _loaded is not None:
            return _loaded
        if _load_error is not None:
            raise UcpUnavailable(_load_error)
        try:
            _loaded = _build_and_import()
        except UcpUnavailable as error:
            _load_error = str(error)
            raise
        return _loaded


def _build_and_import() -> tuple[Any, Any]:
    try:
        import cffi
    except ImportError:
        raise UcpUnavailable("the UCX transport needs the 'cffi' package: pip install 'kvpush[ucx]'") from None
    include, libdir, description = _locate()
    cdef, source = _read_binding()
    key = hashlib.sha256("\0".join([cdef, source, include, libdir, _ucx_version_header(include), sys.version,
                                    cffi.__version__]).encode())
    name = f"_kvpush_ucp_{key.hexdigest()[:16]}"
    cache = os.path.join(os.environ.get("KVPUSH_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache",
                                                                         "kvpush")), name)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    module_path = os.path.join(cache, name + suffix)
    if not os.path.exists(module_path):
        os.makedirs(cache, exist_ok=True)
        builder = cffi.FFI()
        builder.cdef(cdef)
        builder.set_source(name, source, include_dirs=[include], library_dirs=[libdir], libraries=["ucp", "ucs"],
                           extra_link_args=[f"-Wl,-rpath,{libdir}"])
        try:
            builder.compile(tmpdir=cache, verbose=False)
        except Exception as error:  # a missing compiler or headers: say so, never crash the engine
            raise UcpUnavailable(f"cannot build the UCX binding against {description}: {error}") from None
        log.info("built the UCX binding from %s against %s in %s", resources.files("transports"), description,
                 cache)
    spec = importlib.util.spec_from_file_location(name, module_path)
    if spec is None or spec.loader is None:
        raise UcpUnavailable(f"cannot load {module_path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        raise UcpUnavailable(f"cannot load the UCX binding ({description}): {error}") from None
    ffi, lib = module.ffi, module.lib

    @ffi.def_extern()  # type: ignore[untyped-decorator]
    def kvp_py_done(user_data: Any, status: int) -> None:
        _dispatch(_completions, user_data, status)

    @ffi.def_extern()  # type: ignore[untyped-decorator]
    def kvp_py_ep_error(arg: Any, status: int) -> None:
        _dispatch(_ep_errors, arg, status)

    return ffi, lib


# Callbacks run inside ucp_worker_progress on the loop thread; they find their Python target by the
# integer token passed to C as a pointer-sized user_data.
_completions: dict[int, Callable[[int], None]] = {}
_ep_errors: dict[int, Callable[[int], None]] = {}
_tokens = iter(range(1, 1 << 62))


def _dispatch(table: dict[int, Callable[[int], None]], pointer: Any, status: int) -> None:
    ffi, _ = _loaded  # type: ignore[misc]
    token = int(ffi.cast("uintptr_t", pointer))
    callback = table.pop(token, None) if table is _completions else table.get(token)
    if callback is not None:
        try:
            callback(int(status))
        except Exception:  # never let an exception unwind through C
            log.exception("UCX callback failed")


def rdma_capable() -> bool:
    """True when the loaded UCX has a verbs module and this host has an RDMA device."""
    try:
        _, libdir, _ = _locate()
    except UcpUnavailable:
        return False
    has_module = os.path.exists(os.path.join(libdir, "ucx", "libuct_ib.so"))
    try:
        has_device = bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        has_device = False
    return has_module and has_device


class Worker:
    """A UCP context and worker driven by an asyncio loop (see module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, multi_thread: bool = False, tls: str | None = None) -> None:
        """``tls``: UCX transports for this worker only (like UCX_TLS); None: UCX's configuration."""
        self.ffi, self.lib = load()
        ffi, lib = self.ffi, self.lib
        context = ffi.new("ucp_context_h *")
        worker = ffi.new("ucp_worker_h *")
        efd = ffi.new("int *")
        tls_arg = ffi.new("char[]", tls.encode()) if tls is not None else ffi.NULL
        self.check("ucp_init", lib.kvp_open(int(multi_thread), tls_arg, context, worker, efd))
        self.context, self.worker, self.efd = context[0], worker[0], int(efd[0])
        self.loop = loop
        self.closed = False
        self._retry: asyncio.TimerHandle | None = None
        self.endpoints: set[Endpoint] = set()
        buffer = ffi.new("char[]", _ADDRESS_MAX)
        length = ffi.new("size_t *", _ADDRESS_MAX)
        self.check("ucp_worker_get_address", lib.kvp_worker_address(self.worker, buffer, length))
        self.address = bytes(ffi.buffer(buffer, length[0]))
        loop.add_reader(self.efd, self.kick)

    def check(self, what: str, status: int) -> None:
        if status != UCS_OK:
            raise UcpError(what, status, self.ffi.string(self.lib.ucs_status_string(status)).decode())

    def status_text(self, status: int) -> str:
        return str(self.ffi.string(self.lib.ucs_status_string(status)).decode())

    def kick(self) -> None:
        """Progress until idle, then arm the event fd; bounded, continuing from a timer if UCX
        keeps reporting BUSY."""
        if self.closed:
            return
        self._retry = None
        lib, worker = self.lib, self.worker
        for _ in range(_ARM_RETRIES):
            while lib.ucp_worker_progress(worker):
                pass
            status = lib.ucp_worker_arm(worker)
            if status == UCS_OK:
                return
            if status != self.lib.UCS_ERR_BUSY:
                log.warning("ucp_worker_arm: %s", self.status_text(status))
                break
        self._retry = self.loop.call_later(0.001, self.kick)

    def map(self, address: int, length: int) -> tuple[Any, bytes]:
        """Register memory with UCX: (memory handle, packed rkey for peers)."""
        ffi, lib = self.ffi, self.lib
        memh = ffi.new("ucp_mem_h *")
        self.check("ucp_mem_map", lib.kvp_mem_map(self.context, ffi.cast("void *", address), length, memh))
        buffer = ffi.new("char[]", _RKEY_MAX)
        size = ffi.new("size_t *", _RKEY_MAX)
        try:
            self.check("ucp_rkey_pack", lib.kvp_rkey_pack(self.context, memh[0], buffer, size))
        except UcpError:
            lib.ucp_mem_unmap(self.context, memh[0])
            raise
        return memh[0], bytes(ffi.buffer(buffer, size[0]))

    def unmap(self, memh: Any) -> None:
        if not self.closed:
            self.lib.ucp_mem_unmap(self.context, memh)

    def connect(self, peer_address: bytes, on_error: Callable[[str], None], peer_error_mode: bool = False) -> Endpoint:
        return Endpoint(self, peer_address, on_error, peer_error_mode)

    def close(self) -> None:
        """Close every endpoint, stop watching the fd, destroy the worker and context."""
        if self.closed:
            return
        for endpoint in list(self.endpoints):
            endpoint.close()
        if self._retry is not None:  # a late retry on a destroyed worker would crash
            self._retry.cancel()
            self._retry = None
        self.loop.remove_reader(self.efd)
        self.closed = True
        self.lib.ucp_worker_destroy(self.worker)
        self.lib.ucp_cleanup(self.context)


class Endpoint:
    """One connection to a peer worker. ``rma`` posts a whole layer in one native call."""

    def __init__(self, worker: Worker, peer_address: bytes, on_error: Callable[[str], None],
                 peer_error_mode: bool) -> None:
        self.worker = worker
        ffi, lib = worker.ffi, worker.lib
        self._token = next(_tokens)
        self._on_error = on_error
        _ep_errors[self._token] = self._error
        ep = ffi.new("ucp_ep_h *")
        address = ffi.from_buffer(peer_address)
        try:
            worker.check("ucp_ep_create", lib.kvp_ep_create(worker.worker, address, int(peer_error_mode),
                                                             ffi.cast("void *", self._token), ep))
        except UcpError:
            _ep_errors.pop(self._token, None)
            raise
        self.ep = ep[0]
        self.peer_error_mode = peer_error_mode
        self.closed = False
        self._rkeys: list[Any] = []
        self._pending: dict[int, asyncio.Future[None]] = {}
        worker.endpoints.add(self)

    def _error(self, status: int) -> None:
        # from the loop, not inside ucp_worker_progress: progress also runs inside ``rma`` (and link
        # set-up), whose callers must not see their link closed in the middle of a call
        self.worker.loop.call_soon(self._on_error, f"UCX endpoint error: {self.worker.status_text(status)}")

    def unpack_rkey(self, packed: bytes) -> Any:
        ffi = self.worker.ffi
        rkey = ffi.new("ucp_rkey_h *")
        self.worker.check("ucp_ep_rkey_unpack", self.worker.lib.ucp_ep_rkey_unpack(self.ep, ffi.from_buffer(packed),
                                                                                     rkey))
        self._rkeys.append(rkey[0])
        return rkey[0]

    def rma(self, is_get: bool, local_iov: IoVec | Any, remote_iov: IoVec | Any, rkey_index: Any,
            rkeys: list[Any]) -> asyncio.Future[None]:
        """Post one layer (puts or gets of every entry, then a flush). The future resolves when UCX
        reports the flush complete: every byte is then in its destination. The vectors are ``IoVec``s (or
        what ``IoVec.of`` takes); entry i uses ``rkeys[rkey_index[i]]`` (``rkey_index``: a contiguous
        uint32 buffer)."""
        worker = self.worker
        ffi, lib = worker.ffi, worker.lib
        future: asyncio.Future[None] = worker.loop.create_future()
        if self.closed:
            future.set_exception(UcpError("rma", -1, "endpoint closed"))
            return future
        local, remote = IoVec.of(local_iov), IoVec.of(remote_iov)
        entries = local.entries
        # from_buffer over the vectors' own memory: no copy; they are read during the call only
        local_c = ffi.from_buffer("uint64_t[]", local.native()[1])
        remote_c = ffi.from_buffer("uint64_t[]", remote.native()[1])
        index_c = ffi.from_buffer("uint32_t[]", rkey_index)
        handles = ffi.new("ucp_rkey_h[]", rkeys)
        token = next(_tokens)

        def done(status: int) -> None:
            self._pending.pop(token, None)
            if future.done():
                return
            if status == UCS_OK:
                future.set_result(None)
            else:
                future.set_exception(UcpError("flush", status, worker.status_text(status)))

        _completions[token] = done
        self._pending[token] = future
        result = lib.kvp_rma_batch(self.ep, int(is_get), local_c, remote_c, index_c, handles, entries,
                                   ffi.cast("void *", token))
        if result <= 0:
            _completions.pop(token, None)
            done(int(result))
        # the fd reports incoming events only: progress what was posted now (completions only resolve
        # futures, whose callbacks run from the loop), not a loop pass later
        worker.kick()
        return future

    def close(self, force: bool = False) -> None:
        """Close the endpoint (bounded: a dead peer cannot hang us). Pending layers fail."""
        if self.closed:
            return
        self.closed = True
        worker = self.worker
        for rkey in self._rkeys:
            worker.lib.ucp_rkey_destroy(rkey)
        self._rkeys.clear()
        worker.lib.kvp_ep_close(worker.worker, self.ep, int(force and self.peer_error_mode))
        _ep_errors.pop(self._token, None)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(UcpError("rma", -1, "endpoint closed"))
        self._pending.clear()
        worker.endpoints.discard(self)
