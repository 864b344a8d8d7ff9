"""Cases 13 to 17 (issue 41): ``torch.cuda.MemPool`` (use_count, deletion, ``no_split``, ``use_on_oom``, an
allocator of its own), ``torch.compile(mode="reduce-overhead")`` training with two shapes, IPC between cuvmm
and PyTorch's own allocators, and a vLLM-style sleep mode on a pluggable ``MemPool``.

The pluggable allocators are compiled here with the C compiler the C++ layer's build uses (``cc``), against
the CUDA headers PyTorch's wheel brings (``cuvmm_torch.cuda_runtime``); they call the CUDA runtime PyTorch
loaded (found with ``dlopen(RTLD_NOLOAD)``) or the driver (``libcuda.so.1``), so they need no CUDA toolkit.
"""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

from . import (  # the framework, in __init__.py
    GIB,
    MIB,
    ROOT,
    SkipCase,
    _first_line,
    _max_diff,
    case,
    check,
)

# A pluggable allocator over cudaMalloc (vLLM's and NCCL's pools are built this way), counting its calls.
CUDA_MALLOC_ALLOCATOR = r"""
#include <dlfcn.h>
#include <stddef.h>
#include <sys/types.h>
typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
static malloc_fn cuda_malloc;
static free_fn cuda_free;
static int calls, frees;
static size_t sizes[256];
static unsigned long long ptrs[256];
static void find(void) {
    const char *names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
    for (int i = 0; i < 3 && !cuda_malloc; ++i) {
        void *lib = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD);
        if (lib) { cuda_malloc = (malloc_fn)dlsym(lib, "cudaMalloc"); cuda_free = (free_fn)dlsym(lib, "cudaFree"); }
    }
}
void *plug_malloc(ssize_t size, int device, void *stream) {
    (void)device; (void)stream;
    void *p = 0;
    find();
    if (!cuda_malloc || cuda_malloc(&p, (size_t)size) != 0) return 0;
    if (calls < 256) { sizes[calls] = (size_t)size; ptrs[calls] = (unsigned long long)p; }
    calls++;
    return p;
}
void plug_free(void *p, ssize_t size, int device, void *stream) {
    (void)size; (void)device; (void)stream;
    find();
    if (cuda_free) cuda_free(p);
    frees++;
}
int plug_calls(void) { return calls; }
int plug_frees(void) { return frees; }
size_t plug_size(int i) { return sizes[i]; }
unsigned long long plug_ptr(int i) { return ptrs[i]; }
"""

# vLLM's CuMemAllocator in C: each allocation its own reservation and physical handle (cuMemCreate,
# cuMemMap); sleep unmaps and releases every handle, keeping the addresses; wake maps new ones there.
SLEEP_ALLOCATOR = r"""
#include <cuda.h>
#include <dlfcn.h>
#include <stddef.h>
#include <sys/types.h>
#define MAX 4096
typedef CUresult (*create_t)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*release_t)(CUmemGenericAllocationHandle);
typedef CUresult (*reserve_t)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*free_va_t)(CUdeviceptr, size_t);
typedef CUresult (*map_t)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*unmap_t)(CUdeviceptr, size_t);
typedef CUresult (*access_t)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*granularity_t)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
typedef CUresult (*sync_t)(void);
static create_t create; static release_t release; static reserve_t reserve; static free_va_t free_va;
static map_t map; static unmap_t unmap; static access_t access; static granularity_t granularity; static sync_t sync;
static struct { CUdeviceptr ptr; size_t size; CUmemGenericAllocationHandle handle; int device, live, asleep; } table[MAX];
static int loaded;
static int load(void) {
    if (loaded) return loaded > 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    loaded = -1;
    if (!lib) return 0;
    create = (create_t)dlsym(lib, "cuMemCreate"); release = (release_t)dlsym(lib, "cuMemRelease");
    reserve = (reserve_t)dlsym(lib, "cuMemAddressReserve"); free_va = (free_va_t)dlsym(lib, "cuMemAddressFree");
    map = (map_t)dlsym(lib, "cuMemMap"); unmap = (unmap_t)dlsym(lib, "cuMemUnmap");
    access = (access_t)dlsym(lib, "cuMemSetAccess");
    granularity = (granularity_t)dlsym(lib, "cuMemGetAllocationGranularity");
    sync = (sync_t)dlsym(lib, "cuCtxSynchronize");
    loaded = create && release && reserve && free_va && map && unmap && access && granularity && sync ? 1 : -1;
    return loaded > 0;
}
static CUmemAllocationProp prop_of(int device) {
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    return prop;
}
static int back(int i) {
    CUmemAllocationProp prop = prop_of(table[i].device);
    CUmemAccessDesc desc = {0};
    desc.location = prop.location;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (create(&table[i].handle, table[i].size, &prop, 0) != CUDA_SUCCESS) return -1;
    if (map(table[i].ptr, table[i].size, 0, table[i].handle, 0) != CUDA_SUCCESS) return -1;
    return access(table[i].ptr, table[i].size, &desc, 1) == CUDA_SUCCESS ? 0 : -1;
}
void *sleepy_malloc(ssize_t size, int device, void *stream) {
    (void)stream;
    if (!load()) return 0;
    CUmemAllocationProp prop = prop_of(device);
    size_t g = 0;
    granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    size_t rounded = ((size_t)size + g - 1) / g * g;
    for (int i = 0; i < MAX; ++i) {
        if (table[i].live) continue;
        table[i].size = rounded; table[i].device = device; table[i].asleep = 0;
        if (reserve(&table[i].ptr, rounded, 0, 0, 0) != CUDA_SUCCESS) return 0;
        if (back(i) != 0) return 0;
        table[i].live = 1;
        return (void *)table[i].ptr;
    }
    return 0;
}
void sleepy_free(void *p, ssize_t size, int device, void *stream) {
    (void)size; (void)device; (void)stream;
    for (int i = 0; i < MAX; ++i) {
        if (!table[i].live || table[i].ptr != (CUdeviceptr)p) continue;
        if (!table[i].asleep) { unmap(table[i].ptr, table[i].size); release(table[i].handle); }
        free_va(table[i].ptr, table[i].size);
        table[i].live = 0;
    }
}
/* Gives every live allocation's memory back (its contents are lost); returns the bytes. */
long long sleepy_sleep(void) {
    long long bytes = 0;
    sync();
    for (int i = 0; i < MAX; ++i) {
        if (!table[i].live || table[i].asleep) continue;
        unmap(table[i].ptr, table[i].size); release(table[i].handle);
        table[i].asleep = 1; bytes += (long long)table[i].size;
    }
    return bytes;
}
/* Maps new memory at every sleeping allocation's addresses; 0, or -1. */
int sleepy_wake(void) {
    for (int i = 0; i < MAX; ++i) {
        if (!table[i].live || !table[i].asleep) continue;
        if (back(i) != 0) return -1;
        table[i].asleep = 0;
    }
    return 0;
}
long long sleepy_live_bytes(void) {
    long long bytes = 0;
    for (int i = 0; i < MAX; ++i) if (table[i].live) bytes += (long long)table[i].size;
    return bytes;
}
"""


def _compile(source, name, folder, includes=()):
    """A shared library from `source` (C), in `folder`; its path."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SkipCase("no C compiler for the pluggable allocator")
    path = os.path.join(folder, f"lib{name}.so")
    with open(path + ".c", "w") as f:
        f.write(source)
    flags = [f"-I{include}" for include in includes]
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O1", *flags, "-o", path, path + ".c", "-ldl"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {name}: {done.stderr[-600:]}")
    return path


def _cuda_includes():
    """The CUDA headers of PyTorch's wheel (or CUDA_HOME's), as the C++ layer's build finds them."""
    python = os.path.join(ROOT, "python")
    if python not in sys.path:
        sys.path.insert(0, python)
    import cuvmm_torch  # noqa: PLC0415 (only its search for the headers)

    from torch.utils import cpp_extension  # noqa: PLC0415

    return cuvmm_torch.cuda_runtime(cuda_home=cpp_extension.CUDA_HOME)[0]


def _pool_blocks(torch, pool):
    """The allocated blocks of a MemPool's snapshot: (address, size, requested)."""
    return [(b["address"], b["size"], b["requested_size"]) for s in pool.snapshot()
            for b in s["blocks"] if b["state"] == "active_allocated"]


# --- 13. MemPool -----------------------------------------------------------------------------------------------


@case("mempool", "torch.cuda.MemPool made, used (use_mem_pool), counted (use_count 1, 2 inside, 1 after), its "
      "tensors correct, in its snapshot and in memory_stats()'s reserved_bytes_by_private_pools; deleted while one of its tensors lives (no abort; the tensor stays "
      "correct) and its memory given back once that is freed; no_split: each allocation a whole segment (2 MiB "
      "or more); use_on_oom: under a memory fraction, a request that fails without it is served by the pool",
      timeout=120, fresh=True)
def mempool(ctx):
    torch = ctx.torch
    dev = ctx.device
    torch.cuda.empty_cache()
    torch.zeros(1, device=dev)  # CUDA initialized before the pool's first allocation
    base_reserved = torch.cuda.memory_reserved(0)
    pool = torch.cuda.MemPool()
    counts = [pool.use_count()]
    with torch.cuda.use_mem_pool(pool):
        counts.append(pool.use_count())
        kept = torch.arange(MIB, dtype=torch.float32, device=dev)
        other = torch.full((3 * MIB,), 2.0, device=dev)
    counts.append(pool.use_count())
    # memory_stats()'s reserved_bytes_by_private_pools (PyTorch 2.13 on), flattened under the pool's id.
    pool_reserved = torch.cuda.memory_stats(0).get("reserved_bytes_by_private_pools.%d_%d.all.current" % pool.id)
    blocks = _pool_blocks(torch, pool)
    in_snapshot = {kept.data_ptr(), other.data_ptr()} <= {b[0] for b in blocks}
    del other
    del pool  # ~MemPool: setUseOnOOM(false), releasePool, emptyCache(pool)
    torch.cuda.synchronize()
    kept_diff = _max_diff(torch, kept, torch.arange(MIB, dtype=torch.float32))
    del kept
    torch.cuda.empty_cache()
    reserved_after = torch.cuda.memory_reserved(0)
    ctx.figures.update(use_counts=counts, pool_blocks=len(blocks), kept_diff=kept_diff,
                       reserved=[base_reserved, reserved_after], pool_reserved=pool_reserved)
    check(counts == [1, 2, 1], f"use_count {counts}, PyTorch's is [1, 2, 1]")
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13):
        check(pool_reserved is not None and pool_reserved >= 16 * MIB,
              f"memory_stats() gives the pool's reserved bytes as {pool_reserved}, not its 16 MiB or more")
    check(in_snapshot, "the pool's snapshot does not list its tensors")
    check(kept_diff == 0, f"a tensor of a deleted pool changed (max diff {kept_diff})")
    check(reserved_after <= base_reserved, f"reserved {reserved_after} after the pool was deleted and emptied, "
          f"{base_reserved} before it")

    split = torch.cuda.MemPool(no_split=True)
    with torch.cuda.use_mem_pool(split):
        a = torch.full((256,), 1.0, device=dev)
        b = torch.full((256,), 2.0, device=dev)
    sizes = sorted(s for _, s, _ in _pool_blocks(torch, split))
    ctx.figures.update(no_split_block_sizes=sizes)
    check(len(sizes) == 2 and min(sizes) >= 2 * MIB, f"no_split pool's blocks {sizes}: split below 2 MiB")
    check(_max_diff(torch, a + b, torch.full((256,), 3.0)) == 0, "no_split pool's tensors are wrong")
    del a, b, split

    results = {}
    for use_on_oom in (False, True):
        torch.cuda.empty_cache()
        lender = torch.cuda.MemPool(use_on_oom=use_on_oom)
        with torch.cuda.use_mem_pool(lender):
            t = torch.empty(2 * GIB, dtype=torch.uint8, device=dev)
        del t  # 2 GiB free in a live pool
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved(0) + GIB // 2) / total))
        try:
            x = torch.empty(3 * GIB // 2, dtype=torch.uint8, device=dev)
            x.fill_(7)
            results[use_on_oom] = "allocated" if x.min().item() == 7 == x.max().item() else "wrong contents"
            del x
        except torch.OutOfMemoryError as e:
            results[use_on_oom] = _first_line(e)[:80]
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        del lender
    ctx.figures.update(use_on_oom=results)
    check(results[False] != "allocated", "without use_on_oom the request over the fraction succeeded: the case "
          "does not test the pool")
    # PyTorch's expandable segments look for a fallback block among non-expandable ones only, and a pool
    # without an allocator of its own is expandable there: its own column shows what PyTorch does.
    if ctx.allocator != "expandable":
        check(results[True] == "allocated", f"use_on_oom pool: {results[True]}")
    return f"use_count {counts}; no_split blocks {sizes}; use_on_oom served 1.5 GiB"


@case("mempool_own_allocator", "a MemPool over a CUDAPluggableAllocator of cudaMalloc (as vLLM's and NCCL's "
      "pools are built): tensors of 1 KiB, 3 MiB, 30 MiB in it are correct and lie in memory that allocator "
      "returned; a tensor outside the pool does not; every segment it gave is given back once the pool is "
      "deleted and the cache emptied", timeout=120, fresh=True)
def mempool_own_allocator(ctx):
    torch = ctx.torch
    dev = ctx.device
    with tempfile.TemporaryDirectory() as folder:
        path = _compile(CUDA_MALLOC_ALLOCATOR, "plug", folder)
        lib = ctypes.CDLL(path)
        lib.plug_size.restype, lib.plug_ptr.restype = ctypes.c_size_t, ctypes.c_ulonglong
        plug = torch.cuda.memory.CUDAPluggableAllocator(path, "plug_malloc", "plug_free")
        torch.zeros(1, device=dev)
        pool = torch.cuda.MemPool(plug.allocator())
        with torch.cuda.use_mem_pool(pool):
            tensors = [torch.arange(n, dtype=torch.float32, device=dev) for n in (256, 3 * MIB // 4, 30 * MIB // 4)]
        outside = torch.arange(256, dtype=torch.float32, device=dev)
        torch.cuda.synchronize()
        segments = [(lib.plug_ptr(i), lib.plug_size(i)) for i in range(lib.plug_calls())]

        def served(t):
            return any(p <= t.data_ptr() < p + s for p, s in segments)

        diffs = [_max_diff(torch, t, torch.arange(t.numel(), dtype=torch.float32)) for t in tensors]
        inside = [served(t) for t in tensors]
        ctx.figures.update(segment_sizes=[s for _, s in segments], inside=inside, outside=served(outside),
                           max_abs_diff=max(diffs))
        del tensors, outside
        del pool
        torch.cuda.empty_cache()
        frees = lib.plug_frees()
        ctx.figures.update(frees=frees)
        check(max(diffs) == 0, f"tensors of the pool differ by {diffs}")
        check(all(inside), f"tensors of the pool outside its allocator's memory: {inside}")
        check(not ctx.figures["outside"], "a tensor outside the pool came from the pool's allocator")
        check(frees == len(segments), f"{frees} of {len(segments)} segments given back to the pool's allocator")
    return f"segments {ctx.figures['segment_sizes']}, all given back"


# --- 14. torch.compile training with two shapes ----------------------------------------------------------------


@case("compile_train_two_shapes", "torch.compile(mode='reduce-overhead') trains a small MLP 10 steps with "
      "batches of 64 and 40 alternating (cudagraph trees record both and rewind their pool); every loss equals "
      "eager's within 1e-5, and the weights at the end within 1e-4", timeout=300, fresh=True)
def compile_train_two_shapes(ctx):
    import copy  # noqa: PLC0415

    torch = ctx.torch
    nn = torch.nn
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 10)).to(ctx.device)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, mode="reduce-overhead")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, twin)]
    generator = torch.Generator().manual_seed(3)
    losses, bad = [], []
    for step in range(10):
        batch = 64 if step % 2 == 0 else 40
        x = torch.randn(batch, 64, generator=generator).to(ctx.device)
        y = torch.randint(0, 10, (batch,), generator=generator).to(ctx.device)
        pair = []
        for model, optimizer in zip((eager, compiled), optimizers):
            if model is compiled:
                torch.compiler.cudagraph_mark_step_begin()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pair.append(loss.item())
        losses.append(pair)
        if abs(pair[0] - pair[1]) > 1e-5 * max(1.0, abs(pair[0])):
            bad.append(f"step {step} (batch {batch}): eager {pair[0]:.7f}, compiled {pair[1]:.7f}")
    weights = max(_max_diff(torch, a, b) for a, b in zip(eager.parameters(), twin.parameters()))
    ctx.figures.update(losses_eager_compiled=[[round(a, 7), round(b, 7)] for a, b in losses],
                       max_weight_diff=weights)
    check(not bad, "; ".join(bad[:3]))
    check(weights <= 1e-4, f"weights differ by {weights:.3g} after training")
    return f"10 steps, two shapes; max loss diff {max(abs(a - b) for a, b in losses):.2g}"


# --- 15, 16. torch.multiprocessing between cuvmm and PyTorch's own allocators ---------------------------------


def _open_descriptors():
    return len(os.listdir("/proc/self/fd"))


def _send_to_child(ctx, child_allocator, sizes=(4 * MIB, 1000, 25 * MIB), opened=None):
    """Sends CUDA tensors of `sizes` floats to a spawned child on `child_allocator`, which writes 2t+1 into
    each; returns (ok, detail). `opened`, a dict, gets the descriptors the sending opened in this process."""
    import torch.multiprocessing as mp  # noqa: PLC0415

    from .features import mp_answer, mp_child, ramp  # noqa: PLC0415

    torch = ctx.torch
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    process = spawn.Process(target=mp_child, args=(child_allocator, child), daemon=True)
    process.start()
    child.close()
    try:
        tensors = [ramp(torch, n).to(ctx.device) for n in sizes]
        neighbour = torch.full((1000,), 7.0, device=ctx.device)
        torch.cuda.synchronize()
        before = _open_descriptors()
        parent.send(tensors)
        if opened is not None:
            opened["descriptors"] = _open_descriptors() - before
        answer, info = mp_answer(process, parent, 90)
        if answer != "ok":
            return False, info if answer is None else f"in the child: {info}"
        diffs = [_max_diff(torch, t, ramp(torch, t.numel()) * 2 + 1) for t in tensors]
        if max(diffs) != 0 or _max_diff(torch, neighbour, torch.full((1000,), 7.0)) != 0:
            return False, f"the parent sees {diffs} off the child's writes (or its neighbour changed)"
        parent.send("done")
        process.join(30)
        return True, "ok"
    finally:
        if process.is_alive():
            process.terminate()
            process.join(10)


@case("ipc_cuvmm_to_pytorch", "a cuvmm parent sends CUDA tensors (4 MiB, 1000 floats sharing a page, 25 MiB) "
      "with torch.multiprocessing to a child on PyTorch's default allocator, then to one on "
      "expandable_segments:True; each child writes 2t+1 and the parent sees it", timeout=240,
      allocators=("cuvmm",))
def ipc_cuvmm_to_pytorch(ctx):
    outcomes = {child: _send_to_child(ctx, child) for child in ("native", "expandable")}
    ctx.figures.update({child: detail for child, (_, detail) in outcomes.items()})
    bad = [f"{child}: {detail}" for child, (ok, detail) in outcomes.items() if not ok]
    check(not bad, "; ".join(bad))
    return "both children opened cuvmm's tensors"


@case("ipc_pytorch_to_cuvmm", "a parent on PyTorch's allocator (default, or expandable segments) sends CUDA "
      "tensors to a child on cuvmm and, as the reference, to one on its own allocator: the cuvmm child opens "
      "them whenever the reference does (expandable segments' descriptors need ptrace rights: where the "
      "reference is refused too, the case is skipped)", timeout=240, allocators=("native", "expandable"))
def ipc_pytorch_to_cuvmm(ctx):
    reference_ok, reference = _send_to_child(ctx, ctx.allocator)
    ok, detail = _send_to_child(ctx, "cuvmm")
    ctx.figures.update(reference=reference, cuvmm=detail)
    if not reference_ok and not ok and "pidfd" in (reference + detail).lower():
        raise SkipCase(f"PyTorch's own child is refused too: {reference}")
    check(ok, f"the cuvmm child: {detail} (PyTorch's own child: {reference})")
    return "the cuvmm child opened PyTorch's tensors" + ("" if reference_ok else f" (its own: {reference})")


@case("ipc_many_tensors", "a parent sends 2000 tensors of 1000 floats and 40 of 1.5 MiB in one message to a "
      "child on PyTorch's default allocator (a model's parameters to an inference worker), which writes 2t+1 "
      "into each: the parent sees it, and the sending holds a descriptor per physical handle, not per tensor "
      "(at most 100 more open; one per tensor would pass ulimit -n 1024)", timeout=240)
def ipc_many_tensors(ctx):
    sizes = (1000,) * 2000 + (3 * MIB // 8,) * 40
    opened = {}
    ok, detail = _send_to_child(ctx, "native", sizes, opened)
    ctx.figures.update(child=detail, tensors=len(sizes), descriptors_opened=opened.get("descriptors"))
    check(ok, f"the child: {detail}")
    if ctx.allocator != "native":
        check(opened["descriptors"] <= 100, f"{opened['descriptors']} descriptors opened for {len(sizes)} tensors")
    return f"{len(sizes)} tensors, {opened['descriptors']} descriptors opened by the sending"


# --- 17. a vLLM-style sleep mode on a pluggable MemPool -----------------------------------------------------


@case("sleep_mode_pool", "vLLM's sleep mode: a model's weights and a KV cache allocated in a MemPool over a "
      "pluggable allocator of cuMemCreate'd memory, the pool's unused segments freed by that allocator as vLLM "
      "does when the region ends; its output is computed, the weights copied to the host, "
      "the pool's memory given back (free device memory grows by it) while other work allocates, mapped again "
      "at the same addresses and the weights copied back: the output is the same", timeout=180, fresh=True)
def sleep_mode_pool(ctx):
    torch = ctx.torch
    nn = torch.nn
    dev = ctx.device
    with tempfile.TemporaryDirectory() as folder:
        path = _compile(SLEEP_ALLOCATOR, "sleepy", folder, _cuda_includes())
        lib = ctypes.CDLL(path)
        lib.sleepy_sleep.restype = lib.sleepy_live_bytes.restype = ctypes.c_longlong
        plug = torch.cuda.memory.CUDAPluggableAllocator(path, "sleepy_malloc", "sleepy_free")
        torch.zeros(1, device=dev)
        pool = torch.cuda.MemPool(plug.allocator())
        torch.manual_seed(0)
        with torch.cuda.use_mem_pool(pool):
            model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(dev)
            kv_cache = torch.zeros(64 * MIB // 4, device=dev)
            scratch = torch.empty(48 * MIB, dtype=torch.uint8, device=dev)  # loading's temporary (its own segment)
            scratch_ptr = scratch.data_ptr()
            del scratch
        # vLLM's use_memory_pool ends so: every segment of the pool's snapshot with nothing allocated is given
        # back by the pool's allocator itself, behind the caching allocator's back (the caching allocator
        # then still lists it, and hands it back to the allocator when the pool goes: a free of nothing).
        torch.cuda.synchronize()
        unused = [s["address"] for s in pool.snapshot() if s["allocated_size"] == 0]
        for address in unused:
            lib.sleepy_free(ctypes.c_void_p(address), ctypes.c_ssize_t(0), 0, None)
        ctx.figures.update(unused_segments=len(unused))
        check(scratch_ptr in unused, f"the freed temporary's segment ({scratch_ptr:#x}) is not among the pool's "
              f"unused segments {[hex(a) for a in unused]}: vLLM would free a pointer its allocator never gave")
        x = torch.randn(32, 1024, device=dev)
        with torch.no_grad():
            before = model(x).cpu()
        kv_ptr, weight_ptrs = kv_cache.data_ptr(), [p.data_ptr() for p in model.parameters()]
        offloaded = [p.detach().cpu() for p in model.parameters()]
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        slept = lib.sleepy_sleep()
        free_asleep, _ = torch.cuda.mem_get_info()
        busy = [torch.randn(4 * MIB, device=dev) for _ in range(4)]  # other work while asleep
        torch.cuda.synchronize()
        del busy
        check(lib.sleepy_wake() == 0, "waking the pool failed")
        with torch.no_grad():
            for param, saved in zip(model.parameters(), offloaded):
                param.copy_(saved)
            # The loop's variable would keep the last parameter (a bias in the pool's 2 MiB segment) alive
            # past `del model`: on an H200 both PyTorch's allocator and cuvmm then left that segment held.
            del param
            kv_cache.zero_()
            after = model(x).cpu()
        diff = _max_diff(torch, after, before)
        ctx.figures.update(slept_bytes=slept, freed_bytes=free_asleep - free_before, max_abs_diff=diff,
                           same_addresses=kv_cache.data_ptr() == kv_ptr
                           and [p.data_ptr() for p in model.parameters()] == weight_ptrs)
        del model, kv_cache, x
        del pool
        torch.cuda.empty_cache()
        left = lib.sleepy_live_bytes()
        ctx.figures.update(left_in_allocator=left)
    check(slept > 0, "the pool's allocator held nothing to sleep: the model was not allocated in the pool")
    check(ctx.figures["freed_bytes"] >= slept * 0.9, f"sleep gave back {slept} bytes but free memory grew by "
          f"{ctx.figures['freed_bytes']}")
    check(diff == 0, f"the output after wake differs by {diff}")
    check(left == 0, f"{left} bytes still held by the pool's allocator after the pool was deleted")
    return f"slept {slept / MIB:.0f} MiB, same output after wake"

