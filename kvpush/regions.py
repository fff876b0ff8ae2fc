"""Memory a cache is made of: user objects turned into checked regions, and page-aligned allocation.

No network I/O here. A region is one tensor's bytes: its address, its size and the object that keeps it
alive. Registration accepts raw int addresses (the caller keeps that memory alive and big enough), numpy
arrays, objects exposing ``__dlpack__`` (CPU torch tensors) or the buffer protocol /
``__array_interface__``; their size, dtype, contiguity and writability are checked against the
descriptor. Placement DEVICE on a host without an accelerator runtime is host memory (checked mapped).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .status import LLMException, LLMStatusCode, param_invalid
from .types import U64_MAX, CacheDesc, DataType, Placement

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_DLPACK_CPU = 1


@dataclass
class Region:
    """One tensor's bytes. ``view`` is a flat uint8 array over them whose base chain keeps the
    memory alive (numpy array, DLPack capsule, buffer, kvpush's own mapping), so views handed to
    users never dangle; for raw int addresses the caller keeps the memory alive."""

    address: int
    nbytes: int
    keepalive: object = field(repr=False)
    view: np.ndarray[Any, Any] | None = field(default=None, repr=False)

    def flat(self) -> np.ndarray[Any, Any]:
        return self.view if self.view is not None else _view_of_address(self.address, self.nbytes)


def _view_of_address(address: int, nbytes: int) -> np.ndarray[Any, Any]:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def _dtype_matches(actual: np.dtype[Any], data_type: DataType) -> bool:
    expected = data_type.numpy_dtype
    if actual == expected:
        return True
    if data_type == DataType.DT_BF16:
        return actual.itemsize == 2 and (actual.name == "bfloat16" or actual.kind in "iu")
    return False


def _torch_like_region(obj: Any, name: str, desc: CacheDesc) -> Region:
    """Objects DLPack cannot hand to numpy (e.g. torch bfloat16): use their own accessors."""
    try:
        contiguous = bool(obj.is_contiguous())
        address = int(obj.data_ptr())
        nbytes = int(obj.numel()) * int(obj.element_size())
        itemsize = int(obj.element_size())
    except (AttributeError, TypeError) as error:
        raise TypeError(f"{name}: cannot read memory of {type(obj).__name__}: {error}") from None
    if not contiguous:
        raise param_invalid(f"{name} is not contiguous")
    if itemsize != desc.data_type.itemsize:
        raise param_invalid(
            f"{name} has {itemsize}-byte elements, descriptor says {desc.data_type.name}"
        )
    return _checked(Region(address, nbytes, obj), name, desc)


def _checked(region: Region, name: str, desc: CacheDesc) -> Region:
    if region.address == 0:
        raise param_invalid(f"{name} has a zero address")
    if region.nbytes != desc.size:
        raise param_invalid(f"{name} holds {region.nbytes} bytes, descriptor needs {desc.size}")
    return region


_ACCELERATOR_RUNTIMES = ("libcuda.so", "libcudart.so", "libascendcl.so", "libamdhip64.so")
_device_noted = False


def _maps() -> list[tuple[int, int, str, str]]:
    """This process's mappings: (start, end, permissions, path) from /proc/self/maps."""
    rows = []
    try:
        with open("/proc/self/maps") as handle:
            for line in handle:
                fields = line.split(maxsplit=5)
                start, _, end = fields[0].partition("-")
                rows.append((int(start, 16), int(end, 16), fields[1], fields[5].strip() if len(fields) > 5 else ""))
    except OSError:
        pass
    return rows


def mapped_writable(address: int, nbytes: int) -> bool:
    """True when ``[address, address + nbytes)`` is mapped readable and writable in this process."""
    position, end = address, address + nbytes
    for start, stop, perms, _ in sorted(_maps()):
        if stop <= position or start > position:
            continue
        if not (perms.startswith("rw")):
            return False
        position = stop
        if position >= end:
            return True
    return position >= end


def accelerator_runtime() -> str | None:
    """The accelerator runtime library loaded in this process, if any (then DEVICE means device memory)."""
    for _, _, _, path in _maps():
        name = os.path.basename(path)
        if any(name.startswith(runtime) for runtime in _ACCELERATOR_RUNTIMES):
            return name
    return None


def check_placement(desc: CacheDesc, regions: list[Region]) -> None:
    """DEVICE placement on a host without an accelerator runtime is host memory (LLM-DataDist's
    samples register their NPU tensors as DEVICE; on a CPU host those are host tensors): accepted once
    every tensor is verified to be mapped, writable host memory of this process; the cache keeps the
    placement the program gave. With a runtime loaded it really is device memory, which no transport
    here reaches yet (LLM_FEATURE_NOT_ENABLED)."""
    global _device_noted
    if desc.placement != Placement.DEVICE:
        return
    runtime = accelerator_runtime()
    if runtime is not None:
        raise LLMException(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                           f"placement DEVICE with {runtime} loaded: device memory needs a GPU-capable transport, "
                           f"which kvpush does not have yet")
    for index, region in enumerate(regions):
        if not mapped_writable(region.address, region.nbytes):
            raise param_invalid(f"addrs[{index}]=0x{region.address:x} ({region.nbytes} bytes) is not mapped, "
                                f"writable host memory of this process (placement DEVICE on a host without an "
                                f"accelerator runtime means host memory)")
    if not _device_noted:
        _device_noted = True
        log.info("placement DEVICE: no accelerator runtime in this process, so DEVICE caches are host memory "
                 "(verified mapped); they are registered as such and keep the placement they were given")


def region_of(obj: object, name: str, desc: CacheDesc) -> Region:
    """One tensor's memory, checked against ``desc``. Raises TypeError / ValueError /
    LLMException(LLM_PARAM_INVALID or LLM_FEATURE_NOT_ENABLED)."""
    if isinstance(obj, bool):
        raise TypeError(f"{name} must be an int address or a tensor/array, got bool")
    if isinstance(obj, (int, np.integer)):
        return _address_region(int(obj), name, desc)
    array: np.ndarray[Any, Any]
    if hasattr(obj, "__dlpack__") and not isinstance(obj, np.ndarray):
        device = getattr(obj, "__dlpack_device__", lambda: (_DLPACK_CPU, 0))()
        if int(device[0]) != _DLPACK_CPU:
            raise LLMException(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                f"{name} lives on device type {device[0]}; this host's transports reach host memory only",
            )
        try:
            array = np.from_dlpack(obj)
        except (TypeError, RuntimeError, BufferError, ValueError):
            return _torch_like_region(obj, name, desc)
        keepalive: object = (obj, array)
    elif isinstance(obj, np.ndarray):
        array, keepalive = obj, obj
    elif hasattr(obj, "__array_interface__"):
        array = np.asarray(obj)
        keepalive = (obj, array)
    else:
        array, keepalive = _buffer_array(obj, name)
    return _array_region(array, keepalive, name, desc)


def _address_region(address: int, name: str, desc: CacheDesc) -> Region:
    """A raw address: the caller keeps the memory alive; it must be mapped and writable here now."""
    if address < 0 or address > U64_MAX:
        raise ValueError(f"{name}={address} is not a valid address")
    region = _checked(Region(address, desc.size, None), name, desc)
    if not mapped_writable(address, desc.size):  # a wrong address is an error here, never a crash later
        raise param_invalid(f"{name}=0x{address:x} ({desc.size} bytes) is not mapped, writable memory of "
                            f"this process")
    return region


def _buffer_array(obj: object, name: str) -> tuple[np.ndarray[Any, Any], object]:
    """An object with the buffer protocol, as bytes (and what keeps it alive)."""
    try:
        buffer = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{name} must be an int address or expose __dlpack__, __array_interface__ or "
            f"the buffer protocol; got {type(obj).__name__}"
        ) from None
    if not buffer.c_contiguous:
        raise param_invalid(f"{name} is not contiguous")
    array = np.frombuffer(buffer, np.uint8) if buffer.nbytes else np.zeros(0, np.uint8)
    if buffer.readonly:
        raise param_invalid(f"{name} is read-only; registered memory must be writable")
    return array, (obj, buffer)


def _array_region(array: np.ndarray[Any, Any], keepalive: object, name: str, desc: CacheDesc) -> Region:
    if not array.flags.c_contiguous:
        raise param_invalid(f"{name} is not C-contiguous")
    if not array.flags.writeable:
        raise param_invalid(f"{name} is read-only; registered memory must be writable")
    raw_bytes = array.dtype == np.uint8 and desc.data_type != DataType.DT_UINT8
    if not raw_bytes and not _dtype_matches(array.dtype, desc.data_type):
        raise param_invalid(f"{name} has dtype {array.dtype}, descriptor says {desc.data_type.name}")
    address = int(array.__array_interface__["data"][0]) if array.nbytes else 0
    return _checked(Region(address, int(array.nbytes), keepalive, array.reshape(-1).view(np.uint8)), name, desc)


_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without changing their contents


def prefault(address: int, nbytes: int) -> bool:
    """Fault in registered memory so the first transfer into it does not pay page faults. Memory a
    caller hands us may be untouched (numpy.zeros is lazily mapped); contents never change."""
    start = address // PAGE * PAGE
    end = -(-(address + nbytes) // PAGE) * PAGE
    return bool(nbytes) and _madvise(start, end - start, _MADV_POPULATE_WRITE) == 0


def allocate_regions(desc: CacheDesc) -> tuple[mmap.mmap, list[Region]]:
    """One page-aligned, prefaulted anonymous mapping holding every tensor at a page boundary,
    backed by transparent huge pages where the kernel allows (fewer page pins and TLB misses for
    one-sided copies)."""
    stride = -(-desc.size // PAGE) * PAGE
    total = max(stride * desc.num_tensors, PAGE)
    try:
        mapping = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError) as error:
        raise LLMException(LLMStatusCode.LLM_OUT_OF_MEMORY, f"cannot allocate {total} bytes: {error}") from None
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(mapping, np.uint8)
    whole[::PAGE] = 0  # prefault: the first transfer must not pay page faults
    regions = []
    for index in range(desc.num_tensors):
        view = whole[index * stride:index * stride + desc.size]
        regions.append(Region(int(view.__array_interface__["data"][0]), desc.size, mapping, view))
    return mapping, regions
