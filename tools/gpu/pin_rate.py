#!/usr/bin/env python3
"""How fast a GPU machine pins host memory, each way cuvmm could (issue 44). A sleep with contents copies a
tag's bytes into page-locked host memory; the first sleep pins it, later ones reuse it. On an H200 VM
(2026-11-29), 16 GiB pinned by `cuMemHostAlloc` from four threads took 9.4 s (1.8 GB/s), while the copies ran
at 48 GB/s: the pinning is the first sleep's cost. This measures the ways of pinning, to choose one:

    python3 tools/gpu/pin_rate.py [--gib 8] [--piece-mib 64] [--threads 1,4,8]

- `alloc`: `cuMemHostAlloc` of each piece, the pieces shared among T threads (what cuvmm did until
  2026-11-30, T = 4; `pinned_use_cuda_host_register:False` since);
- `register`: ordinary memory (`mmap`), its pages faulted in by T threads (`memset`), then
  `cuMemHostRegister` of each piece by T threads;
- `register-huge`: the same, with `madvise(MADV_HUGEPAGE)` before the faults (transparent huge pages: 512
  times fewer pages to fault in and to lock). cuvmm's default since 2026-11-30 is this way, T = 8, each
  thread faulting in and registering its own pieces (`src/driver/cuda/host_pages.rs`).

Each way pins --gib GiB in pieces of --piece-mib MiB, timed from its first call to its last piece pinned
(`fault_s`, the faults alone, for the `register` ways), then copies one piece from the device into the
pinned memory eight times (`copy_gbps`): page-locked memory takes it at the link's speed, ordinary memory
far slower, so a pin that silently failed shows. Everything is freed before the next way.

Needs only the driver library (`libcuda.so.1`), not PyTorch. Prints one JSON object per (way, threads) on a
line of its own as soon as it is measured, then a table. Without a driver or a device: one line, `pin_rate: no
CUDA driver found: <reason>`, and status 2. A way that fails (the host cannot lock that much) is reported
with its error and the others still run; status 1 if any failed.
"""

import argparse
import ctypes
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

SCHEMA = "cuvmm-pin-rate/1"
MIB = 1 << 20
GIB = 1 << 30
WAYS = ("alloc", "register", "register-huge")
COPIES = 8

PROT_READ, PROT_WRITE = 0x1, 0x2
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
MADV_HUGEPAGE = 14
MAP_FAILED = ctypes.c_void_p(-1).value


class NoDriver(Exception):
    """No CUDA driver or device here."""


class CudaError(Exception):
    """A driver call failed."""


class Cuda:
    """The few driver calls used, on device 0's primary context."""

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise NoDriver(f"libcuda.so.1 could not be loaded ({e})") from None
        vp, sz, u64, ui = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint
        self.lib = lib
        signatures = {
            "cuInit": [ui],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), ctypes.c_int],
            "cuCtxSetCurrent": [vp],
            "cuCtxSynchronize": [],
            "cuMemHostAlloc": [ctypes.POINTER(vp), sz, ui],
            "cuMemFreeHost": [vp],
            "cuMemHostRegister_v2": [vp, sz, ui],
            "cuMemHostUnregister": [vp],
            "cuMemAlloc_v2": [ctypes.POINTER(u64), sz],
            "cuMemFree_v2": [u64],
            "cuMemcpyDtoH_v2": [vp, u64, sz],
        }
        for name, args in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = args, ctypes.c_int
        try:
            self.call("cuInit", 0)
            device = ctypes.c_int()
            self.call("cuDeviceGet", ctypes.byref(device), 0)
            self.ctx = ctypes.c_void_p()
            self.call("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), device.value)
        except CudaError as e:
            raise NoDriver(str(e)) from None
        self.current()

    def call(self, name, *args):
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise CudaError(f"{name} failed with CUDA error {status}")

    def current(self):
        """Makes the context current on the calling thread (each worker thread calls it first)."""
        self.call("cuCtxSetCurrent", self.ctx)


def libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.mmap.restype = ctypes.c_void_p
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def pieces(total, piece):
    """(offset, length) of each piece of `total` bytes."""
    return [(at, min(piece, total - at)) for at in range(0, total, piece)]


def in_threads(cuda, threads, work, items):
    """`work(item)` for each item, on `threads` threads with the context current; the results in order."""

    def run(item):
        cuda.current()
        return work(item)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(run, items))


def copy_rate(cuda, host_ptr, length):
    """GB/s of `COPIES` device-to-host copies of `length` bytes into `host_ptr`."""
    device = ctypes.c_uint64()
    cuda.call("cuMemAlloc_v2", ctypes.byref(device), length)
    try:
        cuda.call("cuMemcpyDtoH_v2", host_ptr, device.value, length)  # warm-up
        began = time.monotonic()
        for _ in range(COPIES):
            cuda.call("cuMemcpyDtoH_v2", host_ptr, device.value, length)
        cuda.call("cuCtxSynchronize")
        return round(COPIES * length / (time.monotonic() - began) / 1e9, 2)
    finally:
        cuda.call("cuMemFree_v2", device.value)


def pin_alloc(cuda, total, piece, threads):
    """`cuMemHostAlloc` of each piece, on `threads` threads: (figures, pointers to free)."""
    parts = pieces(total, piece)
    pointers = []

    def alloc(part):
        ptr = ctypes.c_void_p()
        cuda.call("cuMemHostAlloc", ctypes.byref(ptr), part[1], 0)
        pointers.append(ptr.value)
        return ptr.value

    began = time.monotonic()
    try:
        first = in_threads(cuda, threads, alloc, parts)[0]
        pin_s = time.monotonic() - began
        return {"pin_s": round(pin_s, 3), "copy_gbps": copy_rate(cuda, first, parts[0][1])}
    finally:
        for ptr in pointers:
            cuda.call("cuMemFreeHost", ptr)


def pin_register(cuda, total, piece, threads, huge):
    """Ordinary memory faulted in, then `cuMemHostRegister` of each piece, both on `threads` threads."""
    c = libc()
    base = c.mmap(None, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if base in (None, MAP_FAILED):
        raise CudaError(f"mmap of {total} bytes failed (errno {ctypes.get_errno()})")
    parts = pieces(total, piece)
    registered = []
    try:
        began = time.monotonic()
        if huge and c.madvise(base, total, MADV_HUGEPAGE) != 0:
            raise CudaError(f"madvise(MADV_HUGEPAGE) failed (errno {ctypes.get_errno()})")
        in_threads(cuda, threads, lambda part: ctypes.memset(base + part[0], 1, part[1]), parts)
        fault_s = time.monotonic() - began

        def register(part):
            cuda.call("cuMemHostRegister_v2", base + part[0], part[1], 0)
            registered.append(base + part[0])

        in_threads(cuda, threads, register, parts)
        pin_s = time.monotonic() - began
        return {"fault_s": round(fault_s, 3), "pin_s": round(pin_s, 3),
                "copy_gbps": copy_rate(cuda, base, parts[0][1])}
    finally:
        for ptr in registered:
            cuda.call("cuMemHostUnregister", ptr)
        c.munmap(base, total)


def measure(cuda, way, total, piece, threads):
    """One (way, threads): its JSON object."""
    result = {"suite": SCHEMA, "way": way, "threads": threads, "bytes": total, "piece_bytes": piece}
    try:
        if way == "alloc":
            figures = pin_alloc(cuda, total, piece, threads)
        else:
            figures = pin_register(cuda, total, piece, threads, huge=way == "register-huge")
    except CudaError as e:
        result["error"] = str(e)
        return result
    result.update(figures)
    result["gbps"] = round(total / figures["pin_s"] / 1e9, 2) if figures["pin_s"] > 0 else None
    return result


def table(results):
    lines = ["| way | threads | pinned GiB | fault s | pin s (from the start) | GB/s | copy into it GB/s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['way']} | {r['threads']} | {r['bytes'] / GIB:.0f} | error: {r['error']} | | | |")
            continue
        fault = r.get("fault_s", "-")
        lines.append(f"| {r['way']} | {r['threads']} | {r['bytes'] / GIB:.0f} | {fault} | {r['pin_s']} | "
                     f"{r['gbps']} | {r['copy_gbps']} |")
    return "\n".join(lines)


def thread_counts(text):
    counts = [int(t) for t in text.split(",") if t.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("thread counts are positive integers, e.g. 1,4,8")
    return counts


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="GiB pinned by each way (default 8)")
    parser.add_argument("--piece-mib", type=int, default=64, help="MiB per piece (default 64)")
    parser.add_argument("--threads", type=thread_counts, default=[1, 4, 8], help="thread counts (default 1,4,8)")
    parser.add_argument("--way", action="append", choices=WAYS, help="only these ways (repeat; default all)")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.piece_mib <= 0:
        parser.error("--gib and --piece-mib must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        cuda = Cuda()
    except NoDriver as e:
        print(f"pin_rate: no CUDA driver found: {e}")
        return 2
    total = int(args.gib * GIB) // MIB * MIB
    piece = min(args.piece_mib * MIB, total)
    results = []
    for way in args.way or WAYS:
        for threads in args.threads:
            result = measure(cuda, way, total, piece, threads)
            print(json.dumps(result), flush=True)
            results.append(result)
    print(table(results))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
