"""Tests of the C++ layer (``cuvmm-torch/csrc``) without a GPU: built against the PyTorch installed in the
interpreter that runs them, installed as PyTorch's CUDA allocator over the simulated device, and driven
through PyTorch's own entry points that need no CUDA driver (statistics, snapshot, resets, memory fraction,
empty_cache). The allocations themselves go through the C functions, since PyTorch's malloc path asks the
driver for the current device first.

Needs a CUDA build of PyTorch (``pip install torch ninja``; no CUDA toolkit: the layer builds against the
headers PyTorch's wheel brings) and ``cargo build --release -p cuvmm-torch``. Elsewhere the build tests skip,
saying why, and only :class:`CudaRuntime` runs. From the repository root, with that interpreter::

    python -m unittest discover -s python -p test_cpp_layer.py -v

The layer is built once into ``target/cpp-layer/torch-<version>`` and rebuilt when its sources change
(about a minute). ``CUVMM_TORCH_TEST_INSTALLED=1`` runs them against an installed copy of the package (its
library and the C++ sources it carries; ``tools/wheel_check.sh --torch``), never the checkout's ``python/``.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INSTALLED = os.environ.get("CUVMM_TORCH_TEST_INSTALLED") == "1"
if INSTALLED:  # this folder holds the checkout's cuvmm_torch, and is on the path: take it off (run this file
    # as a script then: unittest's discovery imports python/cuvmm_torch itself, as a package beside the tests)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != os.path.realpath(HERE)]
import cuvmm_torch  # noqa: E402

if INSTALLED and os.path.realpath(cuvmm_torch.__file__).startswith(os.path.realpath(ROOT) + os.sep):
    raise ImportError(f"CUVMM_TORCH_TEST_INSTALLED=1, but cuvmm_torch came from the checkout: {cuvmm_torch.__file__}")
# Where the layer and the tests' harness are built (CUVMM_TORCH_TEST_BUILD_ROOT: elsewhere).
BUILD_ROOT = os.environ.get("CUVMM_TORCH_TEST_BUILD_ROOT") or os.path.join(ROOT, "target", "cpp-layer")
SIZE = 3 << 20

# Runs in a fresh interpreter (PyTorch takes one allocator per process). Prints one JSON object.
PROBE = r"""
import json, torch, cuvmm_torch
C, lib, size, out = torch._C, cuvmm_torch.load(), int(SIZE), {}

def stats():
    s = C._cuda_memoryStats(0)
    keys = ("allocated_bytes", "reserved_bytes", "allocation", "segment")
    return {**{key: s[key]["all"] for key in keys}, "num_ooms": s["num_ooms"]}

out["layer"] = cuvmm_torch.install(cpp=True)
out["backend"] = torch.cuda.memory.get_allocator_backend()
ptr = lib.cuvmm_malloc(size, 0, None)
out["ptr"] = ptr
out["live"] = stats()
out["own_live"] = cuvmm_torch.memory_stats(0)
out["segments"] = C._cuda_memorySnapshot(None)["segments"]
lib.cuvmm_free(ptr, size, 0, None)
out["freed"] = stats()
C._cuda_resetPeakMemoryStats(0)
out["after_reset_peak"] = stats()
C._cuda_resetAccumulatedMemoryStats(0)
out["after_reset_accumulated"] = stats()
C._cuda_setMemoryFraction(0.25, 0)
out["fraction"] = lib.cuvmm_memory_fraction(0)
C._cuda_emptyCache()
out["emptied"] = stats()
try:
    cuvmm_torch.build_extension(torch).install(cuvmm_torch.library_path())
    out["second_install"] = "installed"
except RuntimeError as error:
    out["second_install"] = str(error)

# A CUDA graph's private pool, as torch.cuda.graph and cudagraph trees drive it.
pool = (0, 7)
C._cuda_beginAllocateCurrentThreadToPool(0, pool)
in_pool = lib.cuvmm_malloc(size, 0, None)
C._cuda_endAllocateToPool(0, pool)
outside = lib.cuvmm_malloc(size, 0, None)
out["pool_of"] = {str(ptr): [s["segment_pool_id"] for s in C._cuda_memorySnapshot(None)["segments"]
                             if any(b["address"] == ptr for b in s["blocks"])] for ptr in (in_pool, outside)}
out["pool_ptrs"] = [in_pool, outside]
out["live_in_pool"] = [C._cuda_checkPoolLiveAllocations(0, pool, {in_pool}),
                       C._cuda_checkPoolLiveAllocations(0, pool, {outside}),
                       C._cuda_checkPoolLiveAllocations(0, pool, set())]
state = C._cuda_getCheckpointState(0, pool)
C._cuda_setCheckpointPoolState(0, state, [], [])  # the same live allocations
lib.cuvmm_free(in_pool, size, 0, None)
try:
    C._cuda_setCheckpointPoolState(0, state, [], [])  # in_pool live again, at its address
    out["rewind"] = "rewound"
except RuntimeError as error:
    out["rewind"] = str(error)
out["live_after_rewind"] = C._cuda_checkPoolLiveAllocations(0, pool, {in_pool})
lib.cuvmm_free(in_pool, size, 0, None)
C._cuda_releasePool(0, pool)
lib.cuvmm_free(outside, size, 0, None)
C._cuda_emptyCache()
out["after_pool"] = stats()
print(json.dumps(out))
""".replace("SIZE", str(SIZE))

# Stand-ins for the few CUDA calls PyTorch's allocator interface makes around an allocator (the current device,
# the device count, stream priorities, capture state, a synchronization, the primary context's state), so that
# PyTorch's own malloc, free, OOM and IPC paths reach the C++ layer without a GPU. Anything else still goes to
# the real runtime and fails, which the probe shows.
FAKE_CUDART = r"""
static int current;
int cudaGetDevice(int *device) { *device = current; return 0; }
int cudaSetDevice(int device) { current = device; return 0; }
/* Two devices: the cross-device test records a use on device 1's stream, and from PyTorch 2.15 a guard
 * refuses a device past the count. cuvmm's simulated device is 0 alone. */
int cudaGetDeviceCount(int *count) { *count = 2; return 0; }
int cudaDeviceSynchronize(void) { return 0; }
int cudaGetLastError(void) { return 0; }
int cudaDeviceGetStreamPriorityRange(int *least, int *greatest) { *least = 0; *greatest = -5; return 0; }
int cudaStreamIsCapturing(void *stream, int *status) { (void)stream; *status = 0; return 0; }
int cudaThreadExchangeStreamCaptureMode(int *mode) { (void)mode; return 0; }
int cudaDriverGetVersion(int *version) { *version = 13000; return 0; }
/* cudaMalloc and cudaFree, for memory allocated with caching off: addresses from a range no simulated device
   hands out (never dereferenced), a request over 1 GiB refused as cudaErrorMemoryAllocation (2). */
static unsigned long long next_address = 0x200000000000ULL;
static int mallocs, frees;
int cudaMalloc(void **p, unsigned long size) {
    if (size > (1UL << 30)) return 2;
    *p = (void *)next_address;
    next_address += (size + 0xFFFFF) & ~0xFFFFFUL;
    mallocs++;
    return 0;
}
int cudaFree(void *p) { (void)p; frees++; return 0; }
int fake_cuda_mallocs(void) { return mallocs; }
int fake_cuda_frees(void) { return frees; }
/* Streams and events, for a stream of another device recorded on memory: each call written down as
   `call@current device:stream;`. fake_fail_events(1) makes event creation fail. */
#include <stdio.h>
#include <string.h>
static char cross_log[4096];
static int fail_events;
static void note(const char *call, const void *stream) {
    size_t used = strlen(cross_log);
    snprintf(cross_log + used, sizeof cross_log - used, "%s@%d:%llu;", call, current,
             (unsigned long long)stream);
}
int cudaStreamCreateWithFlags(void **stream, unsigned flags) {
    (void)flags; *stream = (void *)(0x7000ULL + current); note("create", *stream); return 0;
}
int cudaEventCreateWithFlags(void **event, unsigned flags) {
    (void)flags;
    if (fail_events) return 1;
    *event = (void *)0x900; return 0;
}
int cudaEventRecord(void *event, void *stream) { (void)event; note("record", stream); return 0; }
int cudaStreamWaitEvent(void *stream, void *event, unsigned flags) {
    (void)event; (void)flags; note("wait", stream); return 0;
}
int cudaEventDestroy(void *event) { (void)event; return 0; }
int cudaStreamSynchronize(void *stream) { note("sync", stream); return 0; }
const char *fake_cross_log(void) { return cross_log; }
void fake_fail_events(int on) { fail_events = on; }
"""
FAKE_LIBCUDA = r"""
int cuDevicePrimaryCtxGetState(int device, unsigned *flags, int *active) {
    (void)device; *flags = 0; *active = 1; return 0;
}
int cuInit(unsigned flags) { (void)flags; return 100; }
"""
# Calls PyTorch's allocator interface (c10::cuda::CUDACachingAllocator) as PyTorch does.
HARNESS = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <map>
namespace CCA = c10::cuda::CUDACachingAllocator;
static std::map<uint64_t, std::shared_ptr<void>> opened;
static std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> observed_;
void observe() {
  CCA::attachOutOfMemoryObserver([](int64_t device, size_t alloc, size_t total, size_t free) {
    observed_.emplace_back(device, alloc, total, free);
  });
}
std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> observed() { return observed_; }
// Two allocator trace trackers: one that throws at every event, then one that notes each (action, address,
// size, pool), as NCCL's registration hook reads them.
static std::vector<std::tuple<int64_t, uint64_t, uint64_t, uint64_t, uint64_t>> tracked_;
void track() {
  CCA::attachAllocatorTraceTracker([](const CCA::TraceEntry&) { throw std::runtime_error("a tracker's bug"); });
  CCA::attachAllocatorTraceTracker([](const CCA::TraceEntry& e) {
    tracked_.emplace_back(e.action_, e.addr_, e.size_, e.mempool_.first, e.mempool_.second);
  });
}
std::vector<std::tuple<int64_t, uint64_t, uint64_t, uint64_t, uint64_t>> tracked() { return tracked_; }
uint64_t alloc(size_t n) { return reinterpret_cast<uint64_t>(CCA::raw_alloc(n)); }
void release(uint64_t p) { CCA::raw_delete(reinterpret_cast<void*>(p)); }
std::string try_alloc(size_t n) {
  try {
    release(alloc(n));
    return "allocated";
  } catch (const c10::OutOfMemoryError& e) {
    return std::string("OutOfMemoryError: ") + e.what_without_backtrace();
  } catch (const c10::Error& e) {
    return std::string("Error: ") + e.what_without_backtrace();
  }
}
py::tuple share(uint64_t p) {
  auto h = CCA::shareIpcHandle(reinterpret_cast<void*>(p));
  return py::make_tuple(py::bytes(h.handle), static_cast<int64_t>(h.offset));
}
uint64_t open_handle(py::bytes handle) {
  auto mapping = CCA::getIpcDevPtr(std::string(handle));
  uint64_t p = reinterpret_cast<uint64_t>(mapping.get());
  opened[p] = mapping;
  return p;
}
std::string try_open(py::bytes handle) {
  try {
    open_handle(handle);
    return "opened";
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}
void close_handle(uint64_t p) { opened.erase(p); }
void close_all() { opened.clear(); }
static std::vector<std::shared_ptr<CCA::AllocatorState>> states;
int64_t checkpoint(uint64_t a, uint64_t b) {
  states.push_back(CCA::getCheckpointState(0, {a, b}));
  return static_cast<int64_t>(states.size()) - 1;
}
py::tuple restore(int64_t i) {
  auto delta = CCA::setCheckpointPoolState(0, states.at(i));
  std::vector<uint64_t> freed, allocd;
  for (void* p : delta.ptrs_freed) freed.push_back(reinterpret_cast<uint64_t>(p));
  for (auto& d : delta.dataptrs_allocd) {
    allocd.push_back(reinterpret_cast<uint64_t>(d.get()));
    d.release_context();  // the block stays allocated; the test frees it
  }
  return py::make_tuple(freed, allocd);
}
// Tensor.record_stream(s) of memory at `p` (on device 0) with the external stream `stream` of `device`.
void record_on(uint64_t p, int64_t device, uint64_t stream) {
  c10::DataPtr ptr(reinterpret_cast<void*>(p), reinterpret_cast<void*>(p), CCA::get()->raw_deleter(),
                   c10::Device(c10::DeviceType::CUDA, 0));
  CCA::recordStream(ptr, c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(stream),
                                                          static_cast<c10::DeviceIndex>(device)));
  ptr.release_context();  // the memory stays allocated; the test frees it
}
// torch.cuda.memory._record_memory_history(max_entries=entries), or its stop for 0.
void record_history(size_t entries) {
  CCA::get()->recordHistory(entries > 0, nullptr, entries, CCA::RecordContext::NEVER, false, {});
}
std::string try_call(py::object f) {
  try {
    f();
    return "returned";
  } catch (const py::error_already_set& e) {
    return std::string("raised: ") + e.what();
  }
}
"""
HARNESS_FUNCTIONS = ["observe", "observed", "track", "tracked", "alloc", "release", "try_alloc", "share", "open_handle", "try_open",
                     "close_handle", "close_all", "checkpoint", "restore", "record_on", "record_history", "try_call"]

# A pool's own allocator for CUDAPluggableAllocator: addresses from a range no simulated device hands out
# (never dereferenced), each call noted.
FAKE_ALLOC = r"""
#include <stddef.h>
#include <sys/types.h>
static unsigned long long next = 0x100000000000ULL, ptrs[64];
static size_t sizes[64];
static int allocs, frees;
void *fake_malloc(ssize_t size, int device, void *stream) {
    (void)device; (void)stream;
    unsigned long long p = next;
    next += ((size_t)size + 0xFFFFF) & ~(size_t)0xFFFFF;
    if (allocs < 64) { ptrs[allocs] = p; sizes[allocs] = (size_t)size; }
    allocs++;
    return (void *)p;
}
void fake_free(void *p, ssize_t size, int device, void *stream) { (void)p; (void)size; (void)device; (void)stream; frees++; }
int fake_allocs(void) { return allocs; }
int fake_frees(void) { return frees; }
size_t fake_size(int i) { return sizes[i]; }
unsigned long long fake_ptr(int i) { return ptrs[i]; }
"""

# PyTorch's MemPool and cudagraph trees' checkpoints, through PyTorch's own Python API where it needs no
# CUDA driver, and the harness where it does.
MEMPOOL_PROBE = r"""
import ctypes, json, torch, cuvmm_torch
from torch.utils import cpp_extension
C, out = torch._C, {}
out["layer"] = cuvmm_torch.install(cpp=True)
h = cpp_extension.load_inline(
    "cuvmm_test_harness", cpp_sources=[HARNESS], build_directory=BUILD, functions=HARNESS_FUNCTIONS,
    extra_include_paths=cuvmm_torch.cuda_runtime()[0], extra_ldflags=["-lc10_cuda"])
# PyTorch's Python API initializes CUDA lazily (device properties, ...), which the stand-ins cannot answer;
# the calls below need none of it.
torch.cuda._initialized = True

def stats():
    s = C._cuda_memoryStats(0)
    return {k: s[k]["all"]["current"] for k in ("allocated_bytes", "reserved_bytes", "segment")}

def allocated_blocks(pool):
    return [[b["address"], b["size"], b["requested_size"]] for s in C._cuda_memorySnapshot(pool)["segments"]
            for b in s["blocks"] if b["state"] == "active_allocated"]

# A MemPool made, used, counted and deleted; no_split: each allocation takes whole pages.
pool = torch.cuda.MemPool(no_split=True)
counts = [pool.use_count()]
with torch.cuda.use_mem_pool(pool, device=0):
    counts.append(pool.use_count())
    a, b = h.alloc(1000), h.alloc(1000)
counts.append(pool.use_count())
out["counts"], out["ab"], out["pool_blocks"] = counts, [a, b], allocated_blocks(pool.id)
h.release(a)
reserved = stats()["reserved_bytes"]
del pool  # ~MemPool, with b alive: setUseOnOOM(false), releasePool, emptyCache(pool); none may throw
out["deleted_with_b_alive"] = stats()["reserved_bytes"]
h.release(b)
C._cuda_emptyCache()
out["deleted"] = [reserved, stats()["reserved_bytes"]]
out["release_unknown"] = h.try_call(lambda: C._cuda_releasePool(0, (0, 12345)))
cached = h.alloc(4 << 20)
h.release(cached)
C._cuda_beginAllocateCurrentThreadToPool(0, (0, 88))
reserved = stats()["reserved_bytes"]
out["empty_during_capture"] = h.try_call(C._cuda_emptyCache)
# From PyTorch 2.13, which marks its captures, a pool begun with no capture is none: the cache goes back.
out["empty_in_pool"] = [reserved, stats()["reserved_bytes"]]
out["marks_captures"] = [int(v) for v in torch.__version__.split(".")[:2]] >= [2, 13]
out["begun_twice"] = h.try_call(lambda: C._cuda_beginAllocateCurrentThreadToPool(0, (0, 88)))
C._cuda_endAllocateToPool(0, (0, 88))
C._cuda_releasePool(0, (0, 88))

# use_on_oom (4 GiB device): a live pool holding 3 GiB free lends it to a request that ran out.
def pool_holding(use_on_oom):
    p = torch.cuda.MemPool(use_on_oom=use_on_oom)
    with torch.cuda.use_mem_pool(p, device=0):
        x = h.alloc(3 << 30)
    h.release(x)
    return p
lender = pool_holding(False)
out["without_use_on_oom"] = h.try_alloc(2 << 30)
del lender
lender = pool_holding(True)
out["with_use_on_oom"] = h.try_alloc(2 << 30)
del lender
C._cuda_emptyCache()
out["after_lenders"] = stats()

# A pool with an allocator of its own (CUDAPluggableAllocator, as vLLM's and NCCL's pools are built).
fake = ctypes.CDLL(FAKE_ALLOC)
fake.fake_size.restype, fake.fake_ptr.restype = ctypes.c_size_t, ctypes.c_ulonglong
plug = torch.cuda.memory.CUDAPluggableAllocator(FAKE_ALLOC, "fake_malloc", "fake_free")
own = torch.cuda.MemPool(plug.allocator())
h.track()
before = stats()
with torch.cuda.use_mem_pool(own, device=0):
    small, large, small2 = h.alloc(1000), h.alloc(3 << 20), h.alloc(2000)
outside = h.alloc(1000)
out["own"] = {
    "sizes": [fake.fake_size(i) for i in range(fake.fake_allocs())],
    "segments": [fake.fake_ptr(i) for i in range(fake.fake_allocs())],
    "blocks": [small, large, small2, outside],
    "stats": [before, stats()],
    "snapshot": [[s["address"], s["total_size"], list(s["segment_pool_id"])]
                 for s in C._cuda_memorySnapshot(own.id)["segments"]],
    "id": list(own.id),
}
for p in (small, large, small2, outside):
    h.release(p)
out["own"]["frees_while_live"] = fake.fake_frees()
del own
out["own"]["frees_after_del"] = fake.fake_frees()
# A pool of cuvmm's memory: its events name it, as PyTorch's do (NCCL's registration hook matches them).
plain = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(plain, device=0):
    inside = h.alloc(5 << 20)
h.release(inside)
out["own"]["plain"] = {"id": list(plain.id), "block": inside}
del plain
out["own"]["tracked"] = h.tracked()
out["own"]["after"] = stats()

# cudagraph trees: a checkpoint of a pool, blocks freed and allocated, the pool put back.
graph = (0, 77)
C._cuda_beginAllocateCurrentThreadToPool(0, graph)
x = h.alloc(3 << 20)
state = h.checkpoint(*graph)
y = h.alloc(5 << 20)
h.release(x)
z = h.alloc(1 << 20)
freed, allocd = h.restore(state)
out["checkpoint"] = {"xyz": [x, y, z], "freed": sorted(freed), "allocd": allocd,
                     "live": C._cuda_checkPoolLiveAllocations(0, graph, {x})}
h.release(x)
C._cuda_endAllocateToPool(0, graph)
C._cuda_releasePool(0, graph)
print(json.dumps(out))
"""

SHIM_PROBE = r"""
import json, torch, cuvmm_torch
from torch.utils import cpp_extension
C, size = torch._C, int(SIZE)
out = {"layer": cuvmm_torch.install(cpp=True)}
h = cpp_extension.load_inline(
    "cuvmm_test_harness", cpp_sources=[HARNESS], build_directory=BUILD, functions=HARNESS_FUNCTIONS,
    extra_include_paths=cuvmm_torch.cuda_runtime()[0], extra_ldflags=["-lc10_cuda"])
h.observe()
ptr = h.alloc(size)
out["allocated"] = C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"]
handle, out["offset"] = h.share(ptr)
out["kind"] = list(handle[:2])
out["torch_version"] = [int(v) for v in torch.__version__.split(".")[:2]]
opened = h.open_handle(handle)
out["opened"] = [ptr, opened, h.open_handle(handle)]
h.close_handle(opened)
out["reopen"] = h.try_open(handle)
# The same handle without cuvmm's string after the descriptors: what PyTorch's expandable segments send.
header = 24 if handle[0] == 2 else 32
count = int.from_bytes(handle[18:26], "little")
out["pytorch_layout_alone"] = h.try_open(handle[:2 + header + 4 * count])
h.close_all()
h.release(ptr)
out["released"] = C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"]
# Freed, its chunk still held: its descriptor is the chunk's, kept until the release (as PyTorch's).
out["after_free_held"] = h.try_open(handle)
h.close_all()
C._cuda_emptyCache()
out["after_free"] = h.try_open(handle)
out["huge"] = h.try_alloc(100 << 30)
C._cuda_setMemoryFraction(0.5, 0)
out["over_limit"] = h.try_alloc(3 << 30)
out["observed"] = h.observed()
out["num_ooms"] = cuvmm_torch.memory_stats(0)["num_ooms"]
C._cuda_setMemoryFraction(1.0, 0)

# Caching off (torch.cuda.caching_allocator_enable(False)): cudaMalloc and cudaFree, outside cuvmm's figures.
import ctypes
fake = ctypes.CDLL(FAKECUDART)
def cuda_calls():
    return [fake.fake_cuda_mallocs(), fake.fake_cuda_frees()]
cached = h.alloc(size)
C._cuda_cudaCachingAllocator_enable(False)
off = h.alloc(size)
off_freed_while_off = h.alloc(size)
out["off"] = {"ptrs": [cached, off], "allocated": C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"],
              "calls": cuda_calls()}
h.release(off_freed_while_off)
h.release(cached)  # cuvmm's, though freed with caching off
out["off"]["freed_while_off"] = cuda_calls()
out["off"]["huge"] = h.try_alloc(2 << 30)
C._cuda_cudaCachingAllocator_enable(True)
on = h.alloc(size)
out["on"] = {"calls": cuda_calls(), "allocated": C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"]}
h.release(off)  # allocated with caching off, freed with it on
h.release(on)
out["on"]["freed"] = cuda_calls()
out["on"]["allocated_after"] = C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"]

# Memory of device 0 used on a stream of device 1 (record_stream), then freed: an event on that stream, on
# its device, which a stream of device 0 waits for; and where events fail, that stream synchronized.
fake.fake_cross_log.restype = ctypes.c_char_p
x = h.alloc(size)
h.record_on(x, 1, 0x5000)
out["cross"] = {"before_free": fake.fake_cross_log().decode()}
h.release(x)
out["cross"]["freed"] = fake.fake_cross_log().decode()
fake.fake_fail_events(1)
y = h.alloc(size)
h.record_on(y, 1, 0x6000)
h.release(y)
out["cross"]["failing"] = fake.fake_cross_log().decode()
out["cross"]["allocated_after"] = C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"]

# History: the events of a malloc and, 50 ms later, its free, each with its own time as PyTorch's
# snapshots report it (microseconds since the epoch).
import time
h.record_history(100)
x = h.alloc(size)
time.sleep(0.05)
h.release(x)
traces = C._cuda_memorySnapshot(None)["device_traces"][0]
out["history"] = {"actions": [t["action"] for t in traces], "now_us": time.time() * 1e6,
                  "times_us": [t["time_us"] for t in traces]}
h.record_history(0)
print(json.dumps(out))
"""

# PYTORCH_NO_CUDA_MEMORY_CACHING=1 in the environment: cudaMalloc and cudaFree for every allocation, whatever
# caching_allocator_enable says, as PyTorch's own allocator; the install warns.
NO_CACHING_PROBE = r"""
import ctypes, json, warnings, torch, cuvmm_torch
from torch.utils import cpp_extension
C, size = torch._C, int(SIZE)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = {"layer": cuvmm_torch.install(cpp=True)}
out["warnings"] = [str(w.message) for w in caught]
h = cpp_extension.load_inline(
    "cuvmm_test_harness", cpp_sources=[HARNESS], build_directory=BUILD, functions=HARNESS_FUNCTIONS,
    extra_include_paths=cuvmm_torch.cuda_runtime()[0], extra_ldflags=["-lc10_cuda"])
fake = ctypes.CDLL(FAKECUDART)
def cuda_calls():
    return [fake.fake_cuda_mallocs(), fake.fake_cuda_frees()]
first = h.alloc(size)
out["first"] = {"ptr": first, "calls": cuda_calls(),
                "allocated": C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"]}
C._cuda_cudaCachingAllocator_enable(True)
second = h.alloc(size)
out["enabled"] = {"ptr": second, "calls": cuda_calls()}
h.release(first)
h.release(second)
out["freed"] = cuda_calls()
out["huge"] = h.try_alloc(2 << 30)
print(json.dumps(out))
"""

FALLBACK_PROBE = r"""
import json, warnings, torch, cuvmm_torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    layer = cuvmm_torch.install()
print(json.dumps({"layer": layer, "warnings": [str(w.message) for w in caught],
                  "backend": torch.cuda.memory.get_allocator_backend()}))
"""


def missing_for_install():
    """Why cuvmm cannot be installed into PyTorch here, or None."""
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed in this interpreter"
    import torch  # noqa: PLC0415

    if not torch.version.cuda:
        return f"PyTorch {torch.__version__} is a build without CUDA"
    try:
        cuvmm_torch.library_path()
    except FileNotFoundError as error:
        return str(error)
    return None


def missing_for_build():
    """Why the C++ layer cannot be built here, or None."""
    if missing_for_install():
        return missing_for_install()
    from torch.utils import cpp_extension  # noqa: PLC0415

    cuvmm_torch.ninja_on_path()  # as install() does: the ninja package's, where PATH has none
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def stand_ins(*more):
    """A temporary directory holding the CUDA stand-ins (FAKE_CUDART, FAKE_LIBCUDA) and `more` ((source,
    library, flags) each), compiled; skips the test where there is no C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise unittest.SkipTest("no C compiler for the CUDA stand-ins")
    scratch = tempfile.TemporaryDirectory()
    directory = scratch.name
    for source, target, flags in [(FAKE_CUDART, "libfakecudart.so", []),
                                  (FAKE_LIBCUDA, "libcuda.so.1", ["-Wl,-soname,libcuda.so.1"]), *more]:
        with open(os.path.join(directory, target + ".c"), "w") as file:
            file.write(source)
        subprocess.run([compiler, "-shared", "-fPIC", *flags, "-o", os.path.join(directory, target),
                        os.path.join(directory, target + ".c")], check=True)
    return scratch


def run_probe(code, **env):
    """Runs `code` on the simulated device in a fresh interpreter; returns its JSON output."""
    return json.loads(run_python(["-c", code], **env).strip().splitlines()[-1])


def probe_environment(**env):
    """The environment of a probe: the simulated device, this checkout's package (or, installed, none:
    the interpreter's own), the C++ layer's build cached per PyTorch version."""
    import torch  # noqa: PLC0415

    environment = {k: v for k, v in os.environ.items() if not k.startswith("CUVMM_") and k != "PYTHONPATH"}
    environment.update(
        CUVMM_BACKEND="sim",
        CUVMM_SIM_DEVICES="1",
        CUVMM_SIM_CAPACITY="4GiB",
        CUVMM_TORCH_BUILD=os.path.join(BUILD_ROOT, f"torch-{torch.__version__}"),
    )
    if not INSTALLED:
        environment.update(CUVMM_TORCH_LIB=cuvmm_torch.library_path(), PYTHONPATH=HERE)
    environment.update(env)
    return environment


def run_python(args, **env):
    """Runs the interpreter with `args` (see probe_environment); returns its stdout, or fails with its stderr."""
    done = subprocess.run([sys.executable, *args], env=probe_environment(**env), capture_output=True, text=True,
                          timeout=900, check=False)
    if done.returncode != 0:
        raise AssertionError(f"the probe failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


@unittest.skipIf(missing_for_build(), missing_for_build())
class CppLayer(unittest.TestCase):
    """PyTorch's statistics, snapshot and settings calls reach cuvmm through the C++ layer."""

    @classmethod
    def setUpClass(cls):
        cls.out = run_probe(PROBE)

    def test_it_is_pytorchs_allocator(self):
        self.assertEqual((self.out["layer"], self.out["backend"]), ("cpp", "cuvmm"))

    def test_a_second_install_is_refused(self):
        self.assertIn("already installed", self.out["second_install"])

    def test_memory_stats_are_cuvmms(self):
        live, own = self.out["live"], self.out["own_live"]
        self.assertEqual(live["allocated_bytes"]["current"], SIZE)
        self.assertEqual(live["allocation"]["current"], 1)
        self.assertGreater(live["reserved_bytes"]["current"], 0)
        for key in ("allocated_bytes", "reserved_bytes", "allocation", "segment"):
            for field in ("current", "peak", "allocated", "freed"):
                self.assertEqual(live[key][field], own[f"{key}.all.{field}"], (key, field))
        self.assertEqual(live["num_ooms"], own["num_ooms"])

    def test_the_snapshot_shows_the_block(self):
        ptr = self.out["ptr"]
        blocks = [(segment, block) for segment in self.out["segments"] for block in segment["blocks"]
                  if block["address"] == ptr]
        self.assertEqual(len(blocks), 1, self.out["segments"])
        segment, block = blocks[0]
        self.assertEqual((block["state"], block["size"], block["requested_size"]),
                         ("active_allocated", SIZE, SIZE))
        self.assertEqual(segment["total_size"], sum(b["size"] for b in segment["blocks"]))
        self.assertEqual(segment["allocated_size"], SIZE)
        self.assertTrue(segment["address"] <= ptr < segment["address"] + segment["total_size"])
        self.assertEqual(segment["device"], 0)

    def test_a_free_and_the_resets_reach_cuvmm(self):
        freed = self.out["freed"]["allocated_bytes"]
        self.assertEqual((freed["current"], freed["peak"], freed["freed"]), (0, SIZE, SIZE))
        self.assertEqual(self.out["after_reset_peak"]["allocated_bytes"]["peak"], 0)
        accumulated = self.out["after_reset_accumulated"]["allocated_bytes"]
        self.assertEqual((accumulated["allocated"], accumulated["freed"]), (0, 0))

    def test_a_graph_pool_keeps_its_allocations_and_checks_them(self):
        in_pool, outside = self.out["pool_ptrs"]
        self.assertEqual(self.out["pool_of"], {str(in_pool): [[0, 7]], str(outside): [[0, 0]]})
        self.assertEqual(self.out["live_in_pool"], [True, False, False])
        self.assertEqual(self.out["rewind"], "rewound")
        self.assertTrue(self.out["live_after_rewind"], "the checkpoint's block is live again at its address")
        self.assertEqual(self.out["after_pool"]["reserved_bytes"]["current"], 0, "released and emptied")

    def test_memory_fraction_and_empty_cache_reach_cuvmm(self):
        self.assertEqual(self.out["fraction"], 0.25)
        self.assertGreater(self.out["freed"]["reserved_bytes"]["current"], 0)
        self.assertEqual(self.out["emptied"]["reserved_bytes"]["current"], 0)


@unittest.skipIf(missing_for_build(), missing_for_build())
class ThroughPyTorchsInterface(unittest.TestCase):
    """PyTorch's raw_alloc / raw_delete, out-of-memory and IPC calls reach cuvmm through the C++ layer, with
    stand-ins for the CUDA calls PyTorch makes around them (FAKE_CUDART, FAKE_LIBCUDA)."""

    @classmethod
    def setUpClass(cls):
        import torch  # noqa: PLC0415

        cls.scratch = stand_ins()
        fakes = cls.scratch.name
        build = os.path.join(BUILD_ROOT, f"harness-{torch.__version__}")
        os.makedirs(build, exist_ok=True)
        code = SHIM_PROBE.replace("SIZE", str(SIZE)).replace("HARNESS_FUNCTIONS", repr(HARNESS_FUNCTIONS))
        code = code.replace("HARNESS", repr(HARNESS))
        code = code.replace("BUILD", repr(build))
        fake_cudart = os.path.join(fakes, "libfakecudart.so")
        code = code.replace("FAKECUDART", repr(fake_cudart))
        cls.out = run_probe(code, LD_PRELOAD=fake_cudart, LD_LIBRARY_PATH=fakes)

    @classmethod
    def tearDownClass(cls):
        cls.scratch.cleanup()

    def test_history_events_carry_their_own_times_in_microseconds_since_the_epoch(self):
        history = self.out["history"]
        self.assertIn("alloc", history["actions"])
        self.assertIn("free_completed", history["actions"])
        for time_us in history["times_us"]:
            self.assertLess(abs(time_us - history["now_us"]), 60e6, history)
        actions, times = history["actions"], history["times_us"]
        alloc, freed = times[actions.index("alloc")], times[actions.index("free_completed")]
        self.assertGreaterEqual(freed - alloc, 40e3, "each event has its own time, not the snapshot's")

    def test_another_devices_stream_recorded_on_memory_is_waited_for_through_an_event_at_the_free(self):
        cross, stream, proxy = self.out["cross"], 0x5000, 0x7000  # the fake's stream of device 0
        self.assertEqual(cross["before_free"], "", "nothing happens before the free")
        # A stream of device 0 the layer owns, made once; an event recorded on device 1's stream there; the
        # proxy waits for it (cuvmm's free then waits for the proxy).
        self.assertEqual(cross["freed"], f"create@0:{proxy};record@1:{stream};wait@1:{proxy};")
        # Events refused: the host synchronizes the other stream, and the memory is freed all the same.
        self.assertEqual(cross["failing"], cross["freed"] + f"sync@1:{0x6000};")
        self.assertEqual(cross["allocated_after"], 0)

    def test_with_caching_off_memory_comes_from_cuda_malloc_as_in_pytorch(self):
        off, on = self.out["off"], self.out["on"]
        cached, uncached = off["ptrs"]
        stand_in = range(0x200000000000, 0x200000000000 + (1 << 40))  # the stand-in cudaMalloc's addresses
        self.assertIn(uncached, stand_in)
        self.assertNotIn(cached, stand_in, "cuvmm's")
        self.assertEqual(off["calls"], [2, 0])
        self.assertEqual(off["allocated"], SIZE, "memory allocated with caching off is in no statistic")
        self.assertEqual(off["freed_while_off"], [2, 1], "cudaFree for its own, cuvmm's back to cuvmm")
        self.assertTrue(off["huge"].startswith("OutOfMemoryError: CUDA out of memory"), off["huge"])
        self.assertIn("caching off", off["huge"])
        self.assertEqual(on["calls"], [2, 1], "caching on again: cuvmm's")
        self.assertEqual(on["allocated"], SIZE)
        self.assertEqual(on["freed"], [2, 2], "memory allocated with caching off goes to cudaFree whenever freed")
        self.assertEqual(on["allocated_after"], 0)

    def test_raw_alloc_and_raw_delete_are_cuvmms(self):
        self.assertEqual(self.out["layer"], "cpp")
        self.assertEqual((self.out["allocated"], self.out["released"]), (SIZE, 0))

    def test_a_request_larger_than_the_device_is_torch_out_of_memory(self):
        self.assertTrue(self.out["huge"].startswith("OutOfMemoryError: cuvmm:"), self.out["huge"])
        self.assertIn("can never fit", self.out["huge"])

    def test_a_request_over_the_memory_fraction_is_torch_out_of_memory_with_the_diagnosis(self):
        self.assertTrue(self.out["over_limit"].startswith("OutOfMemoryError: cuvmm:"), self.out["over_limit"])
        self.assertIn("out of memory", self.out["over_limit"].lower())

    def test_out_of_memory_observers_are_called_with_the_numbers(self):
        gib = 1 << 30
        huge, over_limit = self.out["observed"]
        self.assertEqual(huge[:3], [0, 100 * gib, 4 * gib])
        self.assertEqual(over_limit[:3], [0, 3 * gib, 2 * gib], "the limit, as PyTorch passes it")
        self.assertGreaterEqual(self.out["num_ooms"], 1)

    def test_a_shared_allocation_opens_at_an_address_of_its_own_while_it_lives(self):
        ptr, opened, again = self.out["opened"]
        version = 3 if self.out["torch_version"] >= [2, 13] else 2
        self.assertEqual(self.out["kind"], [version, ord("e")], "PyTorch's expandable-segment layout")
        self.assertEqual(self.out["offset"], 0)
        self.assertNotEqual(opened, ptr, "mapped again, elsewhere")
        self.assertEqual(again, opened, "one mapping per handle while it is in use")
        self.assertEqual(self.out["reopen"], "opened", "held until the allocation is freed")
        self.assertEqual(self.out["pytorch_layout_alone"], "opened", "taken with pidfd_getfd")
        self.assertEqual(self.out["after_free_held"], "opened", "the chunk's descriptor, kept while it is held")
        self.assertIn("no such export", self.out["after_free"], "its chunk released: gone")


@unittest.skipIf(missing_for_build(), missing_for_build())
class NoCachingFromTheEnvironment(unittest.TestCase):
    """PYTORCH_NO_CUDA_MEMORY_CACHING=1, the debugging setting PyTorch reads at its first allocation, is read
    by the C++ layer too: every allocation goes to (the stand-in) cudaMalloc."""

    def test_every_allocation_goes_to_cuda_malloc_whatever_caching_allocator_enable_says(self):
        import torch  # noqa: PLC0415

        with stand_ins() as fakes:
            build = os.path.join(BUILD_ROOT, f"harness-{torch.__version__}")
            os.makedirs(build, exist_ok=True)
            fake_cudart = os.path.join(fakes, "libfakecudart.so")
            code = NO_CACHING_PROBE.replace("SIZE", str(SIZE)).replace("HARNESS_FUNCTIONS", repr(HARNESS_FUNCTIONS))
            code = code.replace("HARNESS", repr(HARNESS)).replace("BUILD", repr(build))
            code = code.replace("FAKECUDART", repr(fake_cudart))
            out = run_probe(code, LD_PRELOAD=fake_cudart, LD_LIBRARY_PATH=fakes, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
        stand_in = range(0x200000000000, 0x200000000000 + (1 << 40))  # the stand-in cudaMalloc's addresses
        self.assertEqual(out["layer"], "cpp")
        self.assertTrue(any("PYTORCH_NO_CUDA_MEMORY_CACHING" in w for w in out["warnings"]), out["warnings"])
        self.assertIn(out["first"]["ptr"], stand_in)
        self.assertEqual(out["first"]["calls"], [1, 0])
        self.assertEqual(out["first"]["allocated"], 0, "in no statistic of cuvmm's")
        self.assertIn(out["enabled"]["ptr"], stand_in, "caching_allocator_enable(True) does not override it")
        self.assertEqual(out["enabled"]["calls"], [2, 0])
        self.assertEqual(out["freed"], [2, 2])
        self.assertTrue(out["huge"].startswith("OutOfMemoryError: CUDA out of memory"), out["huge"])
        self.assertIn("PYTORCH_NO_CUDA_MEMORY_CACHING", out["huge"])


@unittest.skipIf(missing_for_build(), missing_for_build())
class MemPools(unittest.TestCase):
    """torch.cuda.MemPool (use_count, no_split, use_on_oom, an allocator of its own, deleted without an
    abort) and cudagraph trees' checkpoints, through PyTorch's own entry points."""

    @classmethod
    def setUpClass(cls):
        import torch  # noqa: PLC0415

        cls.scratch = stand_ins((FAKE_ALLOC, "libfakealloc.so", []))
        fakes = cls.scratch.name
        build = os.path.join(BUILD_ROOT, f"harness-{torch.__version__}")
        os.makedirs(build, exist_ok=True)
        code = MEMPOOL_PROBE.replace("HARNESS_FUNCTIONS", repr(HARNESS_FUNCTIONS))
        code = code.replace("HARNESS", repr(HARNESS)).replace("BUILD", repr(build))
        code = code.replace("FAKE_ALLOC", repr(os.path.join(fakes, "libfakealloc.so")))
        cls.out = run_probe(code, LD_PRELOAD=os.path.join(fakes, "libfakecudart.so"), LD_LIBRARY_PATH=fakes)

    @classmethod
    def tearDownClass(cls):
        cls.scratch.cleanup()

    def test_a_mempool_is_counted_used_and_deleted_without_an_abort(self):
        self.assertEqual(self.out["counts"], [1, 2, 1])
        reserved, after = self.out["deleted"]
        self.assertGreater(reserved, 0)
        self.assertEqual(self.out["deleted_with_b_alive"], 2 << 20, "only the page of the live tensor stays")
        self.assertEqual(after, 0, "its last tensor freed, the pool's memory goes back")

    def test_a_no_split_pool_gives_each_allocation_whole_pages(self):
        a, b = self.out["ab"]
        page = 2 << 20
        self.assertEqual(sorted(self.out["pool_blocks"]), sorted([[a, page, 1000], [b, page, 1000]]))
        self.assertEqual((a % page, b % page), (0, 0))

    def test_calls_from_destructors_warn_instead_of_raising(self):
        self.assertEqual(self.out["release_unknown"], "returned")
        self.assertEqual(self.out["empty_during_capture"], "returned")
        self.assertIn("already being allocated to", self.out["begun_twice"], "refused, the first begin intact")

    def test_empty_cache_in_a_pool_begun_with_no_capture_gives_back_once_pytorch_marks_captures(self):
        reserved, after = self.out["empty_in_pool"]
        self.assertGreaterEqual(reserved, 4 << 20, "the block freed before the pool began, cached")
        # PyTorch 2.11 and 2.12 do not mark captures: any pool begun may be one, and the cache stays.
        self.assertEqual(after, 0 if self.out["marks_captures"] else reserved)

    def test_a_use_on_oom_pool_serves_a_request_that_ran_out(self):
        self.assertTrue(self.out["without_use_on_oom"].startswith("OutOfMemoryError"), self.out)
        self.assertEqual(self.out["with_use_on_oom"], "allocated")
        self.assertEqual(self.out["after_lenders"]["reserved_bytes"], 0)

    def test_a_pool_with_its_own_allocator_takes_segments_from_it(self):
        own = self.out["own"]
        mib = 1 << 20
        self.assertEqual(own["sizes"], [2 * mib, 20 * mib], "PyTorch's segment sizes, one per pool kind")
        small_seg, large_seg = own["segments"]
        small, large, small2, outside = own["blocks"]
        self.assertEqual((small, small2), (small_seg, small_seg + 1024), "carved from its segment")
        self.assertEqual(large, large_seg)
        self.assertFalse(small_seg <= outside < small_seg + 2 * mib, "outside the pool: cuvmm's memory")
        before, during = own["stats"]
        self.assertEqual(during["allocated_bytes"] - before["allocated_bytes"], 1024 + 3 * mib + 2048 + 1024)
        self.assertEqual(during["segment"] - before["segment"], 2 + 1)
        self.assertEqual(sorted(s[:2] for s in own["snapshot"]), [[small_seg, 2 * mib], [large_seg, 20 * mib]])
        self.assertEqual(own["frees_while_live"], 0, "kept while the pool lives, as PyTorch keeps them")
        self.assertEqual(own["frees_after_del"], 2, "given back to its allocator when the pool is deleted")
        self.assertEqual(own["after"]["allocated_bytes"], 0)

    def test_trace_trackers_see_cuvmms_events_and_the_segments_of_a_pools_own_allocator(self):
        own = self.out["own"]
        tracked, pool = own["tracked"], own["id"]
        segment_alloc, segment_free, alloc, free_requested = 3, 4, 0, 1  # PyTorch's TraceEntry::Action
        sizes = own["sizes"]
        made = [(s, size, pool) for s, size in zip(own["segments"], sizes)]
        seen = [(e[1], e[2], e[3:]) for e in tracked if e[0] == segment_alloc]
        self.assertEqual(seen, made, "each segment the pool's allocator made, with the pool, as PyTorch's")
        given_back = sorted((e[1], e[2], e[3:]) for e in tracked if e[0] == segment_free)
        self.assertEqual(given_back, sorted(made), "given back when the pool was deleted")
        outside = own["blocks"][3]
        self.assertIn([alloc, outside, 1000, 0, 0], tracked, "cuvmm's own events, through the C ABI")
        self.assertIn([free_requested, outside, 1000, 0, 0], tracked)
        self.assertLess(tracked.index([alloc, outside, 1000, 0, 0]), tracked.index([free_requested, outside, 1000, 0, 0]))
        for block, size in zip(own["blocks"][:3], (1000, 3 << 20, 2000)):
            self.assertIn([alloc, block, size] + pool, tracked, "a block of the pool's allocator, with the pool")
            self.assertIn([free_requested, block, size] + pool, tracked)
        block, plain = own["plain"]["block"], own["plain"]["id"]
        self.assertIn([alloc, block, 5 << 20] + plain, tracked, "an allocation in a MemPool names the pool")
        segment_map = 5
        mapped = [e for e in tracked if e[0] == segment_map and e[1] <= block < e[1] + e[2]]
        self.assertTrue(mapped, tracked)
        self.assertTrue(all(e[3:] == plain for e in mapped), f"its pages mapped for the pool: {mapped}")

    def test_a_checkpoint_puts_the_pool_back(self):
        cp = self.out["checkpoint"]
        x, y, z = cp["xyz"]
        self.assertEqual(cp["freed"], sorted([y, z]), "every block live when called")
        self.assertEqual(cp["allocd"], [x], "the checkpoint's, live again at its address")
        self.assertTrue(cp["live"])


# Calls a program can make into PyTorch's allocator, with good arguments and bad, each as (name, what it must
# do, code): "returned", or the name of the exception it must raise (a Python exception, never an abort). Run
# one after another in one process by SWEEP_PROBE; `alloc(n)` / `free(p)` are PyTorch's raw_alloc and
# raw_delete, FAKES the directory of the stand-ins.
CALLS = [
    ("statistics, summary and snapshot", "returned", """
p = alloc(1000)
m.memory_stats(0); m.memory_stats_as_nested_dict(0); m.memory_summary(0); m.memory_snapshot()
m.memory_snapshot((0, 5)); m._snapshot(0); m._dump_snapshot(os.path.join(FAKES, "snapshot.pickle"))
m.reset_peak_memory_stats(0); m.reset_accumulated_memory_stats(0)
m.host_memory_stats(); m.reset_peak_host_memory_stats(); m.reset_accumulated_host_memory_stats()
free(p)
"""),
    ("history recorded, allocated under it, stopped", "returned", """
m._record_memory_history(max_entries=4)
ps = [alloc(1000 * (i + 1)) for i in range(10)]
for p in ps: free(p)
m._snapshot(0); C._cuda_isHistoryEnabled()
m._record_memory_history(enabled=None)
"""),
    ("history recorded without the actions skipped", "returned", """
m._record_memory_history(max_entries=100, skip_actions=["free_requested", "free_completed"])
free(alloc(1000))
actions = {t["action"] for t in m._snapshot(0)["device_traces"][0]}
m._record_memory_history(enabled=None)
assert "alloc" in actions and not actions & {"free_requested", "free_completed"}, actions
"""),
    ("a skipped action of no name PyTorch knows", "RuntimeError",
     'm._record_memory_history(max_entries=100, skip_actions=["frees"])'),
    ("statistics of a device that does not exist", "RuntimeError", "C._cuda_memoryStats(9)"),
    ("peak reset of a device that does not exist", "RuntimeError", "C._cuda_resetPeakMemoryStats(9)"),
    ("accumulated reset of a device that does not exist", "RuntimeError", "C._cuda_resetAccumulatedMemoryStats(9)"),
    ("memory fraction of a device that does not exist", "RuntimeError", "C._cuda_setMemoryFraction(0.5, 9)"),
    ("a negative memory fraction", "RuntimeError", "C._cuda_setMemoryFraction(-1.0, 0)"),
    ("a memory fraction of 0, then an allocation", "OutOfMemoryError", """
m.set_per_process_memory_fraction(0.0, 0)
m.empty_cache()  # nothing cached that could serve it
try:
    alloc(1000)
finally:
    m.set_per_process_memory_fraction(1.0, 0)
"""),
    ("a request larger than the device", "OutOfMemoryError", "alloc(1 << 50)"),
    ("zero bytes, a null pointer freed", "returned", "free(alloc(0)); free(0)"),
    ("a pointer the allocator never gave, freed", "returned", "free(0x1234500)"),
    ("a pointer freed twice", "returned", "p = alloc(1000); free(p); free(p)"),
    ("caching off and on again", "returned", """
m.caching_allocator_enable(False)
p = alloc(1000)
m.caching_allocator_enable(True)
free(p)
"""),
    ("an out-of-memory observer that asks the allocator", "OutOfMemoryError", """
def observer(*args):
    m.memory_summary(0); m.memory_snapshot(); m.empty_cache(); free(alloc(1 << 20))
C._cuda_attach_out_of_memory_observer(observer)
alloc(1 << 40)
"""),  # observers stay: this one is called again below
    ("an out-of-memory observer that raises", "ZeroDivisionError", """
C._cuda_attach_out_of_memory_observer(lambda *args: 1 / 0)
alloc(1 << 40)
"""),
    ("an allocation after an observer raised", "returned", "free(alloc(1 << 20))"),
    ("a MemPool used, an exception inside, deleted with a tensor alive", "returned", """
pool = m.MemPool()
try:
    with m.use_mem_pool(pool, device=0):
        p = alloc(1000)
        raise KeyError
except KeyError:
    pass
del pool
free(p)
"""),
    ("MemPools nested", "returned", """
outer, inner = m.MemPool(), m.MemPool()
with m.use_mem_pool(outer, device=0):
    with m.use_mem_pool(inner, device=0):
        p = alloc(1000)
    q = alloc(1000)
free(p); free(q)
del outer, inner
"""),
    ("a MemPool used inside itself", "RuntimeError", """
pool = m.MemPool()
with m.use_mem_pool(pool, device=0):
    with m.use_mem_pool(pool, device=0):
        pass
"""),
    ("a MemPool deleted while allocations go to it", "returned", """
pool = m.MemPool()
pid = pool.id
C._cuda_beginAllocateCurrentThreadToPool(0, pid)  # as use_mem_pool does: the pool's use ends at its release
del pool
p = alloc(1000)
C._cuda_endAllocateToPool(0, pid)
C._cuda_releasePool(0, pid)
free(p)
"""),
    ("a pool released while allocations go to it", "returned", """
C._cuda_beginAllocateCurrentThreadToPool(0, (0, 91))
C._cuda_releasePool(0, (0, 91))
p = alloc(1000)
C._cuda_endAllocateToPool(0, (0, 91))
free(p)
"""),
    ("a pool ended that was never begun", "RuntimeError", "C._cuda_endAllocateToPool(0, (3, 4))"),
    ("a pool released that was never begun", "returned", "C._cuda_releasePool(0, (3, 4))"),
    ("a pool's liveness, never begun", "returned", "C._cuda_checkPoolLiveAllocations(0, (7, 7), set())"),
    ("a checkpoint put back after its pool went", "RuntimeError", """
C._cuda_beginAllocateCurrentThreadToPool(0, (0, 92))
state = C._cuda_getCheckpointState(0, (0, 92))
C._cuda_endAllocateToPool(0, (0, 92))
C._cuda_releasePool(0, (0, 92))
C._cuda_setCheckpointPoolState(0, state, [], [])
"""),
    ("a MemPool with an allocator of its own, deleted with a tensor alive", "returned", """
plug = m.CUDAPluggableAllocator(os.path.join(FAKES, "libfakealloc.so"), "fake_malloc", "fake_free")
pool = m.MemPool(plug.allocator())
with m.use_mem_pool(pool, device=0):
    p = alloc(1000)
del pool
free(p)
"""),
    ("user metadata and annotations", "returned", """
if hasattr(C, "_cuda_setMemoryMetadata"):
    C._cuda_setMemoryMetadata("step 3"); C._cuda_getMemoryMetadata()
if hasattr(C, "_cuda_annotateMemory"):
    p = alloc(1000); C._cuda_annotateMemory(p, "weights"); free(p)
if hasattr(C, "_cuda_allocationTraceback"):
    p = alloc(1000); C._cuda_allocationTraceback(p); free(p)
"""),
    ("PyTorch's own settings", "returned", """
m._set_allocator_settings("max_split_size_mb:100")
m._set_allocator_settings("expandable_segments:True")
m._set_allocator_settings("expandable_segments:False")
"""),
    ("IPC collection and cuBLAS workspaces", "returned", "C._cuda_ipc_collect(); C._cuda_clearCublasWorkspaces()"),
    ("four threads allocating, freeing, emptying and reading", "returned", """
errors = []
def work(seed):
    try:
        for i in range(200):
            p = alloc(((seed * 7919 + i * 104729) % (8 << 20)) + 1)
            if i % 17 == 0: m.empty_cache()
            if i % 23 == 0: m.memory_stats(0); m.memory_snapshot()
            free(p)
    except BaseException as error:
        errors.append(error)
threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
for t in threads: t.start()
for t in threads: t.join()
if errors: raise errors[0]
"""),
    ("a tagged tensor dropped while its tag sleeps, its memory free at the wake", "returned", """
import cuvmm_torch
with cuvmm_torch.region("dropped"):
    p = alloc(3 << 20)
cuvmm_torch.sleep("dropped", device=0)
free(p)
stat = lambda key: C._cuda_memoryStats(0)[key]["all"]["current"]
assert stat("allocated_bytes") == 0, "freed at once, as PyTorch counts a free"
assert stat("active_bytes") > 0, "its memory waits for the wake"
cuvmm_torch.wake("dropped", device=0)
assert stat("active_bytes") == 0, stat("active_bytes")
"""),
    ("everything given back at the end", "returned", """
m.empty_cache()
s = C._cuda_memoryStats(0)
assert s["allocated_bytes"]["all"]["current"] == 0 and s["reserved_bytes"]["all"]["current"] == 0, s
"""),
]

# Runs CALLS (argv[1], as JSON), printing a line as each starts and one with what it did, so that a process
# that dies names its call.
SWEEP_PROBE = r"""
import json, os, sys, threading, torch, cuvmm_torch
C, m = torch._C, torch.cuda.memory
cuvmm_torch.install(cpp=True)
torch.cuda._initialized = True  # the stand-ins cannot answer PyTorch's lazy initialization
scope = {"C": C, "m": m, "os": os, "threading": threading, "FAKES": os.environ["LD_LIBRARY_PATH"],
         "alloc": lambda n: C._cuda_cudaCachingAllocator_raw_alloc(n, 0),
         "free": C._cuda_cudaCachingAllocator_raw_delete}
for name, _, code in json.loads(sys.argv[1]):
    print(json.dumps({"started": name}), flush=True)
    try:
        exec(code, dict(scope))
        did, message = "returned", ""
    except Exception as error:
        did, message = type(error).__name__, str(error)
    print(json.dumps({"call": name, "did": did, "message": message[:500]}), flush=True)
"""


@unittest.skipIf(missing_for_build(), missing_for_build())
class NoCallAborts(unittest.TestCase):
    """Each call in CALLS, through PyTorch's own entry points with the C++ layer installed, does what its entry
    says: returns, or raises that Python exception (PyTorch's, where a program's mistake has PyTorch's allocator
    raise one; on the paths a destructor reaches, a free of a pointer never given or a release of a pool never
    begun, cuvmm warns instead, since a throw there ends the process). None kills the process or hangs it."""

    @classmethod
    def setUpClass(cls):
        cls.scratch = stand_ins((FAKE_ALLOC, "libfakealloc.so", []))
        fakes = cls.scratch.name
        env = probe_environment(LD_PRELOAD=os.path.join(fakes, "libfakecudart.so"), LD_LIBRARY_PATH=fakes)
        try:
            done = subprocess.run([sys.executable, "-c", SWEEP_PROBE, json.dumps(CALLS)], env=env,
                                  capture_output=True, text=True, timeout=600, check=False)
            cls.returncode, stdout, cls.stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as expired:
            cls.returncode, stdout, cls.stderr = "a hang (killed after 600 s)", expired.stdout or "", ""
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        cls.started = [line["started"] for line in lines if "started" in line]
        cls.did = {line["call"]: line for line in lines if "call" in line}

    @classmethod
    def tearDownClass(cls):
        cls.scratch.cleanup()

    def test_the_process_lives_through_every_call(self):
        last = self.started[-1] if self.started else "(none started)"
        self.assertEqual(self.returncode, 0, f"the process ended in {last!r}:\n{self.stderr[-4000:]}")
        self.assertEqual(list(self.did), [name for name, _, _ in CALLS])

    def test_each_call_returns_or_raises_as_pytorch_does(self):
        for name, expected, _ in CALLS:
            with self.subTest(name):
                self.assertIn(name, self.did, "never finished")
                self.assertEqual(self.did[name]["did"], expected, self.did[name]["message"])


@unittest.skipIf(missing_for_install(), missing_for_install())
class Fallback(unittest.TestCase):
    def test_cuvmm_torch_cpp_0_takes_the_ctypes_path_and_says_what_it_lacks(self):
        out = run_probe(FALLBACK_PROBE, CUVMM_TORCH_CPP="0")
        self.assertEqual(out["layer"], "ctypes")
        self.assertNotEqual(out["backend"], "cuvmm")
        self.assertTrue(any("CUVMM_TORCH_CPP=0" in w and "record_stream" in w for w in out["warnings"]), out)


# A training script that knows nothing of cuvmm: what PyTorch says of its allocator when the script starts.
UNCHANGED_SCRIPT = r"""
import json, os, sys, torch
C = torch._C
initialized = torch.cuda.is_initialized()
print(json.dumps({"argv": sys.argv[1:], "rank": os.environ.get("LOCAL_RANK"), "cuda_initialized": initialized,
                  "backend": torch.cuda.memory.get_allocator_backend(), "fraction": C._cuda_getMemoryFraction(0),
                  "reserved": C._cuda_memoryStats(0)["reserved_bytes"]["all"]["current"]}))
"""


@unittest.skipIf(missing_for_build(), missing_for_build())
class RunUnchanged(unittest.TestCase):
    """`python -m cuvmm_torch SCRIPT.py` (also under torchrun) and CUVMM_TORCH_AUTOINSTALL=1 with a real PyTorch:
    cuvmm is PyTorch's allocator through the C++ layer when the script starts, configured by CUVMM_ALLOC_CONF,
    and no device was touched to install it."""

    @classmethod
    def setUpClass(cls):
        cls.scratch = tempfile.TemporaryDirectory()
        cls.script = os.path.join(cls.scratch.name, "train.py")
        with open(cls.script, "w") as file:
            file.write(UNCHANGED_SCRIPT)

    @classmethod
    def tearDownClass(cls):
        cls.scratch.cleanup()

    def reports(self, args, **env):
        out = run_python(args, CUVMM_TORCH_CPP="1", CUVMM_ALLOC_CONF="per_process_memory_fraction:0.25", **env)
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def check(self, report, argv):
        self.assertEqual(report["argv"], argv)
        self.assertFalse(report["cuda_initialized"], "installing cuvmm initialized no CUDA device")
        self.assertEqual(report["backend"], "cuvmm")
        self.assertEqual(report["fraction"], 0.25, "CUVMM_ALLOC_CONF reached cuvmm")
        self.assertEqual(report["reserved"], 0)

    def test_python_m_cuvmm_torch(self):
        (report,) = self.reports(["-m", "cuvmm_torch", self.script, "--steps", "3"])
        self.check(report, ["--steps", "3"])
        self.assertIsNone(report["rank"])

    def test_each_torchrun_rank(self):
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "cuvmm_torch", self.script, "--steps", "3"]
        reports = self.reports(args, CUVMM_SIM_DEVICES="2", OMP_NUM_THREADS="1")
        self.assertEqual(sorted(r["rank"] for r in reports), ["0", "1"])
        for report in reports:
            self.check(report, ["--steps", "3"])

    def test_the_environment_variable_with_the_pth_line(self):
        # Installed, the interpreter runs the .pth file itself; from a checkout, its line is run first.
        with open(os.path.join(HERE, "cuvmm_torch_autoinstall.pth")) as file:
            line = file.read().strip()
        prelude = "import sys\n" if INSTALLED else f"import sys\nexec({line!r})\n"
        code = prelude + f"sys.argv = ['train.py', '--steps', '3']\nexec(compile(open({self.script!r}).read(), 'train.py', 'exec'))\n"
        (report,) = self.reports(["-c", code], CUVMM_TORCH_AUTOINSTALL="1")
        self.check(report, ["--steps", "3"])


class CudaRuntime(unittest.TestCase):
    """Which CUDA runtime the layer builds against (no PyTorch needed)."""

    def setUp(self):
        scratch = tempfile.TemporaryDirectory()
        self.addCleanup(scratch.cleanup)
        self.root = scratch.name
        self.maps = os.path.join(self.root, "maps")

    def install(self, prefix, library_dir="lib", headers=True, crt=True):
        """A runtime at `prefix`: its library, and (as asked) its API header and crt/host_config.h."""
        os.makedirs(os.path.join(prefix, library_dir), exist_ok=True)
        os.makedirs(os.path.join(prefix, "include", "crt"), exist_ok=True)
        library = os.path.join(prefix, library_dir, "libcudart.so.13")
        open(library, "w").close()
        if headers:
            open(os.path.join(prefix, "include", "cuda_runtime_api.h"), "w").close()
        if crt:
            open(os.path.join(prefix, "include", "crt", "host_config.h"), "w").close()
        return library

    def write_maps(self, *libraries):
        with open(self.maps, "w") as maps:
            maps.write("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
            for library in libraries:
                maps.write(f"7f10-7f20 r-xp 00000000 08:01 2 {library}\n")

    def test_pytorchs_own_runtime_and_the_headers_beside_it_come_first(self):
        wheel = self.install(os.path.join(self.root, "nvidia", "cu13"))
        toolkit = os.path.join(self.root, "cuda")
        self.install(toolkit, "lib64")
        self.write_maps(wheel)
        include, flags = cuvmm_torch.cuda_runtime(self.maps, cuda_home=toolkit)
        self.assertEqual(include, [os.path.join(self.root, "nvidia", "cu13", "include")])
        self.assertEqual(flags, [wheel])

    def test_pytorchs_headers_without_crt_take_it_from_the_toolkit_or_a_package_beside(self):
        # As on a GPU machine's PyTorch 2.11 (cu130): nvidia/cu13/include has cuda_runtime.h, not crt/.
        wheel = self.install(os.path.join(self.root, "nvidia", "cu13"), crt=False)
        toolkit = os.path.join(self.root, "cuda")
        self.install(toolkit, "lib64")
        self.write_maps(wheel)
        own = os.path.join(self.root, "nvidia", "cu13", "include")
        include, flags = cuvmm_torch.cuda_runtime(self.maps, cuda_home=toolkit)
        self.assertEqual(include, [own, os.path.join(toolkit, "include")])
        self.assertEqual(flags, [wheel], "still PyTorch's own runtime")
        self.install(os.path.join(self.root, "nvidia", "cuda_nvcc"), headers=False)
        include, flags = cuvmm_torch.cuda_runtime(self.maps, cuda_home=None)
        self.assertEqual(include, [own, os.path.join(self.root, "nvidia", "cuda_nvcc", "include")])
        self.assertEqual(flags, [wheel])

    def test_headers_without_crt_anywhere_are_a_clear_error(self):
        wheel = self.install(os.path.join(self.root, "nvidia", "cu13"), crt=False)
        self.write_maps(wheel)
        with self.assertRaisesRegex(RuntimeError, "has no crt/host_config.h.*CUDA_HOME"):
            cuvmm_torch.cuda_runtime(self.maps, cuda_home=None)

    def test_a_toolkit_when_pytorchs_runtime_has_no_headers_beside_it(self):
        self.write_maps(self.install(os.path.join(self.root, "bare"), headers=False))
        toolkit = os.path.join(self.root, "cuda")
        self.install(toolkit, "lib64")
        include, flags = cuvmm_torch.cuda_runtime(self.maps, cuda_home=toolkit)
        self.assertEqual(include, [os.path.join(toolkit, "include")])
        self.assertEqual(flags, [f"-L{os.path.join(toolkit, 'lib64')}", "-lcudart"])

    def test_neither_is_a_clear_error(self):
        bare = self.install(os.path.join(self.root, "bare"), headers=False)
        self.write_maps(bare)
        for home in [None, os.path.join(self.root, "nowhere")]:
            with self.assertRaisesRegex(RuntimeError, "CUDA_HOME") as caught:
                cuvmm_torch.cuda_runtime(self.maps, cuda_home=home)
            self.assertIn(bare, str(caught.exception))
        with self.assertRaisesRegex(RuntimeError, "none loaded"):
            cuvmm_torch.cuda_runtime(os.path.join(self.root, "no-maps"), cuda_home=None)


if __name__ == "__main__":
    unittest.main()
