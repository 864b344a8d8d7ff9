#!/usr/bin/env python3
"""Sleep and wake of a tagged region on a GPU, timed (issue 33): for each size, a uint8 tensor allocated under
a cuvmm tag (``cuvmm_torch.region``) and filled, then ``cuvmm_torch.sleep(tag, keep)`` and
``cuvmm_torch.wake(tag)``, with and without its contents kept.

    python3 tools/sleep_wake_bench.py [--sizes-gib 1,10,40]

Needs PyTorch, a GPU and cuvmm's library (``CUVMM_TORCH_LIB``). Prints one JSON object per (size, keep) on a
line of its own, then a table. Each line says: the bytes sleep gave back; how much the device's free memory
(``torch.cuda.mem_get_info``, i.e. ``cudaMemGetInfo``) rose; the sleep's and the wake's wall time (the wake
synchronized, so the bytes are back when it is timed); and, with contents kept, whether every byte read after
the wake is what was written before the sleep (checked on the GPU). A size that does not fit in free memory is
reported as skipped. Exit status 1 if any check failed.
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

GIB = 1 << 30
CHUNK = 256 << 20  # bytes compared at a time
SCHEMA = "cuvmm-sleep-wake-bench/1"


def holds(torch, t, value):
    """Whether every byte of `t` is `value`, compared on the GPU a chunk at a time (a comparison of the whole
    tensor would allocate as much again)."""
    return all(bool((t[i : i + CHUNK] == value).all().item()) for i in range(0, t.numel(), CHUNK))


def measure(torch, cuvmm, size, keep, value):
    """One sleep and wake of `size` bytes under a tag of its own."""
    tag = f"bench-{size}-{int(keep)}"
    with cuvmm.region(tag):
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
    t.fill_(value)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    began = time.monotonic()
    released = cuvmm.sleep(tag, keep=keep)
    sleep_s = time.monotonic() - began
    free_asleep = torch.cuda.mem_get_info()[0]
    began = time.monotonic()
    cuvmm.wake(tag)
    torch.cuda.synchronize()
    wake_s = time.monotonic() - began
    intact = holds(torch, t, value) if keep else None
    del t
    torch.cuda.empty_cache()
    return {"suite": SCHEMA, "bytes": size, "keep": keep, "released_bytes": released,
            "free_gain_bytes": free_asleep - free_before, "sleep_s": round(sleep_s, 4), "wake_s": round(wake_s, 4),
            "contents_intact": intact}


def table(results):
    lines = ["| size | contents kept | bytes given back | free memory rose by | sleep s | wake s | GB/s (sleep, wake) "
             "| bytes intact |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['bytes'] / GIB:.0f} GiB | {r['keep']} | skipped: {r['skipped']} | | | | | |")
            continue
        rate = ", ".join(f"{r['bytes'] / s / 1e9:.1f}" if s > 0 else "-" for s in (r["sleep_s"], r["wake_s"]))
        lines.append(f"| {r['bytes'] / GIB:.0f} GiB | {r['keep']} | {r['released_bytes']:,} | "
                     f"{r['free_gain_bytes']:,} | {r['sleep_s']:.3f} | {r['wake_s']:.3f} | {rate} | "
                     f"{'-' if r['contents_intact'] is None else r['contents_intact']} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gib", default="1,10,40", help="comma-separated sizes in GiB")
    args = parser.parse_args(argv)
    try:
        sizes = [int(float(s) * GIB) for s in args.sizes_gib.split(",")]
    except ValueError:
        parser.error(f"--sizes-gib: not a list of numbers: {args.sizes_gib}")
    if not sizes or min(sizes) <= 0:
        parser.error("--sizes-gib: sizes must be positive")

    import cuvmm_torch as cuvmm  # noqa: PLC0415 (after sys.path)
    import torch  # noqa: PLC0415

    layer = cuvmm.install()
    print(f"cuvmm installed ({layer} layer) on {torch.cuda.get_device_name()}, torch {torch.__version__}",
          flush=True)
    results, failed = [], False
    for i, size in enumerate(sizes):
        for keep in (True, False):
            free = torch.cuda.mem_get_info()[0]
            if size > free - GIB:
                result = {"suite": SCHEMA, "bytes": size, "keep": keep,
                          "skipped": f"{size} bytes do not fit in {free} free"}
            else:
                try:
                    result = measure(torch, cuvmm, size, keep, value=(i * 2 + keep) % 250 + 3)
                except Exception as error:  # noqa: BLE001 (reported, and the run goes on)
                    result = {"suite": SCHEMA, "bytes": size, "keep": keep, "error": repr(error)[:400]}
                    failed = True
            if result.get("contents_intact") is False or result.get("released_bytes", size) < size:
                failed = True
            results.append(result)
            print(json.dumps(result), flush=True)
    print(table([r for r in results if "error" not in r]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
