#!/usr/bin/env python3
"""Fits the simulator's latency model (src/driver/sim/latency.rs) to `cuvmm driver-bench --format json` taken on
a GPU, and prints the figures for a `LatencyModel` constructor.

    python3 tools/gpu/fit_latency.py driver-bench.json

Per operation, a least-squares line (relative errors) through the medians at each page size: cost = fixed + per_unit x units,
units being the 2 MiB units the call covers. For `set_access` and `unmap` the fixed part is charged per
*mapping* the call covers, not per call: one call over a run of k single-page mappings costs what k calls
do (the `*_run_us` and `*_per_page_us` columns agree), so the line through single-mapping calls gives the
per-mapping cost. The stream calls are taken as measured (idle stream).
"""

import json
import sys

UNIT = 2 << 20


def line(points):
    """Least squares y = a + b x through (x, y) points, each weighted by 1 / y^2 (relative errors: a 2 MiB
    call matters as much as a 1 GiB one); returns (a, b), neither below 0."""
    w = [1 / max(y, 1e-9) ** 2 for _, y in points]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points))
    b = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points)) / sxx if sxx else 0.0
    b = max(b, 0.0)
    return max(my - b * mx, 0.0), b


def objects(text):
    decoder, at, found = json.JSONDecoder(), 0, []
    while (start := text.find("{", at)) >= 0:
        try:
            value, at = decoder.raw_decode(text, start)
            found.append(value)
        except json.JSONDecodeError:
            at = start + 1
    return found


def main(path):
    with open(path) as f:
        text = f.read()
    reports = [o for o in objects(text) if str(o.get("schema", "")).startswith("cuvmm-driver-bench")]
    if not reports:
        sys.exit(f"{path}: no driver-bench JSON")
    report = reports[-1]
    pages = report["pages"]
    print(f"// {report['device']['name']}: {len(pages)} page sizes, medians of {report['repetitions']} repetitions")
    print("// op: fixed ns (per call; per mapping for set_access and unmap), ns per 2 MiB unit; model minus measured, per page size")
    for op, key in [("create", "create_us"), ("map", "map_us"), ("set_access", "set_access_us"),
                    ("unmap", "unmap_us"), ("release", "release_us"), ("malloc", "malloc_us"), ("free", "free_us")]:
        points = [(p["page_bytes"] / UNIT, p[key]) for p in pages]
        a, b = line(points)
        residuals = ", ".join(f"{100 * (a + b * x - y) / y:+.0f}%" for x, y in points)
        print(f"{op}: fixed {round(a * 1000)} ns, per unit {round(b * 1000)} ns; residuals {residuals}")
    stream = report.get("stream", {})
    for key, value in stream.items():
        print(f"{key}: {round(value * 1000)} ns")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "driver-bench.json")
