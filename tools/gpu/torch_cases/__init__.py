"""The cases of tools/gpu/torch_suite.py: what PyTorch users do with the CUDA allocator, each checked against a
reference computed without the hazard (on the CPU, or before the hazard, synchronously).

Importing this module does not import PyTorch: every case receives a ``Context`` (``ctx.torch``, ``ctx.cuvmm``,
``ctx.device``, ``ctx.figures``) built in the case's process after the allocator was chosen. A case returns a
short detail on success, raises ``CaseFailure`` when a result differs from its reference, ``SkipCase`` when it
does not apply; any other exception is classified by ``torch_suite.classify_exception``.

This file is the framework (the registry, choosing the allocator, the context); the cases are in its modules,
imported at the end in the suite's order: ``streams``, ``graphs``, ``features``, ``programs``, ``pools``,
``stranded``.
"""

import os
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ALLOCATORS = ("native", "expandable", "cuvmm")
GIB = 1 << 30
MIB = 1 << 20
# torch.cuda._sleep's argument, in GPU cycles: about 35 ms at an H100's 1.98 GHz, long enough that the host
# queues everything after it (a free, an allocation, an overwrite) before the sleeping stream reads.
SLEEP_CYCLES = 1 << 26


class CaseFailure(AssertionError):
    """A result differed from its reference (status fail)."""


class SkipCase(Exception):
    """The case does not apply here (status skip)."""


def check(condition, message):
    if not condition:
        raise CaseFailure(message)


@dataclass(frozen=True)
class Case:
    name: str
    summary: str  # what it asserts, one line
    run: object  # run(ctx) -> detail
    timeout: float  # seconds, within the case's process
    fresh: bool = False  # in a process of its own (state it leaves, or an allocator setting of its own)
    prepare: object = None  # prepare(allocator): before the allocator is chosen (fresh cases only)
    allocators: tuple = field(default=ALLOCATORS)  # where it applies; elsewhere it is reported as skip


CASES = {}


def case(name, summary, timeout, fresh=False, prepare=None, allocators=ALLOCATORS):
    def register(function):
        if name in CASES:
            raise ValueError(f"case {name} registered twice")
        CASES[name] = Case(name, summary, function, timeout, fresh, prepare, tuple(allocators))
        return function

    return register


# --- choosing the allocator ------------------------------------------------------------------------------


def _without_expandable(conf):
    return ",".join(part for part in conf.split(",") if part and not part.strip().startswith("expandable_segments"))


def allocator_environment(allocator, environ, root=ROOT):
    """The environment variables to set for `allocator` (a dict: name -> value, or None to remove), given
    the current environment: expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF for `expandable` (and
    out of it for the others, so that a setting left in the shell does not make every column expandable);
    for `cuvmm`, CUVMM_TORCH_LIB defaults to libcuvmm_torch.so of the folder tools/gpu/build.sh filled."""
    conf = _without_expandable(environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    changes = {}
    if allocator == "expandable":
        changes["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
    elif "PYTORCH_CUDA_ALLOC_CONF" in environ:
        changes["PYTORCH_CUDA_ALLOC_CONF"] = conf or None
    if allocator == "cuvmm" and not environ.get("CUVMM_TORCH_LIB"):
        built = os.path.join(os.path.realpath(environ.get("GPU_BIN") or os.path.join(root, "gpu-bin")),
                             "libcuvmm_torch.so")
        if os.path.exists(built):
            changes["CUVMM_TORCH_LIB"] = built
    return changes


def setup_allocator(allocator):
    """Chooses `allocator` before PyTorch touches the GPU (as tools/train_gpt.py does); returns
    (torch, cuvmm_torch or None)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator}")
    for name, value in allocator_environment(allocator, os.environ).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    import torch  # noqa: PLC0415 (the suite's driver runs without PyTorch)

    cuvmm = None
    if allocator == "cuvmm":
        python = os.path.join(ROOT, "python")
        if python not in sys.path:
            sys.path.insert(0, python)
        import cuvmm_torch  # noqa: PLC0415

        cuvmm_torch.install()
        cuvmm = cuvmm_torch
    return torch, cuvmm


class Context:
    """What a case gets: the chosen allocator, PyTorch, cuvmm_torch (None unless cuvmm), the device, and
    ``figures``, a dict whose contents go into the case's result (also when it fails)."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.torch, self.cuvmm = setup_allocator(allocator)
        self.figures = {}
        if not self.torch.cuda.is_available():
            raise SkipCase("PyTorch sees no CUDA device")
        self.device = self.torch.device("cuda", 0)

    def empty_cache(self):
        """torch.cuda.empty_cache(), and with cuvmm also cuvmm_torch.empty_cache() (README: PyTorch may not
        forward the first to a pluggable allocator)."""
        self.torch.cuda.empty_cache()
        if self.cuvmm is not None:
            self.cuvmm.empty_cache(0)

    def max_reserved(self):
        if self.cuvmm is not None:
            return self.cuvmm.memory_stats(0)["reserved_bytes.all.peak"]
        return self.torch.cuda.max_memory_reserved(0)


def device_total_memory(index=0):
    """The device's memory in bytes, from the driver, without creating a context (so before PyTorch chose its
    allocator)."""
    import ctypes  # noqa: PLC0415

    cuda = ctypes.CDLL("libcuda.so.1")
    device, total = ctypes.c_int(), ctypes.c_size_t()
    for name, call in [("cuInit", lambda: cuda.cuInit(0)),
                       ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(device), index)),
                       ("cuDeviceTotalMem", lambda: cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device))]:
        if (status := call()) != 0:
            raise RuntimeError(f"{name} failed with CUDA error {status}")
    return total.value


def _max_diff(torch, got, reference):
    """The largest absolute difference between a GPU tensor and a reference on the CPU or the GPU (inf if shapes
    differ), computed on the CPU."""
    got = got.detach().float().cpu()
    if got.shape != reference.shape:
        return float("inf")
    diff = (got - reference.detach().float().cpu()).abs().max().item()
    return float("inf") if diff != diff else diff  # NaN: as far off as it gets


def _bounds(tensor):
    """(min, max) of a GPU tensor, on the host."""
    return tensor.min().item(), tensor.max().item()


# The largest absolute difference a CUDA graph's replay may have from the eager result.
TOLERANCE = 1e-3


def _warm_up(torch, functions):
    """Runs each function twice on a side stream, as PyTorch's CUDA graph documentation asks before capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for function in functions:
            for _ in range(2):
                function()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _first_line(error):
    return f"{type(error).__name__}: " + (str(error).strip().splitlines() or [""])[0][:240]


# The cases register themselves in CASES, in this order.
from . import streams, graphs, features, programs, pools, stranded  # noqa: E402, F401
