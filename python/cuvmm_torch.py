"""cuvmm as PyTorch's CUDA allocator, and cuvmm's statistics from Python.

Pure Python (ctypes), no build step beyond ``cargo build --release -p cuvmm-torch``::

    import cuvmm_torch
    cuvmm_torch.install()        # before the first CUDA allocation
    ...                          # the training script, unchanged
    print(cuvmm_torch.memory_summary())

With a pluggable allocator in place, PyTorch's own ``torch.cuda.memory_stats()``, ``memory_summary()``
and ``memory._snapshot()`` no longer work; ``memory_stats``, ``memory_summary`` and ``dump_snapshot`` here
answer instead, with PyTorch's key names. ``torch.cuda.empty_cache()`` keeps working only if PyTorch
forwards it; ``empty_cache`` here always does.

The library is found, in order: the ``path`` given to :func:`load` or :func:`install`; the
``CUVMM_TORCH_LIB`` environment variable; ``libcuvmm_torch.so`` next to this file; ``target/release``
of the checkout this file is in. The library reads its settings from the environment on first use
(``CUVMM_BACKEND``, ``CUVMM_ALLOC_CONF``, ... : see ``cuvmm-torch/cuvmm_torch.h``).
"""

import ctypes
import json
import os

__all__ = [
    "CuvmmError",
    "library_path",
    "load",
    "install",
    "memory_stats",
    "memory_summary",
    "empty_cache",
    "dump_snapshot",
    "record_stream",
    "last_error",
]

LIBRARY_NAME = "libcuvmm_torch.so"
ENV_VAR = "CUVMM_TORCH_LIB"

_HERE = os.path.dirname(os.path.abspath(__file__))
_lib = None


class CuvmmError(RuntimeError):
    """A cuvmm call failed; the message is the library's ``cuvmm_last_error()``."""


def library_path(path=None):
    """The library file to load: ``path``, else ``$CUVMM_TORCH_LIB``, else next to this module, else
    ``target/release`` of this checkout."""
    if path:
        return os.fspath(path)
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    candidates = [
        os.path.join(_HERE, LIBRARY_NAME),
        os.path.join(os.path.dirname(_HERE), "target", "release", LIBRARY_NAME),
    ]
    for candidate in candidates:
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(
        f"{LIBRARY_NAME} not found (looked at {', '.join(candidates)}); build it with "
        f"`cargo build --release -p cuvmm-torch`, or pass its path / set {ENV_VAR}"
    )


def _declare(lib):
    c_char_p, c_int, c_void_p, c_ssize_t = ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_ssize_t
    signatures = {
        "cuvmm_malloc": (c_void_p, [c_ssize_t, c_int, c_void_p]),
        "cuvmm_free": (None, [c_void_p, c_ssize_t, c_int, c_void_p]),
        "cuvmm_record_stream": (None, [c_void_p, c_int, c_void_p]),
        # c_void_p, not c_char_p: the pointer must be handed back to cuvmm_string_free.
        "cuvmm_memory_stats_json": (c_void_p, [c_int]),
        "cuvmm_memory_summary": (c_void_p, [c_int]),
        "cuvmm_string_free": (None, [c_void_p]),
        "cuvmm_empty_cache": (None, [c_int]),
        "cuvmm_dump_snapshot": (c_int, [c_int, c_char_p]),
        "cuvmm_last_error": (c_char_p, []),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


def load(path=None):
    """Loads the library once (later calls return the same one) and declares its functions."""
    global _lib
    if _lib is None:
        _lib = _declare(ctypes.CDLL(library_path(path)))
    return _lib


def last_error():
    """The error of the last cuvmm call on this thread, or None."""
    message = load().cuvmm_last_error()
    return None if message is None else message.decode("utf-8", "replace")


def _check():
    message = last_error()
    if message is not None:
        raise CuvmmError(message)


def _take_string(pointer):
    if not pointer:
        raise CuvmmError(last_error() or "cuvmm returned no string")
    try:
        return ctypes.string_at(pointer).decode("utf-8")
    finally:
        load().cuvmm_string_free(pointer)


def _device_index(device):
    if device is None:
        try:
            import torch  # noqa: PLC0415 (optional: only to read the current device)
        except ImportError:
            return 0
        return torch.cuda.current_device()
    index = getattr(device, "index", device)
    return 0 if index is None else int(index)


def _stream_handle(stream):
    """A raw CUstream: an int, None (the legacy default stream), or a torch.cuda.Stream."""
    if stream is None:
        return None
    return int(getattr(stream, "cuda_stream", stream)) or None


def install(path=None):
    """Makes cuvmm PyTorch's CUDA allocator. Call it before the first CUDA allocation (PyTorch refuses to
    swap an allocator that has been used). Returns the ``CUDAPluggableAllocator``."""
    import torch  # noqa: PLC0415 (the rest of this module works without PyTorch)

    library = library_path(path)
    load(library)
    allocator = torch.cuda.memory.CUDAPluggableAllocator(library, "cuvmm_malloc", "cuvmm_free")
    torch.cuda.memory.change_current_allocator(allocator)
    return allocator


def memory_stats(device=None):
    """``torch.cuda.memory_stats(device)`` for cuvmm: a dict with PyTorch's keys
    (``allocated_bytes.all.current``, ``reserved_bytes.all.peak``, ``num_ooms``, ...) plus cuvmm's own
    (``cuvmm.*``)."""
    return json.loads(_take_string(load().cuvmm_memory_stats_json(_device_index(device))))


def memory_summary(device=None):
    """``torch.cuda.memory_summary(device)`` for cuvmm: PyTorch's table, with cuvmm's rows."""
    return _take_string(load().cuvmm_memory_summary(_device_index(device)))


def empty_cache(device=None):
    """Gives the device's cached memory back to the driver."""
    load().cuvmm_empty_cache(_device_index(device))
    _check()


def dump_snapshot(path, device=None):
    """Writes the device's segments and blocks to ``path`` as the pickle PyTorch's memory viewer reads
    (``torch.cuda.memory._dump_snapshot``)."""
    if load().cuvmm_dump_snapshot(_device_index(device), os.fsencode(path)) != 0:
        raise CuvmmError(last_error() or "cuvmm_dump_snapshot failed")


def record_stream(ptr, stream, device=None):
    """``Tensor.record_stream(stream)`` for cuvmm: ``ptr`` (an int, or a tensor: its ``data_ptr()``) is
    also used by work on ``stream``. PyTorch does not forward record_stream to a pluggable allocator, so a
    script that calls ``t.record_stream(s)`` should also call ``cuvmm_torch.record_stream(t, s)``."""
    if hasattr(ptr, "data_ptr"):
        if device is None:
            device = ptr.device
        ptr = ptr.data_ptr()
    load().cuvmm_record_stream(ptr, _device_index(device), _stream_handle(stream))
    _check()
