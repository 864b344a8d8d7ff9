#!/usr/bin/env python3
"""PyTorch's uses of its CUDA allocator, each under three allocators: native (PyTorch's default), expandable
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) and cuvmm (python/cuvmm_torch/'s install()).

    python3 tools/gpu/torch_suite.py                          # every case under every allocator
    python3 tools/gpu/torch_suite.py --allocator cuvmm --case record_stream,oom
    python3 tools/gpu/torch_suite.py --json results.jsonl     # also the results as JSON lines in a file
    python3 tools/gpu/torch_suite.py --list                   # the cases and what each asserts
    python3 tools/gpu/torch_suite.py --table results.jsonl    # the table of an earlier run

The cases are in tools/gpu/torch_cases/; each compares its results with a reference computed without the
hazard (on the CPU, or before it), so a case can fail, not only crash. A process picks its allocator once,
before its first CUDA allocation, and an illegal memory access kills its CUDA context, so cases run in child
processes: per allocator, one process runs the cases that leave nothing behind one after another, and each
case marked fresh (its own allocator setting, or state it leaves) gets a process of its own. When a process
dies, times out or reports its CUDA context broken, the case it was running is reported so and the rest start
in a new process. Each case has a time limit, and the whole run a budget (--budget): what the budget leaves no
time for is reported as skip.

Output: one JSON object per (allocator, case) on a line of its own as soon as it is known (status pass, fail,
error or skip; a short detail; the case's figures; seconds), then a table of cases by allocator with the
details of what did not pass, and a last line counting the statuses. fail: a result differed from its
reference, a CUDA error, an out-of-memory where PyTorch's allocators have memory, a crash. error: the case
could not run: an exception saying something is unsupported (which tells which allocator hooks are missing),
another unexpected exception, a timeout. Exit status 0 when nothing failed or errored, 1 otherwise, 2 for bad
arguments. Needs PyTorch and a GPU only in the child processes: the driver, the table and the argument
parsing run anywhere (python/test_torch_suite.py).
"""

import argparse
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import torch_cases  # noqa: E402 (tools/gpu is not a package)

SCHEMA = "cuvmm-torch-suite/1"
ALLOCATORS = torch_cases.ALLOCATORS
STATUSES = ("pass", "fail", "error", "skip")
PREFIX = "@@torch-suite "  # the child's protocol lines on stdout; anything else there is ignored
STARTUP_SECONDS = 60  # added to the first case of a process: importing PyTorch, creating the CUDA context
DETAIL_CHARS = 400
BROKEN_CONTEXT_EXIT = 3
NOT_APPLICABLE = "applies to"  # the detail of a case skipped for an allocator it does not apply to

# Exception messages meaning PyTorch (or the allocator) does not support something: status error. Looked at
# before FAILURE_MARKERS, as "CUDA error: operation not supported" is also such a message.
UNSUPPORTED_MARKERS = ("not support", "unsupported", "not implemented", "notimplemented", "can't swap",
                       "cannot swap")
# Messages of a wrong result: a CUDA error, out of memory, a null pointer from a pluggable allocator.
FAILURE_MARKERS = ("cuda error", "illegal memory access", "illegal address", "misaligned address",
                   "unspecified launch failure", "out of memory", "data is not allocated yet", "cublas_status",
                   "cudnn_status", "nccl error", "device-side assert")


# --- results ---------------------------------------------------------------------------------------------


def short(text, limit=DETAIL_CHARS):
    """One line of at most `limit` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def make_result(allocator, case, status, detail="", figures=None, seconds=None, **extra):
    if status not in STATUSES:
        raise ValueError(f"unknown status {status}")
    result = {"suite": SCHEMA, "allocator": allocator, "case": case, "status": status, "detail": short(detail),
              "figures": figures or {}, "seconds": None if seconds is None else round(seconds, 2)}
    result.update(extra)
    return result


def classify_exception(error):
    """(status, detail) for an exception a case raised."""
    if isinstance(error, torch_cases.CaseFailure):
        return "fail", str(error)
    if isinstance(error, torch_cases.SkipCase):
        return "skip", str(error)
    name = type(error).__name__
    detail = f"{name}: {error}"
    lowered = detail.lower()
    if isinstance(error, NotImplementedError) or any(m in lowered for m in UNSUPPORTED_MARKERS):
        return "error", detail
    if "outofmemory" in lowered or any(m in lowered for m in FAILURE_MARKERS):
        return "fail", detail
    return "error", detail


def counts(results):
    found = {status: 0 for status in STATUSES}
    for result in results:
        found[result["status"]] += 1
    return found


def summary_line(results, seconds=None):
    found = counts(results)
    line = "torch-suite: " + ", ".join(f"{found[s]} {s}" for s in STATUSES)
    return line + ("" if seconds is None else f" ({seconds:.0f} s)")


def format_table(results, allocators=None, cases=None):
    """A Markdown table, cases by allocator, each cell the status (and the seconds), then the detail of every
    result that did not pass."""
    by_key = {(r["allocator"], r["case"]): r for r in results}
    allocators = list(allocators or [a for a in ALLOCATORS if any(r["allocator"] == a for r in results)])
    names = list(cases or [c for c in torch_cases.CASES if any(r["case"] == c for r in results)])
    names += sorted({r["case"] for r in results} - set(names))
    lines = ["| case | " + " | ".join(allocators) + " |", "|---|" + "---|" * len(allocators)]
    for name in names:
        cells = []
        for allocator in allocators:
            result = by_key.get((allocator, name))
            if result is None:
                cells.append("-")
                continue
            status = result["status"].upper() if result["status"] in ("fail", "error") else result["status"]
            cells.append(status + ("" if result.get("seconds") is None else f" ({result['seconds']:.0f} s)"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    notes = [f"- {r['allocator']} / {r['case']}: {r['status']}: {r['detail']}"
             for name in names for a in allocators
             if (r := by_key.get((a, name))) is not None and r["status"] != "pass" and r["detail"]
             and not r["detail"].startswith(NOT_APPLICABLE)]
    return "\n".join(lines + ([""] + notes if notes else []))


def read_results(path):
    """The result objects of a JSON-lines file (or of a run's output, where other lines come between)."""
    found = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict) and value.get("suite") == SCHEMA:
                found.append(value)
    return found


# --- arguments and the plan --------------------------------------------------------------------------------


def _names(values, known, what, parser):
    """Repeated and comma-separated names, in the known order, each checked."""
    if not values:
        return list(known)
    wanted = [v.strip() for value in values for v in value.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in known]
    if unknown:
        parser.error(f"unknown {what} {', '.join(unknown)} (known: {', '.join(known)})")
    return [k for k in known if k in wanted]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocator", action="append", metavar="NAME",
                        help=f"{', '.join(ALLOCATORS)} (repeatable or comma-separated; default all)")
    parser.add_argument("--case", action="append", metavar="NAME",
                        help="a case of --list (repeatable or comma-separated; default all)")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE, one JSON object a line")
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds for the whole run; cases it leaves no time for are skipped (default 480)")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every case's time limit")
    parser.add_argument("--isolate", action="store_true", help="every case in a process of its own")
    parser.add_argument("--verbose", action="store_true", help="pass the child processes' stderr through")
    parser.add_argument("--list", action="store_true", help="list the cases and what each asserts")
    parser.add_argument("--table", metavar="FILE", help="print the table of the results in FILE and stop")
    parser.add_argument("--child", metavar="ALLOCATOR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.allocators = _names(args.allocator, ALLOCATORS, "allocator", parser)
    args.cases = _names(args.case, list(torch_cases.CASES), "case", parser)
    if args.child is not None and args.child not in ALLOCATORS:
        parser.error(f"unknown allocator {args.child}")
    if args.budget <= 0 or args.timeout_scale <= 0:
        parser.error("--budget and --timeout-scale must be positive")
    return args


def plan(allocators, cases, isolate=False):
    """(units, skipped): units are (allocator, [case names]) to run each in one process, in order: per
    allocator the cases that share a process, then each fresh case (cheapest first) under each allocator;
    skipped are results for cases that do not apply to an allocator."""
    registry = torch_cases.CASES
    units, skipped = [], []
    applicable = {a: [c for c in cases if a in registry[c].allocators] for a in allocators}
    for allocator in allocators:
        for name in cases:
            if allocator not in registry[name].allocators:
                skipped.append(make_result(allocator, name, "skip",
                                           f"{NOT_APPLICABLE} {', '.join(registry[name].allocators)} only"))
    if isolate:
        return [(a, [c]) for a in allocators for c in applicable[a]], skipped
    for allocator in allocators:
        shared = [c for c in applicable[allocator] if not registry[c].fresh]
        if shared:
            units.append((allocator, shared))
    fresh = sorted((c for c in cases if registry[c].fresh), key=lambda c: registry[c].timeout)
    for name in fresh:
        units += [(a, [name]) for a in allocators if name in applicable[a]]
    return units, skipped


# --- the child: runs cases in this process -----------------------------------------------------------------


def _emit(message, out):
    out.write(PREFIX + json.dumps(message) + "\n")
    out.flush()


def child_main(allocator, names, out=sys.stdout):
    """Runs the named cases one after another under `allocator`, printing a start and a result line for each.
    Exits early (BROKEN_CONTEXT_EXIT) when a case leaves the CUDA context broken."""
    import faulthandler  # noqa: PLC0415
    import gc  # noqa: PLC0415

    faulthandler.enable()
    ctx, setup_failure = None, None
    for name in names:
        entry = torch_cases.CASES[name]
        _emit({"event": "start", "case": name}, out)
        began, detail, broken = time.monotonic(), "", None
        try:
            if setup_failure is not None:
                raise setup_failure
            if ctx is None:
                if entry.prepare is not None:
                    entry.prepare(allocator)
                try:
                    ctx = torch_cases.Context(allocator)
                except BaseException as e:  # the same answer for every case of this process
                    setup_failure = e
                    raise
            ctx.figures = {}
            detail = entry.run(ctx) or ""
            status = "pass"
        except Exception as e:  # noqa: BLE001 (classified and reported)
            status, detail = classify_exception(e)
            del e
        figures = {} if ctx is None else ctx.figures
        extra = {}
        if ctx is not None:
            torch = ctx.torch
            extra = {"torch": torch.__version__}
            gc.collect()
            try:
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 (the context is broken: this process can run no more cases)
                broken = short(f"{type(e).__name__}: {e}", 200)
            if broken is None:
                try:
                    ctx.empty_cache()  # the next case starts with what this one cached given back
                except Exception as e:  # noqa: BLE001
                    figures["empty_cache_after"] = short(f"{type(e).__name__}: {e}", 200)
            try:
                extra["device"] = torch.cuda.get_device_name(0)
            except Exception:  # noqa: BLE001, S110 (only a label)
                pass
            if broken is not None:
                if status in ("pass", "skip"):
                    status, detail = "fail", f"CUDA error after the case: {broken}"
                else:
                    detail += f" (then the CUDA context was broken: {broken})"
        _emit({"event": "result", "result": make_result(allocator, name, status, detail, figures,
                                                         time.monotonic() - began, **extra)}, out)
        if broken is not None:
            out.flush()
            os._exit(BROKEN_CONTEXT_EXIT)  # noqa: SLF001 (no clean-up through a broken context)
    return 0


# --- the driver: runs units in child processes -------------------------------------------------------------


class Budget:
    def __init__(self, seconds, clock=time.monotonic):
        self.clock, self.end = clock, clock() + seconds

    def left(self):
        return self.end - self.clock()


class Lines:
    """Lines from a pipe, with a deadline for each."""

    def __init__(self, stream):
        self.fd, self.buffer, self.eof = stream.fileno(), b"", False
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.fd, selectors.EVENT_READ)

    def next(self, seconds):
        """The next line (str), None at the end of the stream, or TimeoutError once `seconds` pass."""
        deadline = time.monotonic() + seconds
        while b"\n" not in self.buffer:
            if self.eof:
                break
            left = deadline - time.monotonic()
            if left <= 0 or not self.selector.select(left):
                raise TimeoutError
            chunk = os.read(self.fd, 65536)
            if chunk:
                self.buffer += chunk
            else:
                self.eof = True
        if b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
        elif self.buffer:
            line, self.buffer = self.buffer, b""
        else:
            return None
        return line.decode("utf-8", "replace")

    def close(self):
        self.selector.close()


def child_command(allocator, names):
    return [sys.executable, os.path.abspath(__file__), "--child", allocator, "--case", ",".join(names)]


def _kill(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the child's own session: it, and what it started
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _ended(returncode):
    if returncode is not None and returncode < 0:
        try:
            return f"died of {signal.Signals(-returncode).name}"
        except ValueError:
            return f"died of signal {-returncode}"
    return f"exited with status {returncode}"


def run_unit(allocator, names, budget, on_result, command=child_command, timeout_scale=1.0, verbose=False):
    """Runs the cases `names` under `allocator` in child processes: one, and a new one after a case that
    crashed, timed out or broke the CUDA context, for the cases still to run. Calls on_result(result) for
    each case, in order."""
    registry = torch_cases.CASES

    def time_limit(name, first):
        """(seconds, whether the budget rather than the case's limit set them)."""
        own = registry[name].timeout * timeout_scale + (STARTUP_SECONDS if first else 0)
        return min(own, max(budget.left(), 0)), budget.left() < own

    pending = list(names)
    while pending:
        if budget.left() < 5:
            for name in pending:
                on_result(make_result(allocator, name, "skip", "not run: the suite's time budget (--budget) was spent"))
            return
        with tempfile.TemporaryFile() as errors:
            process = subprocess.Popen(command(allocator, pending), stdout=subprocess.PIPE,
                                       stderr=None if verbose else errors, start_new_session=True)
            lines, current, progressed, began = Lines(process.stdout), None, False, time.monotonic()
            limit, by_budget = time_limit(pending[0], first=True)
            deadline = began + limit
            try:
                while True:
                    try:
                        line = lines.next(deadline - time.monotonic())
                    except TimeoutError:
                        _kill(process)
                        name = current or pending[0]
                        why = "the suite's time budget ran out" if by_budget else f"timed out after {limit:.0f} s"
                        on_result(make_result(allocator, name, "error", f"{why}; stderr: {_read_tail(errors)}",
                                              seconds=time.monotonic() - began))
                        pending.remove(name)
                        break
                    if line is None:  # the process ended
                        returncode = process.wait()
                        if current is not None or not progressed:
                            name = current or pending[0]
                            status, where = ("fail", "during the case") if current else ("error", "before the case started")
                            on_result(make_result(allocator, name, status, f"the process {_ended(returncode)} {where}; "
                                                  f"stderr: {_read_tail(errors)}", seconds=time.monotonic() - began))
                            pending.remove(name)
                        break
                    at = line.find(PREFIX)
                    if at < 0:
                        continue
                    try:
                        message = json.loads(line[at + len(PREFIX):])
                    except json.JSONDecodeError:
                        continue
                    if message["event"] == "start":
                        current, began = message["case"], time.monotonic()
                        limit, by_budget = time_limit(current, first=not progressed)
                        deadline = began + limit
                    elif message["event"] == "result":
                        result = message["result"]
                        on_result(result)
                        if result["case"] in pending:
                            pending.remove(result["case"])
                        current, progressed = None, True
            finally:
                lines.close()
                if process.poll() is None:
                    _kill(process)
                process.stdout.close()


def _read_tail(errors, chars=600):
    """The last `chars` characters the child wrote to its stderr file."""
    try:
        errors.flush()
        size = errors.seek(0, os.SEEK_END)
        errors.seek(max(0, size - chars))
        return short(errors.read().decode("utf-8", "replace"), chars) or "(empty)"
    except (OSError, ValueError):
        return "(unreadable)"


def run_suite(args, out=sys.stdout, command=child_command):
    began = time.monotonic()
    budget = Budget(args.budget)
    units, skipped = plan(args.allocators, args.cases, args.isolate)
    results = []
    sink = open(args.json, "w") if args.json else None  # noqa: SIM115 (closed below)

    def on_result(result):
        results.append(result)
        text = json.dumps(result)
        print(text, file=out, flush=True)
        if sink is not None:
            sink.write(text + "\n")
            sink.flush()

    try:
        for result in skipped:
            on_result(result)
        for allocator, names in units:
            run_unit(allocator, names, budget, on_result, command, args.timeout_scale, args.verbose)
    finally:
        if sink is not None:
            sink.close()
    print("\n" + format_table(results, args.allocators, args.cases), file=out)
    print(summary_line(results, time.monotonic() - began), file=out, flush=True)
    found = counts(results)
    return 1 if found["fail"] or found["error"] else 0


def list_cases(out=sys.stdout):
    for entry in torch_cases.CASES.values():
        where = "" if entry.allocators == ALLOCATORS else f" [{', '.join(entry.allocators)} only]"
        process = "own process" if entry.fresh else "shared process"
        print(f"{entry.name} ({entry.timeout:.0f} s, {process}){where}: {entry.summary}", file=out)


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        list_cases()
        return 0
    if args.table:
        results = read_results(args.table)
        print(format_table(results))
        print(summary_line(results))
        return 0
    # run.sh's time limit ends the driver with SIGTERM: exiting through run_unit's clean-up kills the child
    # process it was waiting for (each child runs in a session of its own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.child is not None:
        # The protocol keeps the real stdout; everything else written to it (PyTorch, libraries, C code) goes
        # to stderr.
        protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        return child_main(args.child, args.cases, protocol)
    return run_suite(args)


if __name__ == "__main__":
    sys.exit(main())
