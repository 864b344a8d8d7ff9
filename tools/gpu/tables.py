#!/usr/bin/env python3
"""Markdown tables for docs/gpu-results.md from the files tools/gpu/run.sh wrote (its $OUT folder).

    python3 tools/gpu/tables.py gpu-out [FILE...]

Reads whichever of traces.txt, workloads.txt, torch.txt, hot.txt, train.txt, driver-bench.txt,
capacity-cuda.txt and capacity-split.txt are there (or only the FILEs named) and prints one table per file found.
"""

import json
import os
import sys

GIB = 1 << 30


def objects(path):
    """The JSON objects of a file that holds several, one after another, with other lines between."""
    with open(path) as f:
        text = f.read()
    decoder, at, found = json.JSONDecoder(), 0, []
    while (start := text.find("{", at)) >= 0:
        try:
            value, at = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            at = start + 1
            continue
        if start == 0 or text[start - 1] == "\n":
            found.append(value)
    return found


def gib(n):
    return f"{n / GIB:.3f}"


def replays(path, title):
    """compare output: on the GPU, then (traces only) on the simulator."""
    reports = objects(path)
    paired = title == "traces"
    print(f"\n### {title}: GPU replay (--backend cuda --touch)" + (" against the simulator" if paired else ""))
    print("\n| workload | allocator | peak reserved GiB (GPU) | same on simulator | driver calls (GPU) | same on simulator "
          "| measured driver ms | simulator's estimate ms | replay s |")
    print("|---|---|---|---|---|---|---|---|---|")
    step = 2 if paired else 1
    for i in range(0, len(reports), step):
        gpu = reports[i]["results"]
        sim = reports[i + 1]["results"] if paired and i + 1 < len(reports) else [None] * len(gpu)
        for g, s in zip(gpu, sim):
            calls = sum(g["driver_calls"].values())
            same_peak = "-" if s is None else ("yes" if s["peak_reserved_bytes"] == g["peak_reserved_bytes"] else gib(s["peak_reserved_bytes"]))
            same_calls = "-" if s is None else ("yes" if s["driver_calls"] == g["driver_calls"] else str(sum(s["driver_calls"].values())))
            estimate = "-" if s is None else f"{s['estimated_driver_us'] / 1e3:.1f}"
            print(f"| {g['workload']} | {g['allocator']} | {gib(g['peak_reserved_bytes'])} | {same_peak} | {calls} | "
                  f"{same_calls} | {g['estimated_driver_us'] / 1e3:.1f} | {estimate} | {g['replay_seconds']:.3f} |")


def torch(path):
    rows = {}
    for o in objects(path):
        rows.setdefault(o["trace"], {})[o["allocator"]] = o
    print("\n### PyTorch's allocators on each trace (tools/torch_replay.py)")
    print("\n| trace | max reserved GiB: native | expandable | cuvmm | max allocated GiB (native) | wall s: native | expandable | cuvmm | OOMs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for trace, by in rows.items():
        get = lambda a, k, f: f(by[a][k]) if a in by else "-"  # noqa: E731
        ooms = sum(by[a]["ooms"] for a in by)
        print(f"| {trace} | {get('native', 'max_reserved_bytes', gib)} | {get('expandable', 'max_reserved_bytes', gib)} | "
              f"{get('cuvmm', 'max_reserved_bytes', gib)} | {get('native', 'max_allocated_bytes', gib)} | "
              f"{get('native', 'wall_seconds', lambda x: f'{x:.3f}')} | {get('expandable', 'wall_seconds', lambda x: f'{x:.3f}')} | "
              f"{get('cuvmm', 'wall_seconds', lambda x: f'{x:.3f}')} | {ooms} |")


def hot(path):
    print("\n### Cached alloc+free pairs per second (tools/hot_path.py; median of 5 x 200,000 pairs)")
    found = objects(path)
    if not found:
        return
    sizes = list(found[0]["sizes"])
    print("\n| allocator | " + " | ".join(f"{int(s):,} B" for s in sizes) + " | empty Python loop |")
    print("|---" * (len(sizes) + 2) + "|")
    for o in found:
        print(f"| {o['allocator']} | " + " | ".join(f"{o['sizes'][s]:,}" for s in sizes) + f" | {o['python_loop_pairs_per_second']:,} |")


def train(path):
    print("\n### A small GPT, variable sequence lengths (tools/train_gpt.py --search)")
    print("\n| allocator | max reserved GiB (fraction 1.0) | max allocated GiB | median step ms | smallest fraction that completes | tried |")
    print("|---|---|---|---|---|---|")
    for o in objects(path):
        full = o.get("at_1.0") or {}
        tried = ", ".join(f"{t[0]}{'' if t[1] else ' (OOM)'}" for t in o.get("tried", []))
        print(f"| {o['allocator']} | {gib(full.get('max_reserved_bytes', 0))} | {gib(full.get('max_allocated_bytes', 0))} | "
              f"{full.get('median_step_ms', '-')} | {o.get('smallest_fraction')} | {tried} |")


def driver_bench(path):
    found = [o for o in objects(path) if o.get("schema", "").startswith("cuvmm-driver-bench")]
    if not found:
        return
    report = found[-1]
    print(f"\n### driver-bench on {report['device']['name']} (medians of {report['repetitions']}, us)")
    pages = report["pages"]
    keys = [k for k in pages[0] if k != "page_bytes"]
    print("\n| page | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for p in pages:
        print(f"| {p['page_bytes'] >> 20} MiB | " + " | ".join("-" if p[k] is None else f"{p[k]:.1f}" for k in keys) + " |")
    for key, value in report.items():
        if key not in ("pages", "device", "schema", "latency_model_ns"):
            print(f"\n{key}: {json.dumps(value)}")


def capacity_cuda(path):
    """cuvmm capacity --backend cuda output: per trace, the min capacity and the peak reserved at it of each
    allocator (a ballast made each capacity), in GiB; '> X' where nothing up to X (what the GPU had free) fit."""
    rows = [r for o in objects(path) for r in o.get("results", []) if "min_capacity_bytes" in r]
    if not rows:
        return
    allocators = list(dict.fromkeys(r["allocator"] for r in rows))
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    print("\n### capacity on the GPU (ballast), GiB: min capacity / peak reserved at it")
    print("\n| trace | peak live | " + " | ".join(allocators) + " |")
    print("|---" * (len(allocators) + 2) + "|")
    for trace in traces:
        mine = {r["allocator"]: r for r in rows if r["trace"] == trace}
        live = next(iter(mine.values()))["peak_live_bytes"]
        cells = []
        for a in allocators:
            r = mine.get(a)
            if r is None:
                cells.append("-")
            elif r["min_capacity_bytes"] is None:
                cells.append(f"> {gib(r['searched_up_to_bytes'])}")
            else:
                cells.append(f"{gib(r['min_capacity_bytes'])} / {gib(r['peak_reserved_bytes'])}")
        print(f"| {trace} | {gib(live)} | " + " | ".join(cells) + " |")


def main(folder, only=()):
    handlers = {"traces.txt": lambda p: replays(p, "traces"), "workloads.txt": lambda p: replays(p, "workloads"),
                "torch.txt": torch, "hot.txt": hot, "train.txt": train, "driver-bench.txt": driver_bench,
                "capacity-cuda.txt": capacity_cuda, "capacity-split.txt": capacity_cuda}
    for name, handler in handlers.items():
        if only and name not in only:
            continue
        path = os.path.join(folder, name)
        if os.path.exists(path):
            handler(path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu-out", sys.argv[2:]))
