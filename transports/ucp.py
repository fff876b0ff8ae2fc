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

Building: the C part is compiled against the headers of the UCX actually loaded (cffi API mode), on
first use, into a cache directory (``KVPUSH_CACHE_DIR``, default ``~/.cache/kvpush``), keyed by the
UCX location and version and by this file's source, so struct layouts always match. It needs cffi and a C
compiler. Which UCX: the ``libucx-cu12`` wheel by default (``pip install 'kvpush[ucx]'``; no RDMA
verbs in it); set ``KVPUSH_UCX_PREFIX=/opt/ucx`` (a prefix with ``include/ucp/api/ucp.h`` and
``lib/libucp.so``) to use a system UCX built with verbs on an RDMA host.
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
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CDEF = """
typedef int... ucs_status_t;
static const int UCS_OK;
static const int UCS_ERR_BUSY;
typedef void *ucs_status_ptr_t;
typedef struct ucp_context *ucp_context_h;
typedef struct ucp_worker *ucp_worker_h;
typedef struct ucp_ep *ucp_ep_h;
typedef struct ucp_mem *ucp_mem_h;
typedef struct ucp_rkey *ucp_rkey_h;

const char *ucs_status_string(ucs_status_t status);
void ucp_get_version(unsigned *major_version, unsigned *minor_version, unsigned *release_number);
unsigned ucp_worker_progress(ucp_worker_h worker);
ucs_status_t ucp_worker_arm(ucp_worker_h worker);
ucs_status_t ucp_ep_rkey_unpack(ucp_ep_h ep, const void *rkey_buffer, ucp_rkey_h *rkey_p);
void ucp_rkey_destroy(ucp_rkey_h rkey);
ucs_status_t ucp_mem_unmap(ucp_context_h context, ucp_mem_h memh);
void ucp_worker_destroy(ucp_worker_h worker);
void ucp_cleanup(ucp_context_h context_p);

ucs_status_t kvp_open(int multi_thread, const char *tls, ucp_context_h *context, ucp_worker_h *worker, int *efd);
ucs_status_t kvp_worker_address(ucp_worker_h worker, char *out, size_t *length);
ucs_status_t kvp_ep_create(ucp_worker_h worker, const void *address, int peer_error_mode, void *arg,
                           ucp_ep_h *ep);
void kvp_ep_close(ucp_worker_h worker, ucp_ep_h ep, int force);
ucs_status_t kvp_mem_map(ucp_context_h context, void *address, size_t length, ucp_mem_h *memh);
ucs_status_t kvp_rkey_pack(ucp_context_h context, ucp_mem_h memh, char *out, size_t *length);
intptr_t kvp_rma_batch(ucp_ep_h ep, int is_get, const uint64_t *local_iov, const uint64_t *remote_iov,
                       const uint32_t *rkey_index, ucp_rkey_h *rkeys, size_t count, void *user_data);

extern "Python" void kvp_py_done(void *user_data, ucs_status_t status);
extern "Python" void kvp_py_ep_error(void *arg, ucs_status_t status);
"""

SOURCE = r"""
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <ucp/api/ucp.h>

static void kvp_py_done(void *user_data, ucs_status_t status);
static void kvp_py_ep_error(void *arg, ucs_status_t status);

static void kvp_flush_cb(void *request, ucs_status_t status, void *user_data) {
    kvp_py_done(user_data, status);
    ucp_request_free(request);
}

static void kvp_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    kvp_py_ep_error(arg, status);
}

static ucs_status_t kvp_open(int multi_thread, const char *tls, ucp_context_h *context, ucp_worker_h *worker,
                             int *efd) {
    ucp_config_t *config;
    ucs_status_t status = ucp_config_read(NULL, NULL, &config);
    if (status != UCS_OK) return status;
    if (tls != NULL) {  /* this context only: the process environment is left alone */
        status = ucp_config_modify(config, "TLS", tls);
        if (status != UCS_OK) { ucp_config_release(config); return status; }
    }
    ucp_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    status = ucp_init(&params, config, context);
    ucp_config_release(config);
    if (status != UCS_OK) return status;
    ucp_worker_params_t wparams;
    memset(&wparams, 0, sizeof(wparams));
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = multi_thread ? UCS_THREAD_MODE_MULTI : UCS_THREAD_MODE_SINGLE;
    status = ucp_worker_create(*context, &wparams, worker);
    if (status != UCS_OK) { ucp_cleanup(*context); return status; }
    status = ucp_worker_get_efd(*worker, efd);
    if (status != UCS_OK) { ucp_worker_destroy(*worker); ucp_cleanup(*context); }
    return status;
}

static ucs_status_t kvp_worker_address(ucp_worker_h worker, char *out, size_t *length) {
    ucp_address_t *address;
    size_t size;
    ucs_status_t status = ucp_worker_get_address(worker, &address, &size);
    if (status != UCS_OK) return status;
    if (size > *length) { ucp_worker_release_address(worker, address); return UCS_ERR_BUFFER_TOO_SMALL; }
    memcpy(out, address, size);
    *length = size;
    ucp_worker_release_address(worker, address);
    return UCS_OK;
}

static ucs_status_t kvp_ep_create(ucp_worker_h worker, const void *address, int peer_error_mode, void *arg,
                                  ucp_ep_h *ep) {
    ucp_ep_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = (const ucp_address_t *)address;
    params.err_mode = peer_error_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    params.err_handler.cb = kvp_err_cb;
    params.err_handler.arg = arg;
    return ucp_ep_create(worker, &params, ep);
}

/* Close without waiting for a peer that may be gone: progress for at most 200 ms. */
static void kvp_ep_close(ucp_worker_h worker, ucp_ep_h ep, int force) {
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
    if (request == NULL || UCS_PTR_IS_ERR(request)) return;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    while (ucp_request_check_status(request) == UCS_INPROGRESS) {
        ucp_worker_progress(worker);
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) * 1000000000L + (now.tv_nsec - start.tv_nsec) > 200000000L) break;
    }
    ucp_request_free(request);  /* done, or left to finish on its own */
}

static ucs_status_t kvp_mem_map(ucp_context_h context, void *address, size_t length, ucp_mem_h *memh) {
    ucp_mem_map_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = address;
    params.length = length;
    return ucp_mem_map(context, &params, memh);
}

static ucs_status_t kvp_rkey_pack(ucp_context_h context, ucp_mem_h memh, char *out, size_t *length) {
    void *buffer;
    size_t size;
    ucs_status_t status = ucp_rkey_pack(context, memh, &buffer, &size);
    if (status != UCS_OK) return status;
    if (size > *length) { ucp_rkey_buffer_release(buffer); return UCS_ERR_BUFFER_TOO_SMALL; }
    memcpy(out, buffer, size);
    *length = size;
    ucp_rkey_buffer_release(buffer);
    return UCS_OK;
}

/* One layer: a put (or get) per iovec entry, then one flush whose callback reports completion.
   Returns 0 when everything completed inline, a negative ucs_status_t on error, 1 when the flush
   callback will report. Put/get requests are released at once: the flush covers them. */
static intptr_t kvp_rma_batch(ucp_ep_h ep, int is_get, const uint64_t *local_iov, const uint64_t *remote_iov,
                              const uint32_t *rkey_index, ucp_rkey_h *rkeys, size_t count, void *user_data) {
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    for (size_t i = 0; i < count; i++) {
        void *local = (void *)(uintptr_t)local_iov[2 * i];
        size_t length = (size_t)local_iov[2 * i + 1];
        uint64_t remote = remote_iov[2 * i];
        ucp_rkey_h rkey = rkeys[rkey_index[i]];
        ucs_status_ptr_t request = is_get ? ucp_get_nbx(ep, local, length, remote, rkey, &param)
                                          : ucp_put_nbx(ep, local, length, remote, rkey, &param);
        if (UCS_PTR_IS_ERR(request)) return (intptr_t)UCS_PTR_STATUS(request);
        if (request != NULL) ucp_request_free(request);
    }
    ucp_request_param_t flush;
    memset(&flush, 0, sizeof(flush));
    flush.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    flush.cb.send = kvp_flush_cb;
    flush.user_data = user_data;
    ucs_status_ptr_t request = ucp_ep_flush_nbx(ep, &flush);
    if (request == NULL) return 0;
    if (UCS_PTR_IS_ERR(request)) return (intptr_t)UCS_PTR_STATUS(request);
    return 1;
}
"""

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
    key = hashlib.sha256("\0".join([CDEF, SOURCE, include, libdir, sys.version, cffi.__version__]).encode())
    name = f"_kvpush_ucp_{key.hexdigest()[:16]}"
    cache = os.path.join(os.environ.get("KVPUSH_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache",
                                                                         "kvpush")), name)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    module_path = os.path.join(cache, name + suffix)
    if not os.path.exists(module_path):
        os.makedirs(cache, exist_ok=True)
        builder = cffi.FFI()
        builder.cdef(CDEF)
        builder.set_source(name, SOURCE, include_dirs=[include], library_dirs=[libdir], libraries=["ucp", "ucs"],
                           extra_link_args=[f"-Wl,-rpath,{libdir}"])
        try:
            builder.compile(tmpdir=cache, verbose=False)
        except Exception as error:  # a missing compiler or headers: say so, never crash the engine
            raise UcpUnavailable(f"cannot build the UCX binding against {description}: {error}") from None
        log.info("built the UCX binding against %s in %s", description, cache)
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
        self._check("ucp_init", lib.kvp_open(int(multi_thread), tls_arg, context, worker, efd))
        self.context, self.worker, self.efd = context[0], worker[0], int(efd[0])
        self.loop = loop
        self.closed = False
        self._retry: asyncio.TimerHandle | None = None
        self.endpoints: set[Endpoint] = set()
        buffer = ffi.new("char[]", _ADDRESS_MAX)
        length = ffi.new("size_t *", _ADDRESS_MAX)
        self._check("ucp_worker_get_address", lib.kvp_worker_address(self.worker, buffer, length))
        self.address = bytes(ffi.buffer(buffer, length[0]))
        loop.add_reader(self.efd, self.kick)

    def _check(self, what: str, status: int) -> None:
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
        self._check("ucp_mem_map", lib.kvp_mem_map(self.context, ffi.cast("void *", address), length, memh))
        buffer = ffi.new("char[]", _RKEY_MAX)
        size = ffi.new("size_t *", _RKEY_MAX)
        try:
            self._check("ucp_rkey_pack", lib.kvp_rkey_pack(self.context, memh[0], buffer, size))
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
            worker._check("ucp_ep_create", lib.kvp_ep_create(worker.worker, address, int(peer_error_mode),
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
        self._on_error(f"UCX endpoint error: {self.worker.status_text(status)}")

    def unpack_rkey(self, packed: bytes) -> Any:
        ffi = self.worker.ffi
        rkey = ffi.new("ucp_rkey_h *")
        self.worker._check("ucp_ep_rkey_unpack", self.worker.lib.ucp_ep_rkey_unpack(self.ep, ffi.from_buffer(packed),
                                                                                     rkey))
        self._rkeys.append(rkey[0])
        return rkey[0]

    def rma(self, is_get: bool, local_iov: np.ndarray[Any, Any], remote_iov: np.ndarray[Any, Any],
            rkey_index: np.ndarray[Any, Any], rkeys: list[Any]) -> asyncio.Future[None]:
        """Post one layer (puts or gets of every entry, then a flush). The future resolves when UCX
        reports the flush complete: every byte is then in its destination."""
        worker = self.worker
        ffi, lib = worker.ffi, worker.lib
        future: asyncio.Future[None] = worker.loop.create_future()
        if self.closed:
            future.set_exception(UcpError("rma", -1, "endpoint closed"))
            return future
        local = np.ascontiguousarray(local_iov, np.uint64)
        remote = np.ascontiguousarray(remote_iov, np.uint64)
        index = np.ascontiguousarray(rkey_index, np.uint32)
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
        result = lib.kvp_rma_batch(self.ep, int(is_get), ffi.cast("const uint64_t *", local.ctypes.data),
                                   ffi.cast("const uint64_t *", remote.ctypes.data),
                                   ffi.cast("const uint32_t *", index.ctypes.data), handles, local.shape[0],
                                   ffi.cast("void *", token))
        if result <= 0:
            _completions.pop(token, None)
            done(int(result))
        worker.loop.call_soon(worker.kick)  # the fd reports incoming events only: progress what we posted
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
