#!/usr/bin/env python3
"""Replays a trace's allocations through PyTorch's CUDA allocator on a GPU (issue 21, step 6).

The trace is in cuvmm's format (``docs/trace-format.md``); any trace cuvmm reads converts to it::

    cuvmm workload --trace snapshot.pickle -o snap.trace
    python3 tools/torch_replay.py snap.trace                            # PyTorch's default allocator
    python3 tools/torch_replay.py snap.trace --allocator expandable     # expandable_segments:True
    python3 tools/torch_replay.py snap.trace --allocator cuvmm          # cuvmm plugged in (python/cuvmm_torch/)

Each allocation goes through ``torch.cuda.caching_allocator_alloc(size, device, stream)`` and each free
through ``caching_allocator_delete``, on one ``torch.cuda.Stream`` per stream number of the trace (0 is the
device's default stream), in the trace's order, as cuvmm's replay does. An allocation that fails with
out-of-memory is counted and its free and ``record_stream`` skipped. ``record_stream`` reaches cuvmm through
``cuvmm_torch.record_stream``; PyTorch's own allocator has no call for a raw pointer, so there they are
counted as skipped. Prints one JSON object: the peaks of reserved and allocated memory, the out-of-memory
count and the wall time of the loop (with a device synchronization at its end).

The trace reader and the replay loop need no PyTorch (``python/test_torch_replay.py`` runs them on a fake
allocator); only ``TorchAllocator`` does. Results on an H100: ``docs/gpu-results.md``.
"""

import argparse
import json
import os
import re
import sys
import time

HEADER = "# cuvmm-trace v1"
MAX_SIZE = 1 << 50
MAX_NUMBER = (1 << 64) - 1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TraceError(ValueError):
    """A trace file that does not follow ``docs/trace-format.md``; the message names the line."""


class OutOfMemory(Exception):
    """An allocation the allocator refused for lack of memory."""


def _number(word, what, where):
    if not word.isascii() or not word.isdigit() or int(word) > MAX_NUMBER:
        raise TraceError(f"{where}: {what} `{word}` is not a decimal number below 2^64")
    return int(word)


def _unescape(text, where):
    out, chars = [], iter(text)
    for c in chars:
        if c != "\\":
            out.append(c)
            continue
        escaped = next(chars, None)
        if escaped not in ("\\", "n", "r"):
            raise TraceError(f"{where}: the name has `\\{escaped or ''}`; only \\\\, \\n and \\r are allowed")
        out.append({"\\": "\\", "n": "\n", "r": "\r"}[escaped])
    return "".join(out)


# Record -> the names of its numeric fields.
_FIELDS = {
    "alloc": ("ID", "SIZE", "STREAM"),
    "free": ("ID",),
    "record_stream": ("ID", "STREAM"),
    "empty_cache": (),
}


def parse_trace(text, source="<trace>"):
    """``(name, events)`` of a cuvmm trace given as text. Events are ``("alloc", id, size, stream)``,
    ``("free", id)``, ``("record_stream", id, stream)`` and ``("empty_cache",)``. Raises ``TraceError``
    naming the line for anything ``docs/trace-format.md`` refuses, including events no program could make (a
    free of an id that is not live, an id allocated twice while live), as ``cuvmm-lab/src/trace/text.rs`` does."""
    lines = text.removeprefix("\ufeff").split("\n")
    lines = [line.removesuffix("\r") for line in lines]
    if lines[0] != HEADER:
        version = lines[0].startswith("# cuvmm-trace v")
        raise TraceError(f"{source}: line 1: " + ("unsupported version" if version else "not a cuvmm trace"))
    name, events, live = None, [], set()
    for number, line in enumerate(lines[1:], start=2):
        where = f"{source}: line {number}"
        record = line.lstrip()
        if not record or record.startswith("#"):
            continue
        if record == "name" or record.startswith(("name ", "name\t")):
            if name is not None or events:
                raise TraceError(f"{where}: `name` must come once, before the first event")
            name = _unescape(record[5:], where)
            continue
        word, *words = re.split(r"[ \t\n\r\x0c]+", record.strip())
        fields = _FIELDS.get(word)
        if fields is None:
            raise TraceError(f"{where}: unknown record `{word}`")
        if len(words) != len(fields):
            raise TraceError(f"{where}: `{word}` takes {len(fields)} field(s), found {len(words)}")
        values = tuple(_number(w, f, where) for w, f in zip(words, fields))
        if word == "alloc":
            if not 1 <= values[1] <= MAX_SIZE:
                raise TraceError(f"{where}: size {values[1]} is not 1 to 2^50 bytes")
            if values[0] in live:
                raise TraceError(f"{where}: id {values[0]} is allocated while live")
            live.add(values[0])
        elif word != "empty_cache":
            if values[0] not in live:
                raise TraceError(f"{where}: `{word}` of id {values[0]}, which is not live")
            if word == "free":
                live.discard(values[0])
        events.append((word, *values))
    return (os.path.basename(source) if name is None else name), events


def read_trace(path):
    """``parse_trace`` of the file at ``path`` (UTF-8)."""
    with open(path, encoding="utf-8", newline="") as f:
        return parse_trace(f.read(), source=os.fspath(path))


def replay(events, allocator, clock=time.perf_counter):
    """Replays ``events`` through ``allocator`` (``alloc(size, stream) -> ptr`` raising ``OutOfMemory``,
    ``free(ptr, size, stream)``, ``record_stream(ptr, stream) -> bool`` (False: not supported, skipped),
    ``empty_cache()``, ``synchronize()``). Returns counts and the loop's wall seconds."""
    live, failed = {}, set()
    counts = {"allocs": 0, "frees": 0, "ooms": 0, "record_streams": 0, "record_streams_skipped": 0, "empty_caches": 0}
    start = clock()
    for event in events:
        kind = event[0]
        if kind == "alloc":
            _, ident, size, stream = event
            try:
                live[ident] = (allocator.alloc(size, stream), size, stream)
                counts["allocs"] += 1
            except OutOfMemory:
                counts["ooms"] += 1
                failed.add(ident)
        elif kind == "free":
            if event[1] in failed:
                failed.discard(event[1])
                continue
            ptr, size, stream = live.pop(event[1])
            allocator.free(ptr, size, stream)
            counts["frees"] += 1
        elif kind == "record_stream":
            if event[1] in failed:
                continue
            done = allocator.record_stream(live[event[1]][0], event[2])
            counts["record_streams" if done else "record_streams_skipped"] += 1
        else:
            allocator.empty_cache()
            counts["empty_caches"] += 1
    allocator.synchronize()
    counts["wall_seconds"] = clock() - start
    counts["events"] = len(events)
    return counts


class TorchAllocator:
    """PyTorch's CUDA allocator on ``device``: its own (``native``, ``expandable``) or cuvmm plugged in
    (``cuvmm``). Build it before anything allocates on the GPU: both choices take effect only then."""

    def __init__(self, kind, device=0, cuvmm_lib=None):
        if kind == "expandable":
            conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
        import torch  # noqa: PLC0415 (only the GPU replay needs PyTorch)

        if not torch.cuda.is_available():
            raise RuntimeError("PyTorch sees no CUDA device")
        self.torch, self.kind, self.device = torch, kind, device
        self.cuvmm = None
        if kind == "cuvmm":
            sys.path.insert(0, os.path.join(ROOT, "python"))
            import cuvmm_torch  # noqa: PLC0415

            cuvmm_torch.install(cuvmm_lib)
            self.cuvmm = cuvmm_torch
        torch.cuda.set_device(device)
        self.streams = {0: torch.cuda.default_stream(device)}
        self.oom_errors = tuple(
            e for e in (getattr(torch.cuda, "OutOfMemoryError", None), getattr(torch, "OutOfMemoryError", None)) if e
        )

    def stream(self, number):
        if number not in self.streams:
            self.streams[number] = self.torch.cuda.Stream(self.device)
        return self.streams[number]

    def alloc(self, size, stream):
        try:
            return self.torch.cuda.caching_allocator_alloc(size, self.device, self.stream(stream))
        except self.oom_errors as e:
            raise OutOfMemory(str(e)) from e
        except RuntimeError as e:
            if "out of memory" in str(e):
                raise OutOfMemory(str(e)) from e
            raise

    def free(self, ptr, size, stream):
        self.torch.cuda.caching_allocator_delete(ptr)

    def record_stream(self, ptr, stream):
        if self.cuvmm is None:
            return False
        self.cuvmm.record_stream(ptr, self.stream(stream), self.device)
        return True

    def empty_cache(self):
        if self.cuvmm is None:
            self.torch.cuda.empty_cache()
        else:
            self.cuvmm.empty_cache(self.device)

    def synchronize(self):
        self.torch.cuda.synchronize(self.device)

    def peaks(self):
        if self.cuvmm is None:
            return self.torch.cuda.max_memory_reserved(self.device), self.torch.cuda.max_memory_allocated(self.device)
        stats = self.cuvmm.memory_stats(self.device)
        return stats["reserved_bytes.all.peak"], stats["allocated_bytes.all.peak"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a trace in cuvmm's format (cuvmm workload --trace FILE -o OUT)")
    parser.add_argument("--allocator", choices=["native", "expandable", "cuvmm"], default="native")
    parser.add_argument("--device", type=int, default=0, help="the CUDA device (default 0)")
    parser.add_argument("--cuvmm-lib", help="libcuvmm_torch.so to plug in (default: as python/cuvmm_torch/ finds it)")
    args = parser.parse_args(argv)
    try:
        name, events = read_trace(args.trace)
    except (OSError, UnicodeDecodeError, TraceError) as e:
        print(f"torch_replay: {e}", file=sys.stderr)
        return 2
    try:
        allocator = TorchAllocator(args.allocator, args.device, args.cuvmm_lib)
    except (ImportError, RuntimeError, OSError) as e:
        print(f"torch_replay: cannot use the GPU: {e}", file=sys.stderr)
        return 2
    result = {"trace": name, "allocator": args.allocator, "device": args.device}
    result["device_name"] = allocator.torch.cuda.get_device_name(args.device)
    result["torch_version"] = allocator.torch.__version__
    result["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    result.update(replay(events, allocator))
    result["max_reserved_bytes"], result["max_allocated_bytes"] = allocator.peaks()
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
