"""The CUDA runtime calls the GPU path needs, through ctypes.

We bind the ``libcudart`` that the process already uses (PyTorch's, from the
``nvidia-cuda-runtime-cu12`` wheel) when one is loaded, so streams and events are shared
with the framework's; otherwise we look in the same places a CUDA build of PyTorch would.
Handles (streams, events, device pointers) are plain ints.
"""
import ctypes
import ctypes.util
import glob
import importlib.util
import os
import threading
from typing import Dict, List, Optional

from aiak_training.common.gpu._loader import LazyLibrary

_VOIDP = ctypes.c_void_p
_SIZE = ctypes.c_size_t

MEMCPY_DEFAULT = 4          # cudaMemcpyDefault: direction inferred from the addresses (UVA)
STREAM_NON_BLOCKING = 1     # cudaStreamNonBlocking
EVENT_DISABLE_TIMING = 2    # cudaEventDisableTiming
ERROR_NOT_READY = 600       # cudaErrorNotReady

# name -> (argtypes); every function returns cudaError_t (int).
_SIGNATURES = {
    "cudaGetDeviceCount": [ctypes.POINTER(ctypes.c_int)],
    "cudaGetDevice": [ctypes.POINTER(ctypes.c_int)],
    "cudaSetDevice": [ctypes.c_int],
    "cudaDeviceGetPCIBusId": [ctypes.c_char_p, ctypes.c_int, ctypes.c_int],
    "cudaStreamCreateWithFlags": [ctypes.POINTER(_VOIDP), ctypes.c_uint],
    "cudaStreamDestroy": [_VOIDP],
    "cudaStreamSynchronize": [_VOIDP],
    "cudaStreamWaitEvent": [_VOIDP, _VOIDP, ctypes.c_uint],
    "cudaEventCreateWithFlags": [ctypes.POINTER(_VOIDP), ctypes.c_uint],
    "cudaEventDestroy": [_VOIDP],
    "cudaEventRecord": [_VOIDP, _VOIDP],
    "cudaEventQuery": [_VOIDP],
    "cudaEventSynchronize": [_VOIDP],
    "cudaMemcpyAsync": [_VOIDP, _VOIDP, _SIZE, ctypes.c_int, _VOIDP],
    "cudaMemsetAsync": [_VOIDP, ctypes.c_int, _SIZE, _VOIDP],
    "cudaMalloc": [ctypes.POINTER(_VOIDP), _SIZE],
    "cudaFree": [_VOIDP],
    "cudaHostAlloc": [ctypes.POINTER(_VOIDP), _SIZE, ctypes.c_uint],
    "cudaFreeHost": [_VOIDP],
    "cudaGetLastError": [],
}


class CudaError(RuntimeError):
    """A CUDA runtime call failed."""


def _loaded_libcudart() -> Optional[str]:
    """Path of a libcudart shared object already mapped into this process, if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart.so" in path and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


def library_candidates() -> List[str]:
    """Where libcudart may be, best first."""
    paths: List[str] = []
    loaded = _loaded_libcudart()
    if loaded:
        paths.append(loaded)
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
        if spec is not None and spec.submodule_search_locations:
            for base in spec.submodule_search_locations:
                paths += sorted(glob.glob(os.path.join(base, "lib", "libcudart.so*")))
    except (ImportError, ValueError):
        pass
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            paths += sorted(glob.glob(os.path.join(home, "lib64", "libcudart.so*")))
    found = ctypes.util.find_library("cudart")
    if found:
        paths.append(found)
    paths += ["libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
    return list(dict.fromkeys(paths))


class Runtime:
    """Checked wrappers over libcudart: each raises :class:`CudaError` naming the call."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.lib, self.path = lib, path
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._events: List[int] = []
        self._uses: Dict[int, int] = {}  # event -> puts still due, for shared events
        self._events_lock = threading.Lock()

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            text = self.lib.cudaGetErrorString(err).decode("utf-8", "replace")
            raise CudaError(f"{what} failed: {text} (cudaError {err})")

    # ---- devices ----------------------------------------------------------------------
    def device_count(self) -> int:
        n = ctypes.c_int(0)
        err = self.lib.cudaGetDeviceCount(ctypes.byref(n))
        if err != 0:
            self.lib.cudaGetLastError()  # "no device" is sticky otherwise
            return 0
        return n.value

    def set_device(self, device: int) -> None:
        self._check(self.lib.cudaSetDevice(device), f"cudaSetDevice({device})")

    def get_device(self) -> int:
        d = ctypes.c_int(0)
        self._check(self.lib.cudaGetDevice(ctypes.byref(d)), "cudaGetDevice")
        return d.value

    def pci_bus_id(self, device: int) -> str:
        buf = ctypes.create_string_buffer(64)
        self._check(self.lib.cudaDeviceGetPCIBusId(buf, 64, device),
                    f"cudaDeviceGetPCIBusId({device})")
        return buf.value.decode("ascii", "replace").lower()

    def device_uuid(self, device: int) -> str:
        """The GPU's UUID (the same GPU seen from two processes gives the same value), or its
        PCI bus id where the properties call is unavailable."""
        fn = getattr(self.lib, "cudaGetDeviceProperties_v2", None) or \
            getattr(self.lib, "cudaGetDeviceProperties", None)
        if fn is not None:
            # cudaDeviceProp starts with char name[256] and cudaUUID_t uuid (16 bytes) in every
            # CUDA >= 10; the buffer is larger than the whole struct of any version.
            props = ctypes.create_string_buffer(8192)
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
            if fn(props, device) == 0:
                return "GPU-" + props.raw[256:272].hex()
            self.lib.cudaGetLastError()
        return self.pci_bus_id(device)

    # ---- streams and events -----------------------------------------------------------
    def stream_create(self) -> int:
        s = _VOIDP()
        self._check(self.lib.cudaStreamCreateWithFlags(ctypes.byref(s), STREAM_NON_BLOCKING),
                    "cudaStreamCreateWithFlags")
        return int(s.value or 0)

    def stream_synchronize(self, stream: int) -> None:
        self._check(self.lib.cudaStreamSynchronize(_VOIDP(stream)), "cudaStreamSynchronize")

    def event_get(self) -> int:
        """An event from the pool (created without timing, which makes it cheap)."""
        with self._events_lock:
            if self._events:
                return self._events.pop()
        e = _VOIDP()
        self._check(self.lib.cudaEventCreateWithFlags(ctypes.byref(e), EVENT_DISABLE_TIMING),
                    "cudaEventCreateWithFlags")
        return int(e.value)

    def event_put(self, event: int, uses: int = 1) -> None:
        """Give back ``uses`` uses of an event; it returns to the pool with its last use.
        Safe right after a ``cudaStreamWaitEvent`` on it: a wait binds to the record that
        precedes it, not to later ones."""
        with self._events_lock:
            left = self._uses.pop(event, 1) - uses
            if left > 0:
                self._uses[event] = left
            else:
                self._events.append(event)

    def record(self, stream: int, uses: int = 1) -> int:
        """A pooled event recorded on ``stream`` now, for ``uses`` holders (one record
        shared by all the tensors of a call or of a fused response); each holder gives it
        back with :meth:`event_put`."""
        e = self.event_get()
        self._check(self.lib.cudaEventRecord(_VOIDP(e), _VOIDP(stream)), "cudaEventRecord")
        if uses > 1:
            with self._events_lock:
                self._uses[e] = uses
        return e

    def wait_event(self, stream: int, event: int) -> None:
        self._check(self.lib.cudaStreamWaitEvent(_VOIDP(stream), _VOIDP(event), 0),
                    "cudaStreamWaitEvent")

    def event_done(self, event: int) -> bool:
        err = self.lib.cudaEventQuery(_VOIDP(event))
        if err == ERROR_NOT_READY:
            return False
        self._check(err, "cudaEventQuery")
        return True

    def event_synchronize(self, event: int) -> None:
        self._check(self.lib.cudaEventSynchronize(_VOIDP(event)), "cudaEventSynchronize")

    # ---- memory -----------------------------------------------------------------------
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes:
            self._check(self.lib.cudaMemcpyAsync(_VOIDP(dst), _VOIDP(src), nbytes,
                                                 MEMCPY_DEFAULT, _VOIDP(stream)),
                        "cudaMemcpyAsync")

    def memset_async(self, dst: int, value: int, nbytes: int, stream: int) -> None:
        if nbytes:
            self._check(self.lib.cudaMemsetAsync(_VOIDP(dst), value, nbytes, _VOIDP(stream)),
                        "cudaMemsetAsync")

    def malloc(self, nbytes: int) -> int:
        p = _VOIDP()
        self._check(self.lib.cudaMalloc(ctypes.byref(p), max(1, nbytes)),
                    f"cudaMalloc({nbytes})")
        return int(p.value)

    def free(self, ptr: int) -> None:
        if ptr:
            self._check(self.lib.cudaFree(_VOIDP(ptr)), "cudaFree")

    def host_alloc(self, nbytes: int) -> int:
        """Pinned (page-locked) host memory: copies from and to it run asynchronously and at
        full PCIe/NVLink speed."""
        p = _VOIDP()
        self._check(self.lib.cudaHostAlloc(ctypes.byref(p), max(1, nbytes), 0),
                    f"cudaHostAlloc({nbytes})")
        return int(p.value)

    def free_host(self, ptr: int) -> None:
        if ptr:
            self._check(self.lib.cudaFreeHost(_VOIDP(ptr)), "cudaFreeHost")


_runtime = LazyLibrary(library_candidates, Runtime, (), lambda tried: CudaError(
    "the CUDA runtime library (libcudart) could not be loaded; install a CUDA build of "
    "PyTorch or nvidia-cuda-runtime-cu12. Tried: " + "; ".join(tried)))


def runtime() -> Runtime:
    """The process-wide :class:`Runtime`; raises :class:`CudaError` saying where it looked."""
    return _runtime.get()
