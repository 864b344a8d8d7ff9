"""The verdict of the GPU step `wheel` (tools/gpu/run.sh): reads the reports tools/gpu/train_transformers.py
wrote under ``python -m cuvmm_torch`` (``wheel-cuvmm.json``), ``torchrun -m cuvmm_torch`` (``wheel-torchrun.json``)
and PyTorch's own allocator (``wheel-native.json``), prints each allocator's figures, and a last line: whether
PyTorch's memory_stats and snapshot were cuvmm's (backend ``cuvmm``, every segment expandable, the model's
memory allocated under a peak under the peak reserved, every loss finite) or what was not. Status 1 if not.

    python3 tools/gpu/wheel_reports.py OUT
"""

import json
import os
import sys

UNDER_CUVMM = (("python -m cuvmm_torch", "cuvmm"), ("torchrun -m cuvmm_torch", "torchrun"))


def read(out, name):
    path = os.path.join(out, f"wheel-{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as file:
        return json.load(file)


def problems(reports):
    """What is wrong with `reports` ({"cuvmm": ..., "torchrun": ..., "native": ...}, None where missing)."""
    bad = []
    for name, key in UNDER_CUVMM:
        report = reports.get(key)
        if report is None:
            bad.append(f"{name}: no report")
            continue
        if report["backend"] != "cuvmm":
            bad.append(f"{name}: allocator backend {report['backend']!r}")
        if not report["losses_finite"]:
            bad.append(f"{name}: a loss is not finite")
        if not 0 < report["expandable_segments"] == report["segments"]:
            bad.append(f"{name}: {report['expandable_segments']} of {report['segments']} segments expandable")
        stats = report["memory_stats"]
        current, peak = stats["allocated_bytes.all.current"], stats["allocated_bytes.all.peak"]
        if not (current and peak and 0 < current <= peak <= stats["reserved_bytes.all.peak"]):
            bad.append(f"{name}: memory_stats {stats}")
    if reports.get("torchrun") and reports["torchrun"]["rank"] != "0":
        bad.append(f"torchrun -m cuvmm_torch: rank {reports['torchrun']['rank']!r}")
    if reports.get("native") and reports["native"]["backend"] != "native":
        bad.append(f"PyTorch's own allocator: backend {reports['native']['backend']!r}")
    return bad


def summary(name, report):
    stats = report["memory_stats"]
    return (f"{name}: backend {report['backend']}, peak allocated {stats['allocated_bytes.all.peak']}, peak reserved "
            f"{stats['reserved_bytes.all.peak']}, segments {report['segments']} ({report['expandable_segments']} "
            f"expandable), {report['steps']} steps in {report['seconds']} s, last loss {report['losses'][-1]}")


def main(out):
    reports = {key: read(out, key) for key in ("cuvmm", "torchrun", "native")}
    for key in ("cuvmm", "native"):
        if reports[key]:
            print(summary(key, reports[key]))
    bad = problems(reports)
    print("wheel: " + ("; ".join(bad) if bad else
                       "PyTorch's memory_stats and snapshot are cuvmm's under python -m cuvmm_torch and torchrun"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
