#!/usr/bin/env python3
"""Sleep and wake of a tagged region on a GPU, timed over several cycles (issues 33 and 44): for each size, a
uint8 tensor allocated under a cuvmm tag (``cuvmm_torch.region``) and filled, then ``--cycles`` times
``cuvmm_torch.sleep(tag, keep)`` and ``cuvmm_torch.wake(tag)``, with and without its contents kept.

    python3 tools/sleep_wake_bench.py [--sizes-gib 4,16] [--cycles 4] [--overwrite] [--prepare]

Needs PyTorch, a GPU and cuvmm's library (``CUVMM_TORCH_LIB``). Prints one JSON object per (size, keep) on a
line of its own as soon as it is measured, then a table. Each line says: the bytes sleep gave back; how much
the device's free memory (``torch.cuda.mem_get_info``) rose; each cycle's sleep and wake wall time and GB/s
(the wake synchronized, so the bytes are back when it is timed); the first cycle's rates and the mean of the
later ones (the first sleep pins the tag's host memory, later ones reuse it: ``keep_host_buffers``); the host
memory kept for the tag after the last wake (``cuvmm.host_kept_bytes``); and, with contents kept, whether
every byte read after the last wake is what was written before the first sleep (checked on the GPU).
Each line also names the configuration (``CUVMM_ALLOC_CONF``: ``pinned_use_cuda_host_register`` and
``pinned_num_register_threads`` choose how the first sleep pins). ``--prepare`` pins the tag's host memory
before the first sleep (``cuvmm_torch.prepare_sleep``, timed apart as ``prepare_s``), so that the first
cycle's sleep pins nothing. ``--overwrite`` makes another allocation fill the memory the tag gave back at every cycle, so the bytes come
back from the host and not from pages that happened to survive. The tag's host memory is released after its
size (``cuvmm_torch.release_host_buffers``), so each size's first cycle pins again. A size that does not fit
in free memory is reported as skipped. Exit status 1 if any check failed.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

GIB = 1 << 30
CHUNK = 256 << 20  # bytes compared at a time
SCHEMA = "cuvmm-sleep-wake-bench/3"


def holds(torch, t, value):
    """Whether every byte of `t` is `value`, compared on the GPU a chunk at a time (a comparison of the whole
    tensor would allocate as much again)."""
    return all(bool((t[i : i + CHUNK] == value).all().item()) for i in range(0, t.numel(), CHUNK))


def rate(size, seconds):
    return round(size / seconds / 1e9, 2) if seconds > 0 else None


def measure(torch, cuvmm, size, keep, value, cycles, overwrite, prepare=False):
    """`cycles` sleeps and wakes of `size` bytes under a tag of its own; with `prepare` (and `keep`), the
    tag's host memory pinned before the first sleep."""
    tag = f"bench-{size}-{int(keep)}"
    with cuvmm.region(tag):
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
    t.fill_(value)
    torch.cuda.synchronize()
    prepare_s = prepared = None
    if prepare and keep:
        began = time.monotonic()
        prepared = cuvmm.prepare_sleep(tag)
        prepare_s = round(time.monotonic() - began, 4)
    free_before = torch.cuda.mem_get_info()[0]
    runs, released, free_gain = [], None, None
    for cycle in range(cycles):
        began = time.monotonic()
        given = cuvmm.sleep(tag, keep=keep)
        sleep_s = time.monotonic() - began
        if cycle == 0:
            released = given
            free_gain = torch.cuda.mem_get_info()[0] - free_before
        if overwrite:
            other = torch.empty(size, dtype=torch.uint8, device="cuda")
            other.fill_((value + 1) % 256)
            torch.cuda.synchronize()
            del other
            torch.cuda.empty_cache()
        began = time.monotonic()
        cuvmm.wake(tag)
        torch.cuda.synchronize()
        wake_s = time.monotonic() - began
        runs.append({"sleep_s": round(sleep_s, 4), "wake_s": round(wake_s, 4),
                     "sleep_gbps": rate(size, sleep_s), "wake_gbps": rate(size, wake_s)})
    intact = holds(torch, t, value) if keep else None
    host_kept = cuvmm.memory_stats().get("cuvmm.host_kept_bytes")
    del t
    cuvmm.release_host_buffers(tag)
    torch.cuda.empty_cache()
    later = runs[1:] or runs
    return {"suite": SCHEMA, "bytes": size, "keep": keep, "alloc_conf": os.environ.get("CUVMM_ALLOC_CONF", ""),
            "prepare_s": prepare_s, "prepared_bytes": prepared, "cycles": runs, "released_bytes": released,
            "free_gain_bytes": free_gain,
            "first_sleep_gbps": runs[0]["sleep_gbps"], "first_wake_gbps": runs[0]["wake_gbps"],
            "later_sleep_gbps": round(statistics.mean(r["sleep_gbps"] or 0 for r in later), 2),
            "later_wake_gbps": round(statistics.mean(r["wake_gbps"] or 0 for r in later), 2),
            "later_sleep_ms": round(statistics.mean(r["sleep_s"] for r in later) * 1e3, 1),
            "later_wake_ms": round(statistics.mean(r["wake_s"] for r in later) * 1e3, 1),
            "host_kept_bytes": host_kept, "contents_intact": intact}


def table(results):
    lines = ["| size | contents kept (pinned ahead, s) | sleep GB/s, first cycle | wake GB/s, first | sleep GB/s, later (ms) "
             "| wake GB/s, later (ms) | host memory kept | free memory rose by | bytes intact |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['bytes'] / GIB:.0f} GiB | {r['keep']} | skipped: {r['skipped']} | | | | | | |")
            continue
        ahead = "" if r.get("prepare_s") is None else f" ({r['prepare_s']})"
        lines.append(
            f"| {r['bytes'] / GIB:.0f} GiB | {r['keep']}{ahead} | {r['first_sleep_gbps']} | {r['first_wake_gbps']} | "
            f"{r['later_sleep_gbps']} ({r['later_sleep_ms']}) | {r['later_wake_gbps']} ({r['later_wake_ms']}) | "
            f"{(r['host_kept_bytes'] or 0) / GIB:.2f} GiB | {r['free_gain_bytes']:,} | "
            f"{'-' if r['contents_intact'] is None else r['contents_intact']} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gib", default="4,16", help="comma-separated sizes in GiB")
    parser.add_argument("--cycles", type=int, default=4, help="sleeps and wakes per size (at least 1)")
    parser.add_argument("--overwrite", action="store_true",
                        help="fill the memory given back with other bytes at every cycle")
    parser.add_argument("--prepare", action="store_true",
                        help="pin the host memory before the first sleep (cuvmm_torch.prepare_sleep)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(float(s) * GIB) for s in args.sizes_gib.split(",")]
    except ValueError:
        parser.error(f"--sizes-gib: not a list of numbers: {args.sizes_gib}")
    if not sizes or min(sizes) <= 0:
        parser.error("--sizes-gib: sizes must be positive")
    if args.cycles < 1:
        parser.error("--cycles: at least 1")

    import cuvmm_torch as cuvmm  # noqa: PLC0415 (after sys.path)
    import torch  # noqa: PLC0415

    layer = cuvmm.install()
    print(f"cuvmm installed ({layer} layer) on {torch.cuda.get_device_name()}, torch {torch.__version__}",
          flush=True)
    results, failed = [], False
    for i, size in enumerate(sizes):
        for keep in (True, False):
            free = torch.cuda.mem_get_info()[0]
            need = size * (2 if args.overwrite else 1)
            if need > free - GIB:
                result = {"suite": SCHEMA, "bytes": size, "keep": keep,
                          "skipped": f"{need} bytes do not fit in {free} free"}
            else:
                try:
                    result = measure(torch, cuvmm, size, keep, (i * 2 + keep) % 250 + 3, args.cycles,
                                     args.overwrite, args.prepare)
                except Exception as error:  # noqa: BLE001 (reported, and the run goes on)
                    result = {"suite": SCHEMA, "bytes": size, "keep": keep, "error": repr(error)[:400]}
                    failed = True
            if result.get("contents_intact") is False or (result.get("released_bytes") or size) < size:
                failed = True
            results.append(result)
            print(json.dumps(result), flush=True)
    print(table([r for r in results if "error" not in r]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
