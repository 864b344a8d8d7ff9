"""cuvmm as PyTorch's CUDA allocator, and cuvmm's statistics from Python.

No line at all: ``python -m cuvmm_torch SCRIPT.py ARGS...`` (see ``__main__.py``; ``CUVMM_TORCH_AUTOINSTALL=1``
for programs started otherwise, see ``autoinstall.py``), or one line, before the first CUDA allocation::

    import cuvmm_torch
    cuvmm_torch.install()
    ...                          # the training script, unchanged

``install()`` puts cuvmm in place through its C++ layer (``cuvmm-torch/csrc``), built against the installed
PyTorch on first use and cached (see :func:`build_dir`; ``python3 -m cuvmm_torch build`` builds it ahead
of time). PyTorch's own ``torch.cuda.memory_stats()``, ``max_memory_reserved()``,
``memory_summary()``, ``memory._snapshot()``, ``empty_cache()``, ``set_per_process_memory_fraction()``,
``Tensor.record_stream`` and CUDA graphs then reach cuvmm, and out-of-memory is ``torch.OutOfMemoryError``
with cuvmm's diagnosis.

If the C++ layer cannot be built or loaded (no compiler, ``ninja`` or CUDA runtime headers;
``CUVMM_TORCH_CPP=0``), it falls back to ``torch.cuda.memory.CUDAPluggableAllocator`` through ctypes, with a
warning naming what that path lacks (:data:`FALLBACK_LACKS`); ``memory_stats``, ``memory_summary``,
``dump_snapshot``, ``record_stream`` and the others here answer instead, with PyTorch's key names, on either
path.

Sleep and wake: ``region``, ``sleep``, ``wake``, ``prepare_sleep``, ``release_host_buffers``, ``read_kept``
and ``tags`` here;
torch_memory_saver's API in :mod:`cuvmm_torch.memory_saver` and vLLM's ``CuMemAllocator`` in
:mod:`cuvmm_torch.cumem`, over the same tags, for code that switches by changing its import.

The library is found, in order: the ``path`` given to :func:`load` or :func:`install`; the
``CUVMM_TORCH_LIB`` environment variable; ``libcuvmm_torch.so`` in this package's folder (an installed
copy); ``target/release`` of the checkout this package is in. The library reads its settings from the environment on first use
(``CUVMM_BACKEND``, ``CUVMM_ALLOC_CONF``, ... : see ``cuvmm-torch/cuvmm_torch.h``).
"""

import contextlib
import ctypes
import glob
import importlib
import json
import operator
import os
import shutil
import sys
import sysconfig
import threading
import time
import warnings

__all__ = [
    "CuvmmError",
    "library_path",
    "load",
    "install",
    "active_layer",
    "build_extension",
    "ninja_on_path",
    "cuda_runtime",
    "build_dir",
    "csrc_dir",
    "FALLBACK_LACKS",
    "memory_stats",
    "memory_summary",
    "empty_cache",
    "release_stranded",
    "dump_snapshot",
    "record_stream",
    "reset_peak_stats",
    "reset_accumulated_stats",
    "set_memory_fraction",
    "set_device_margin",
    "record_history",
    "region",
    "sleep",
    "wake",
    "prepare_sleep",
    "release_host_buffers",
    "read_kept",
    "tags",
    "last_error",
]

LIBRARY_NAME = "libcuvmm_torch.so"
ENV_VAR = "CUVMM_TORCH_LIB"
# "0" turns the C++ layer off (install() takes the ctypes path); "1" makes a failure to build it an error.
CPP_ENV_VAR = "CUVMM_TORCH_CPP"
# Where the C++ layer is built and cached (default: $XDG_CACHE_HOME/cuvmm_torch/torch-<version>-<python>).
BUILD_ENV_VAR = "CUVMM_TORCH_BUILD"
EXTENSION_NAME = "cuvmm_torch_ext"
EXTENSION_SOURCES = ["cuvmm_allocator.cpp"]
# The headers a CUDA runtime's include directory must hold for the layer to compile.
RUNTIME_API_HEADER = "cuda_runtime_api.h"
CRT_HEADER = ("crt", "host_config.h")
# The libraries this process has loaded, where cuda_runtime() finds PyTorch's libcudart.
PROCESS_MAPS = "/proc/self/maps"

# What PyTorch does not pass to an allocator plugged in through CUDAPluggableAllocator from Python.
FALLBACK_LACKS = (
    "Tensor.record_stream (call cuvmm_torch.record_stream), "
    "torch.cuda.memory_stats / max_memory_reserved / memory_summary / memory._snapshot "
    "(use cuvmm_torch.memory_stats / memory_summary / dump_snapshot), "
    "torch.cuda.empty_cache and set_per_process_memory_fraction (use cuvmm_torch.empty_cache / "
    "set_memory_fraction), CUDA graphs and torch.compile(mode=\"reduce-overhead\"), "
    "torch.OutOfMemoryError on out-of-memory (PyTorch reports a tensor without data instead), "
    "sharing CUDA tensors with torch.multiprocessing"
)

_HERE = os.path.dirname(os.path.abspath(__file__))
# The checkout this package is in (python/cuvmm_torch/ of it), for a library and sources not installed.
_CHECKOUT = os.path.dirname(os.path.dirname(_HERE))
_lib = None
_layer = None


class CuvmmError(RuntimeError):
    """A cuvmm call failed; the message is the library's ``cuvmm_last_error()``."""


def library_path(path=None):
    """The library file to load: ``path``, else ``$CUVMM_TORCH_LIB``, else in this package's folder, else
    ``target/release`` of this checkout."""
    if path:
        return os.fspath(path)
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    candidates = [
        os.path.join(_HERE, LIBRARY_NAME),
        os.path.join(_CHECKOUT, "target", "release", LIBRARY_NAME),
    ]
    for candidate in candidates:
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(
        f"{LIBRARY_NAME} not found (looked at {', '.join(candidates)}); build it with "
        f"`cargo build --release -p cuvmm-torch`, or pass its path / set {ENV_VAR}"
    )


def csrc_dir():
    """The C++ layer's sources: ``csrc`` in this package's folder (an installed copy), else
    ``cuvmm-torch/csrc`` of this checkout. Its parent holds ``cuvmm_torch.h``."""
    candidates = [os.path.join(_HERE, "csrc"), os.path.join(_CHECKOUT, "cuvmm-torch", "csrc")]
    for candidate in candidates:
        if all(os.path.exists(os.path.join(candidate, source)) for source in EXTENSION_SOURCES):
            return candidate
    raise FileNotFoundError(f"the C++ layer's sources are not at {' or '.join(candidates)}")


def build_dir(torch_version, environ=None):
    """Where the C++ layer for PyTorch ``torch_version`` is built and cached: ``$CUVMM_TORCH_BUILD``, else
    ``$XDG_CACHE_HOME/cuvmm_torch/torch-<version>-<python>`` (``~/.cache`` without XDG_CACHE_HOME; python
    as ``cpython-311``). One directory per PyTorch version, since the layer is compiled against its headers,
    and per Python, since it is a module of one Python's ABI (two environments with the same PyTorch on two
    Pythons share ``~/.cache``)."""
    environ = os.environ if environ is None else environ
    if environ.get(BUILD_ENV_VAR):
        return environ[BUILD_ENV_VAR]
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    python = sys.implementation.cache_tag or sys.implementation.name
    safe = "".join(c if c.isalnum() or c in ".-_" else "_" for c in f"{torch_version}-{python}")
    return os.path.join(cache, "cuvmm_torch", f"torch-{safe}")


def _cpp_setting(environ=None):
    """``CUVMM_TORCH_CPP``: False for "0", True for "1", None (try it, fall back) otherwise."""
    value = (os.environ if environ is None else environ).get(CPP_ENV_VAR, "").strip()
    return {"0": False, "1": True}.get(value)


def _summary(error):
    """An exception in one line: its type and the last line of its message (a compiler's log is long)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1].strip()}" if lines else type(error).__name__


def fallback_warning(reason):
    """The warning install() gives when it takes the ctypes path."""
    return (
        f"cuvmm_torch: the C++ layer is not in use ({reason}); cuvmm is installed through "
        f"CUDAPluggableAllocator, which lacks: {FALLBACK_LACKS}. "
        f"Set {CPP_ENV_VAR}=1 to make this an error."
    )


def _headers_complete(include):
    """Whether ``include`` holds what ``cuda_runtime.h`` needs: the API header and ``crt/host_config.h``."""
    return all(os.path.exists(os.path.join(include, *h)) for h in ((RUNTIME_API_HEADER,), CRT_HEADER))


def _crt_beside(library, cuda_home):
    """A directory holding ``crt/host_config.h`` for PyTorch's runtime at ``library`` whose own headers lack it
    (pip's runtime package has no ``crt/``; its compiler package, or a toolkit, has): the toolkit at
    ``cuda_home``, else any other ``include`` directory of the packages beside the library's, or None."""
    packages = os.path.dirname(os.path.dirname(os.path.dirname(library)))
    candidates = [os.path.join(cuda_home, "include")] if cuda_home else []
    candidates += sorted(glob.glob(os.path.join(packages, "*", "include")))
    candidates += sorted(glob.glob(os.path.join(packages, "*", "*", "include")))
    return next((c for c in candidates if os.path.exists(os.path.join(c, *CRT_HEADER))), None)


def cuda_runtime(maps=None, cuda_home=None):
    """The CUDA runtime to build the C++ layer against: ``([include directories], [linker flags])``.

    First the ``libcudart`` PyTorch itself loaded (read from ``maps``, after ``import torch``) with the
    headers installed beside it: pip's ``nvidia`` packages and the CUDA toolkit both put ``include/`` beside
    the library's directory. So the layer uses PyTorch's own runtime, and needs no CUDA toolkit where PyTorch's
    wheel brings the headers. pip's runtime package may lack ``crt/host_config.h``, which ``cuda_runtime.h``
    includes: then it comes from the toolkit at ``cuda_home`` or another package beside it, after PyTorch's
    own headers. Else the toolkit at ``cuda_home`` (``CUDA_HOME``, or where ``nvcc`` is, as
    ``torch.utils.cpp_extension`` finds it). Raises ``RuntimeError`` naming what is missing when neither has
    the headers. ``maps`` defaults to :data:`PROCESS_MAPS`."""
    try:
        with open(maps or PROCESS_MAPS, encoding="utf-8", errors="replace") as lines:
            loaded = sorted({line.split()[-1] for line in lines if "/libcudart.so" in line})
    except OSError:
        loaded = []
    lacking = []
    for library in loaded:
        include = os.path.join(os.path.dirname(os.path.dirname(library)), "include")
        if _headers_complete(include):
            return [include], [library]
        if os.path.exists(os.path.join(include, RUNTIME_API_HEADER)):
            crt = _crt_beside(library, cuda_home)
            if crt:
                return [include, crt], [library]
            lacking.append(f"{include} has no {'/'.join(CRT_HEADER)}")
    toolkit = os.path.join(cuda_home, "include") if cuda_home else None
    if toolkit and _headers_complete(toolkit):
        libraries = [os.path.join(cuda_home, sub) for sub in ("lib64", "lib")]
        return [toolkit], [f"-L{d}" for d in libraries if os.path.isdir(d)] + ["-lcudart"]
    raise RuntimeError(
        f"no complete CUDA runtime headers ({RUNTIME_API_HEADER} and {'/'.join(CRT_HEADER)}) beside PyTorch's "
        f"libcudart ({', '.join(loaded) or 'none loaded'}{'; ' if lacking else ''}{'; '.join(lacking)}) nor in a "
        f"CUDA toolkit ({toolkit or 'none found'}): install one, or set CUDA_HOME"
    )


def ninja_on_path(environ=None):
    """Makes sure ``ninja``, which ``torch.utils.cpp_extension`` runs by name, is on ``PATH``: where it is
    not, the directory of the one the ``ninja`` package installed (a dependency of this package's wheel,
    in the environment's ``bin/``, which is on ``PATH`` only when the environment is activated) is added at
    its end. Returns the ninja found, or None."""
    environ = os.environ if environ is None else environ
    found = shutil.which("ninja", path=environ.get("PATH"))
    if found:
        return found
    directories = [sysconfig.get_path("scripts")]
    try:
        import ninja  # noqa: PLC0415 (the pip package; optional)

        directories.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for directory in directories:
        found = shutil.which("ninja", path=directory)
        if found:
            path = environ.get("PATH")
            environ["PATH"] = f"{path}{os.pathsep}{directory}" if path else directory
            return found
    return None


def build_extension(torch=None, verbose=False):
    """Builds (or finds cached) the C++ layer against the installed PyTorch and imports it.

    Built as a C++ extension (``torch.utils.cpp_extension``, which needs ``ninja``: see :func:`ninja_on_path`)
    linked to PyTorch's CUDA libraries and the runtime :func:`cuda_runtime` finds; the layer has no CUDA
    kernels, so no ``nvcc`` and no GPU are needed to build it."""
    if torch is None:
        import torch  # noqa: PLC0415 (the rest of this module works without PyTorch)
    cpp_extension = importlib.import_module("torch.utils.cpp_extension")
    ninja_on_path()
    sources_dir = csrc_dir()
    cuda_includes, cudart = cuda_runtime(cuda_home=cpp_extension.CUDA_HOME)
    directory = build_dir(torch.__version__)
    os.makedirs(directory, exist_ok=True)
    _remove_stale_lock(directory)
    return cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[os.path.join(sources_dir, source) for source in EXTENSION_SOURCES],
        extra_include_paths=[os.path.dirname(sources_dir), *cuda_includes],
        extra_cflags=["-O2"],
        extra_ldflags=["-ldl", "-lc10_cuda", "-ltorch_cuda", *cudart],
        build_directory=directory,
        with_cuda=False,
        verbose=verbose,
    )


# The file torch.utils.cpp_extension holds while it builds in a directory (even a cached build takes it, to run
# ninja), and every other process waits on, with no end, while it exists.
BUILD_LOCK = "lock"
# A lock older than this was left by a build that died (a rank killed while building): the layer builds in
# about 30 s.
STALE_LOCK_SECONDS = 600


def _remove_stale_lock(directory, now=None):
    """Removes ``directory``'s build lock if a build that did not finish left it there long ago, so that a
    killed process does not make every later ``install()`` wait forever; says so in a warning. Returns
    whether it removed one."""
    lock = os.path.join(directory, BUILD_LOCK)
    try:
        age = (time.time() if now is None else now) - os.path.getmtime(lock)
    except OSError:
        return False  # no lock: nothing to wait for
    if age < STALE_LOCK_SECONDS:
        return False  # another process may be building now
    with contextlib.suppress(FileNotFoundError):
        os.remove(lock)
    warnings.warn(f"cuvmm_torch: removed {lock}, left {age / 60:.0f} minutes ago by a build of the C++ layer "
                  "that did not finish (a process killed while building it)", RuntimeWarning, stacklevel=3)
    return True


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
        "cuvmm_release_stranded": (ctypes.c_longlong, [c_int]),
        "cuvmm_dump_snapshot": (c_int, [c_int, c_char_p]),
        "cuvmm_last_error": (c_char_p, []),
        "cuvmm_free_any": (None, [c_void_p]),
        "cuvmm_reset_peak_stats": (c_int, [c_int]),
        "cuvmm_reset_accumulated_stats": (c_int, [c_int]),
        "cuvmm_set_memory_fraction": (c_int, [c_int, ctypes.c_double]),
        "cuvmm_set_device_margin": (c_int, [ctypes.c_ulonglong]),
        "cuvmm_memory_fraction": (ctypes.c_double, [c_int]),
        "cuvmm_record_history": (c_int, [c_int, ctypes.c_size_t]),
        "cuvmm_set_tag": (c_int, [c_char_p]),
        "cuvmm_sleep": (ctypes.c_longlong, [c_int, c_char_p, c_int]),
        "cuvmm_wake": (c_int, [c_int, c_char_p]),
        "cuvmm_prepare_sleep": (ctypes.c_longlong, [c_int, c_char_p]),
        "cuvmm_release_host_buffers": (ctypes.c_longlong, [c_int, c_char_p]),
        "cuvmm_read_kept": (c_int, [c_int, c_void_p, c_void_p, ctypes.c_size_t]),
        "cuvmm_tags_json": (c_void_p, [c_int]),
        "cuvmm_device_count": (c_int, []),
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


def _current_device():
    try:
        import torch  # noqa: PLC0415 (optional: only to read the current device)
    except ImportError:
        return 0
    # Without CUDA (the simulated backend on a machine with no GPU) there is no current device to ask:
    # current_device() would raise.
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _device_index(device):
    """A device as ``torch.cuda``'s calls take it: None, ``"cuda"`` or ``torch.device("cuda")`` (the current
    device), ``"cuda:1"``, ``torch.device("cuda", 1)`` or 1."""
    if isinstance(device, str):
        kind, _, number = device.partition(":")
        if kind != "cuda" or (number and not number.isdigit()):
            raise ValueError(f"device: {device!r} is not a CUDA device (\"cuda\", \"cuda:N\" or N)")
        device = int(number) if number else None
    elif getattr(device, "type", "cuda") != "cuda":
        raise ValueError(f"device: {device!r} is not a CUDA device")
    index = getattr(device, "index", device)
    if index is None:
        return _current_device()
    try:
        return operator.index(index)
    except TypeError:
        raise TypeError(f"device: {device!r} is not a device number, \"cuda:N\" or a torch.device") from None


def _tag_bytes(tag, what):
    """A tag's name as the library takes it; a name that is not a string, or holds a NUL (which would end it
    early: two names would be one tag), is refused here, in words."""
    if not isinstance(tag, str):
        raise TypeError(f"{what}: the tag must be a string, not {tag!r}")
    if "\0" in tag:
        raise ValueError(f"{what}: the tag must not contain a NUL character: {tag!r}")
    return tag.encode("utf-8")


def _stream_handle(stream):
    """A raw CUstream: an int, None (the legacy default stream), or a torch.cuda.Stream."""
    if stream is None:
        return None
    return int(getattr(stream, "cuda_stream", stream)) or None


def install(path=None, cpp=None):
    """Makes cuvmm PyTorch's CUDA allocator. Call it before the first CUDA allocation (PyTorch refuses to
    swap an allocator that has been used). Returns the layer now in place: ``"cpp"`` or ``"ctypes"``.
    Installed already (by ``python -m cuvmm_torch``, ``CUVMM_TORCH_AUTOINSTALL=1`` or an earlier call), it
    returns the layer in place and changes nothing.

    ``cpp``: True requires the C++ layer, False takes the ctypes path, None (the default, or
    ``CUVMM_TORCH_CPP``) tries the C++ layer and falls back with a warning."""
    global _layer
    import torch  # noqa: PLC0415 (the rest of this module works without PyTorch)

    # After the import: with CUVMM_TORCH_AUTOINSTALL=1, importing torch may have installed cuvmm.
    if _layer is not None:
        return _layer
    library = library_path(path)
    load(library)
    if cpp is None:
        cpp = _cpp_setting()
    if cpp is not False:
        try:
            build_extension(torch).install(library)
            _layer = "cpp"
            return _layer
        except Exception as error:  # noqa: BLE001 (any failure to build or load means: fall back)
            _refuse_if_too_late(error)
            if cpp:
                raise
            reason = _summary(error)
    else:
        reason = f"{CPP_ENV_VAR}=0"
    allocator = torch.cuda.memory.CUDAPluggableAllocator(library, "cuvmm_malloc", "cuvmm_free")
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except Exception as error:  # noqa: BLE001 (re-raised, in words, if it is the swap refused)
        _refuse_if_too_late(error)
        raise
    warnings.warn(fallback_warning(reason), RuntimeWarning, stacklevel=2)
    _layer = "ctypes"
    return _layer


# PyTorch's refusal to swap its CUDA allocator once used (CUDAPluggableAllocator::changeCurrentAllocator),
# which both layers meet: no reason to fall back from one to the other.
_SWAP_REFUSED = "already initialized allocator"


def _refuse_if_too_late(error):
    """Raises the error a user can act on when ``error`` is PyTorch refusing the swap; returns otherwise."""
    if _SWAP_REFUSED in str(error):
        raise RuntimeError(
            "cuvmm_torch.install() came too late: PyTorch's own CUDA allocator is initialized already (a CUDA "
            "call ran before install(): a tensor on the GPU, torch.cuda.set_device, torch.cuda.init, ...), and "
            "PyTorch swaps no allocator once it is. Call install() before the program's first CUDA call, or run "
            "the program under `python -m cuvmm_torch`"
        ) from error


def active_layer():
    """The layer install() put in place: ``"cpp"``, ``"ctypes"``, or None before install()."""
    return _layer


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


def release_stranded(device=None):
    """Gives back the idle pages stranded in 20 MiB handles that live tensors still touch (the out-of-memory
    message names them): each such handle's live part is re-created as single pages at the same addresses,
    its bytes moved through host memory after one device synchronization. Call it where no other thread
    launches work on the GPU until it returns, between training steps say; ``CUVMM_ALLOC_CONF=
    compaction:split`` does the same by itself whenever memory runs out. Returns the bytes given back."""
    freed = load().cuvmm_release_stranded(_device_index(device))
    if freed < 0:
        raise CuvmmError(last_error() or "cuvmm_release_stranded failed")
    return freed


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


def _check_status(status, what):
    if status != 0:
        raise CuvmmError(last_error() or f"{what} failed")


def reset_peak_stats(device=None):
    """``torch.cuda.reset_peak_memory_stats`` for cuvmm: every peak becomes the current value."""
    _check_status(load().cuvmm_reset_peak_stats(_device_index(device)), "cuvmm_reset_peak_stats")


def reset_accumulated_stats(device=None):
    """``torch.cuda.reset_accumulated_memory_stats`` for cuvmm: every cumulative count becomes 0."""
    _check_status(load().cuvmm_reset_accumulated_stats(_device_index(device)), "cuvmm_reset_accumulated_stats")


def set_memory_fraction(fraction, device=None):
    """``torch.cuda.set_per_process_memory_fraction`` for cuvmm: reserve at most ``fraction`` (0 to 1) of
    the device's memory from now on."""
    status = load().cuvmm_set_memory_fraction(_device_index(device), float(fraction))
    _check_status(status, "cuvmm_set_memory_fraction")


def set_device_margin(nbytes):
    """Keeps ``nbytes`` of every device free from now on (devices opened later too; 0: none), counting other
    processes' use: a request whose new memory would leave less is served from idle memory or fails with
    ``torch.OutOfMemoryError`` naming the margin. A wake is exempt. torch_memory_saver's
    ``memory_margin_bytes``; ``CUVMM_ALLOC_CONF=device_margin_mb:N`` sets it at start."""
    nbytes = operator.index(nbytes)
    if not 0 <= nbytes < 1 << 64:
        raise ValueError(f"set_device_margin: {nbytes} is not a number of bytes")
    _check_status(load().cuvmm_set_device_margin(nbytes), "cuvmm_set_device_margin")


def record_history(max_entries=100_000, device=None):
    """``torch.cuda.memory._record_memory_history`` for cuvmm: keep the last ``max_entries`` events for
    :func:`dump_snapshot`; 0 or None stops."""
    entries = operator.index(max_entries or 0)
    if entries < 0:
        raise ValueError(f"record_history: max_entries={max_entries} is negative (0 or None stops)")
    status = load().cuvmm_record_history(_device_index(device), entries)
    _check_status(status, "cuvmm_record_history")


_tags = threading.local()


@contextlib.contextmanager
def region(tag):
    """Allocations made on this thread inside ``with cuvmm_torch.region("kv_cache"):`` are made under the
    tag ``tag``: memory that :func:`sleep` gives back and :func:`wake` maps again at the same addresses, so
    tensors and CUDA graphs captured inside it (their private pool's memory) stay valid. Regions nest; the
    tag in force before is back on exit. ``region(None)`` makes allocations untagged inside it."""
    stack = getattr(_tags, "stack", None)
    if stack is None:
        stack = _tags.stack = []
    _check_status(load().cuvmm_set_tag(None if tag is None else _tag_bytes(tag, "region")), "cuvmm_set_tag")
    stack.append(tag)
    try:
        yield tag
    finally:
        stack.pop()
        previous = stack[-1] if stack else None
        _check_status(load().cuvmm_set_tag(None if previous is None else previous.encode("utf-8")),
                      "cuvmm_set_tag")


def sleep(tag, keep=True, device=None):
    """Puts the memory of ``tag`` to sleep: waits for the streams that used it, copies its bytes to host
    memory if ``keep`` (weights; a KV cache can pass ``keep=False``), then gives its physical memory back
    while its addresses stay reserved. Its tensors must not be used, nor graphs captured in it replayed,
    until :func:`wake`; a tensor dropped meanwhile is freed at once (its memory is free again at the wake). The bytes go to page-locked memory the tag keeps for its next sleep (see
    :func:`release_host_buffers`), copied on a stream of cuvmm's own while other threads go on allocating.
    Returns the bytes given back (0 if already asleep)."""
    given = load().cuvmm_sleep(_device_index(device), _tag_bytes(tag, "sleep"), int(bool(keep)))
    if given < 0:
        raise CuvmmError(last_error() or "cuvmm_sleep failed")
    return given


def wake(tag, device=None):
    """Wakes ``tag``: its memory is mapped again at the same addresses, with its bytes if they were kept."""
    _check_status(load().cuvmm_wake(_device_index(device), _tag_bytes(tag, "wake")), "cuvmm_wake")


def prepare_sleep(tag, device=None):
    """Pins now the page-locked host memory the next :func:`sleep` of ``tag`` with its bytes kept copies
    into, so that sleep pins nothing and runs at the link's speed from its first cycle (later sleeps reuse the
    memory anyway, unless :func:`release_host_buffers` frees it). Call it once the tag's memory is allocated,
    a model loaded, say, never during a CUDA graph capture. Other threads allocate meanwhile and the tag stays
    awake. Returns the bytes pinned: 0 for a tag asleep or never used, with nothing live or holding enough
    already, or being prepared by another thread. Raises :class:`CuvmmError` during a capture and where the
    host cannot pin the memory (what was pinned is kept)."""
    pinned = load().cuvmm_prepare_sleep(_device_index(device), _tag_bytes(tag, "prepare_sleep"))
    if pinned < 0:
        raise CuvmmError(last_error() or "cuvmm_prepare_sleep failed")
    return pinned


def release_host_buffers(tag=None, device=None):
    """Frees the page-locked host memory a tag keeps after its wake for its next sleep (``tag``'s, or every
    tag's with ``None``; ``CUVMM_ALLOC_CONF=keep_host_buffers:False`` frees it at each wake instead). The
    bytes of a sleeping tag are never freed. Returns the bytes freed; raises :class:`CuvmmError` for a tag
    being copied and during a CUDA graph capture."""
    name = None if tag is None else _tag_bytes(tag, "release_host_buffers")
    freed = load().cuvmm_release_host_buffers(_device_index(device), name)
    if freed < 0:
        raise CuvmmError(last_error() or "cuvmm_release_host_buffers failed")
    return freed


def read_kept(ptr, size, device=None):
    """The ``size`` bytes at device address ``ptr`` that a sleeping tag kept in host memory (what that memory
    holds again at the wake), as a new ``bytearray``, read without waking the tag; ``None`` for memory of no
    sleeping tag (awake, untagged, not cuvmm's): its bytes are on the device. Raises :class:`CuvmmError`
    where the tag slept without its bytes (``keep=False``), for a range beyond the allocation, and while
    another thread's sleep or wake copies them."""
    if size < 0:
        raise ValueError(f"size must be at least 0, not {size}")
    out = bytearray(size)
    buffer = (ctypes.c_char * size).from_buffer(out) if size else None
    found = _read_kept_into(_device_index(device), ptr, buffer, size)
    return out if found else None


def _read_kept_into(device, ptr, out, size):
    """``cuvmm_read_kept`` into ``out`` (an address or a ctypes buffer of ``size`` bytes): whether a
    sleeping tag's kept bytes were copied there."""
    status = load().cuvmm_read_kept(device, ptr, out, size)
    if status < 0:
        raise CuvmmError(last_error() or "cuvmm_read_kept failed")
    return status == 1


def _tag_devices(name):
    """The devices on which tag ``name`` has memory, awake or asleep: every device cuvmm serves is asked,
    and asking opens none that cuvmm never allocated on."""
    count = load().cuvmm_device_count()
    if count < 0:
        raise CuvmmError(last_error() or "cuvmm_device_count failed")
    return [device for device in range(count) if any(t["name"] == name for t in tags(device))]


def _each(calls):
    """Makes every call of ``calls`` (each a function of no arguments), then raises the first exception one
    raised: the frameworks' pause of every tag gives back what it can though one tag is refused (a capture
    underway, say), as theirs do."""
    first = None
    for call in calls:
        try:
            call()
        except Exception as error:  # noqa: BLE001 (re-raised below, after the other calls)
            first = first or error
    if first is not None:
        raise first


def _ensure_installed(api):
    """For the frameworks' APIs (:mod:`cuvmm_torch.memory_saver`, :mod:`cuvmm_torch.cumem`): in a program that
    has imported torch and has a GPU, cuvmm is installed as its CUDA allocator now if it is not yet, as those
    frameworks' own allocators need nothing more; if that fails, the error says so, rather than regions that
    tag nothing PyTorch allocates. (Without torch or a GPU, allocations come through the library's own
    functions.)"""
    torch = sys.modules.get("torch")
    if _layer is not None or torch is None or not torch.cuda.is_available():
        return  # installed; or nothing PyTorch allocates on a GPU to tag
    try:
        install()
    except Exception as error:  # noqa: BLE001 (whatever it is, the user is told, in one exception)
        raise CuvmmError(f"{api} over cuvmm needs cuvmm as PyTorch's CUDA allocator, and it could not be "
                         f"installed: {_summary(error)}") from error


def tags(device=None):
    """The device's tags: a list of dicts with ``name``, ``state`` (``awake``, ``asleep``, ``sleeping``: a
    sleep or wake failed half way, ``copying``: another thread's sleep or wake copies its bytes now),
    ``live_bytes``, ``asleep_bytes`` (what its wake maps), ``bytes_kept`` and ``host_kept_bytes``."""
    return json.loads(_take_string(load().cuvmm_tags_json(_device_index(device))))
