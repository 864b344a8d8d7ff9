"""Checks a `cuvmm` binary (the wheel's, as installed) against the README's figures, with no Rust toolchain:

- every ``$ cargo run --release -- capacity ...`` and ``frontier ...`` example of the README, run with the
  binary, prints the README's lines exactly (they are deterministic: no timings);
- with a folder of PyTorch snapshots (default ``../shared/traces`` beside the checkout, when it exists), one
  of them (``--trace-name``, default the smallest) through ``capacity``, ``compare``, ``frontier``,
  ``fidelity`` and ``snapshot --trace``: each allocator's min capacity and its peak reserved and driver calls
  at 80 GiB are the README's table's, fidelity matches PyTorch's segment events, and the written snapshot is
  a pickle with segments; without one, a snapshot the binary writes of a built-in workload goes through the
  same commands.

    python3 tools/cli_check.py CUVMM [--traces DIR] [--trace-name FILE]

Prints one line per check; status 1 at the first difference.
"""

import argparse
import os
import pickle
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
EXAMPLE = re.compile(r"```text\n\$ cargo run --release -- ((?:capacity|frontier) [^\n]*)\n(.*?)```", re.S)


def run(binary, *args):
    quiet = ["--quiet"] if args[0] in ("compare", "capacity") else []  # no progress bar (they have one)
    done = subprocess.run([binary, *args, *quiet], capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        fail(f"`cuvmm {' '.join(args)}` exited with {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def fail(message):
    print(f"cli_check: {message}", file=sys.stderr)
    sys.exit(1)


def ok(message):
    print(f"ok: {message}")


def readme_examples(text):
    """(arguments, the lines printed) of each capacity and frontier example."""
    return [(args.split(), printed.rstrip("\n").splitlines()) for args, printed in EXAMPLE.findall(text)]


def readme_table_rows(text, trace):
    """{allocator: (min capacity with its ratio, peak reserved at 80 GiB, driver calls)} of `trace`'s rows
    in the table of results on real traces."""
    rows, current = {}, None
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if not cells or len(cells) < 7:
            current = None
            continue
        if cells[0]:
            current = cells[0]
        if current == trace:
            rows[cells[2]] = (cells[3], cells[5], cells[6].replace(",", ""))
    return rows


def check_examples(binary, text):
    examples = readme_examples(text)
    if not examples:
        fail("no capacity or frontier example found in README.md")
    for args, expected in examples:
        printed = run(binary, *args).rstrip("\n").splitlines()
        if [line.rstrip() for line in printed] != [line.rstrip() for line in expected]:
            fail(f"`cuvmm {' '.join(args)}` does not print the README's lines:\n" + "\n".join(printed))
        ok(f"cuvmm {' '.join(args)}: the README's {len(expected)} lines")


def check_trace(binary, trace, rows, scratch):
    name = os.path.basename(trace)
    capacity, stranded = {}, False
    for line in run(binary, "capacity", "--trace", trace).splitlines()[1:]:
        t = line.split()
        if not t:
            stranded = True  # the table of stranded pages follows: "ALLOCATOR, SETTING" with its min capacity
        elif not stranded:
            capacity[t[1]] = f"{t[4]} {t[5]} ({t[6]})"
        elif t[0] == name:
            capacity[f"{t[1]}, {t[4]}"] = f"{t[5]} {t[6]} ({t[7]})"
    compared = {}
    for line in run(binary, "compare", "--trace", trace).splitlines()[1:]:
        t = line.split()
        compared[t[1]] = (f"{t[4]} {t[5]}", t[8])
    for key in [key for key in capacity if ", " in key]:
        allocator, setting = key.split(", ", 1)
        t = run(binary, "compare", "--trace", trace, "--allocator", allocator, "--alloc-conf", setting).splitlines()[1]
        t = t.split()
        compared[key] = (f"{t[4]} {t[5]}", t[8])
    if rows:
        for allocator, (min_capacity, reserved, calls) in rows.items():
            got = (capacity.get(allocator), *compared.get(allocator, (None, None)))
            if got != (min_capacity, reserved, calls):
                fail(f"{name}, {allocator}: min capacity, peak reserved and driver calls {got}, the README "
                     f"says {(min_capacity, reserved, calls)}")
        ok(f"capacity and compare --trace {name}: the README's min capacities, peak reserved and driver calls "
           f"for {', '.join(rows)}")
    elif len([key for key in capacity if ", " not in key]) != 3 or len(compared) != len(capacity):
        fail(f"capacity and compare --trace {name}: {capacity}, {compared}: not one row per allocator")
    else:
        ok(f"capacity and compare --trace {name}: {capacity}")
    frontier = run(binary, "frontier", "--trace", trace, "--allocator", "cuvmm")
    if not any("*" in line for line in frontier.splitlines()[1:] if not line.startswith("(")):
        fail(f"frontier --trace {name} marks no min capacity:\n{frontier}")
    ok(f"frontier --trace {name}: {len(frontier.splitlines()) - 2} capacities")
    if rows:
        fidelity = run(binary, "fidelity", "--trace", trace)
        if not re.search(r"segment_event_match\s+1\.0000", fidelity):
            fail(f"fidelity --trace {name}:\n{fidelity}")
        ok(f"fidelity --trace {name}: segment_event_match 1.0000")
    written = os.path.join(scratch, "replayed.pickle")
    run(binary, "snapshot", "--trace", trace, "-o", written)
    with open(written, "rb") as file:
        snapshot = pickle.load(file)
    if not snapshot.get("segments"):
        fail(f"snapshot --trace {name}: no segments in {written}")
    ok(f"snapshot --trace {name}: {len(snapshot['segments'])} segments")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cuvmm", help="the cuvmm binary to check")
    parser.add_argument("--traces", default=os.path.join(os.path.dirname(ROOT), "shared", "traces"))
    parser.add_argument("--trace-name", default="bert_large_inference.pickle")
    options = parser.parse_args()
    with open(README, encoding="utf-8") as file:
        text = file.read()
    check_examples(options.cuvmm, text)
    with tempfile.TemporaryDirectory() as scratch:
        trace = os.path.join(options.traces, options.trace_name)
        if os.path.isfile(trace):
            rows = readme_table_rows(text, options.trace_name)
            if not rows:
                fail(f"README.md's table has no rows for {options.trace_name}")
        else:
            print(f"({trace} is absent: a snapshot of the moe workload instead)")
            trace, rows = os.path.join(scratch, "moe.pickle"), {}
            run(options.cuvmm, "snapshot", "--workload", "moe", "-o", trace)
        check_trace(options.cuvmm, trace, rows, scratch)


if __name__ == "__main__":
    main()
