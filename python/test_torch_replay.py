"""Tests of tools/torch_replay.py without a GPU or PyTorch: its trace reader against the format's rules and
against what ``cuvmm`` writes, and its replay loop on a fake allocator. (The replay through PyTorch itself
needs a GPU: docs/gpu.md.)

    python3 -m unittest discover -s python -v        # after `cargo build --release`
"""

import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stderr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import torch_replay  # noqa: E402 (tools/ is not a package: on the path first)
from torch_replay import OutOfMemory, TraceError, parse_trace, replay  # noqa: E402

HEADER = "# cuvmm-trace v1\n"


class FakeAllocator:
    """Hands out increasing addresses, refuses requests above ``limit`` bytes, and keeps the peak of live
    bytes and every call."""

    def __init__(self, limit=1 << 60, record_streams=True):
        self.limit, self.supports_record_stream = limit, record_streams
        self.next, self.live, self.peak, self.calls = 1 << 20, {}, 0, []

    def alloc(self, size, stream):
        self.calls.append(("alloc", size, stream))
        if size > self.limit:
            raise OutOfMemory(f"{size} bytes")
        ptr, self.next = self.next, self.next + size
        self.live[ptr] = size
        self.peak = max(self.peak, sum(self.live.values()))
        return ptr

    def free(self, ptr, size, stream):
        self.calls.append(("free", ptr, size, stream))
        assert self.live.pop(ptr) == size

    def record_stream(self, ptr, stream):
        self.calls.append(("record_stream", ptr, stream))
        return self.supports_record_stream

    def empty_cache(self):
        self.calls.append(("empty_cache",))

    def synchronize(self):
        self.calls.append(("synchronize",))


def cuvmm_binary():
    for candidate in [os.environ.get("CUVMM_BIN"), os.path.join(ROOT, "target", "release", "cuvmm")]:
        if candidate and os.path.exists(candidate):
            return candidate
    return None


class Reader(unittest.TestCase):
    def test_reads_every_record_comments_crlf_and_a_byte_order_mark(self):
        text = "\ufeff" + HEADER + "name a\\\\b\\nc  \r\n\t# comment\n\n  alloc 7 512\t3\n"
        text += "record_stream 7 0\nfree 7\nempty_cache"
        name, events = parse_trace(text)
        self.assertEqual(name, "a\\b\nc  ")
        self.assertEqual(events, [("alloc", 7, 512, 3), ("record_stream", 7, 0), ("free", 7), ("empty_cache",)])
        # Without a name line, the trace is named after its file; an id may be used again once freed.
        name, events = parse_trace(HEADER + "alloc 1 1 0\nfree 1\nalloc 1 2 0\n", source="/x/run.trace")
        self.assertEqual((name, len(events)), ("run.trace", 3))

    def test_refuses_what_the_format_refuses_naming_the_line(self):
        cases = [
            ("", "line 1: not a cuvmm trace"),
            ("# cuvmm-trace v2\n", "line 1: unsupported version"),
            (HEADER + "alloc 1 512\n", "line 2: `alloc` takes 3"),
            (HEADER + "alloc 1 0x10 0\n", "line 2: SIZE `0x10`"),
            (HEADER + "alloc 1 -5 0\n", "line 2: SIZE `-5`"),
            (HEADER + "alloc 1 0 0\n", "line 2: size 0"),
            (HEADER + f"alloc 1 {(1 << 50) + 1} 0\n", "line 2: size"),
            (HEADER + f"alloc {1 << 64} 1 0\n", "line 2: ID"),
            (HEADER + "malloc 1 1 0\n", "line 2: unknown record `malloc`"),
            (HEADER + "\nfree 3\n", "line 3: `free` of id 3"),
            (HEADER + "alloc 1 1 0\nalloc 1 1 0\n", "line 3: id 1 is allocated while live"),
            (HEADER + "alloc 1 1 0\nfree 1\nrecord_stream 1 2\n", "line 4: `record_stream` of id 1"),
            (HEADER + "alloc 1 1 0\nname late\n", "line 3: `name` must come once"),
            (HEADER + "name a\\tb\n", "line 2: the name has `\\t`"),
        ]
        for text, message in cases:
            with self.subTest(text=text):
                with self.assertRaises(TraceError) as caught:
                    parse_trace(text, source="t.trace")
                self.assertIn("t.trace: " + message, str(caught.exception))

    def test_reads_what_cuvmm_writes(self):
        """Every built-in workload written by `cuvmm workload` reads back with the events `cuvmm compare`
        counts, and replayed on the fake allocator reaches the peak live bytes it reports."""
        binary = cuvmm_binary()
        if binary is None:
            self.skipTest("no cuvmm binary: run `cargo build --release` first, or set CUVMM_BIN")
        listed = subprocess.run([binary, "workloads"], check=True, capture_output=True, text=True).stdout
        compared = subprocess.run(
            [binary, "compare", "--format", "json", "--quiet"],
            check=True,
            capture_output=True,
            text=True,
        )
        results = {r["workload"]: r for r in json.loads(compared.stdout)["results"] if r["allocator"] == "cuvmm"}
        self.assertTrue(results)
        for workload, expected in results.items():
            self.assertIn(workload, listed)
            with tempfile.TemporaryDirectory() as scratch:
                path = os.path.join(scratch, "w.trace")
                subprocess.run([binary, "workload", workload, "-o", path], check=True, capture_output=True)
                name, events = torch_replay.read_trace(path)
            self.assertEqual(name, workload)
            self.assertEqual(len(events), expected["events"])
            fake = FakeAllocator()
            counts = replay(events, fake)
            self.assertEqual(fake.peak, expected["peak_live_bytes"], workload)
            self.assertEqual(counts["ooms"], 0)
            kinds = [event[0] for event in events]
            self.assertEqual((counts["allocs"], counts["frees"]), (kinds.count("alloc"), kinds.count("free")))


class Replay(unittest.TestCase):
    def test_an_allocation_refused_skips_its_free_and_record_streams(self):
        _, events = parse_trace(
            HEADER + "alloc 1 100 0\nalloc 2 5000 1\nrecord_stream 2 0\nrecord_stream 1 1\nfree 2\nalloc 2 10 0\n"
            "empty_cache\nfree 1\nfree 2\n"
        )
        ticks = iter([10.0, 12.5])
        fake = FakeAllocator(limit=1000)
        counts = replay(events, fake, clock=lambda: next(ticks))
        self.assertEqual(
            counts,
            {
                "events": 9,
                "allocs": 2,
                "frees": 2,
                "ooms": 1,
                "record_streams": 1,
                "record_streams_skipped": 0,
                "empty_caches": 1,
                "wall_seconds": 2.5,
            },
        )
        self.assertEqual(fake.live, {})
        self.assertEqual(fake.calls[-1], ("synchronize",))
        self.assertEqual([c[0] for c in fake.calls].count("alloc"), 3)

    def test_record_streams_an_allocator_cannot_take_are_counted_as_skipped(self):
        _, events = parse_trace(HEADER + "alloc 1 100 0\nrecord_stream 1 4\nrecord_stream 1 5\nfree 1\n")
        counts = replay(events, FakeAllocator(record_streams=False))
        self.assertEqual((counts["record_streams"], counts["record_streams_skipped"]), (0, 2))


class Main(unittest.TestCase):
    def run_main(self, *argv):
        err = io.StringIO()
        with redirect_stderr(err):
            status = torch_replay.main(list(argv))
        return status, err.getvalue()

    def test_a_bad_trace_is_one_line_and_status_2(self):
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "bad.trace")
            with open(path, "w") as f:
                f.write(HEADER + "free 1\n")
            status, err = self.run_main(path)
        self.assertEqual(status, 2)
        self.assertEqual(err, f"torch_replay: {path}: line 2: `free` of id 1, which is not live\n")
        status, err = self.run_main(os.path.join(ROOT, "no", "such.trace"))
        self.assertEqual(status, 2)
        self.assertTrue(err.startswith("torch_replay: ") and err.count("\n") == 1, err)

    @unittest.skipIf(importlib.util.find_spec("torch") is not None, "PyTorch is installed here")
    def test_without_pytorch_it_says_so(self):
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "ok.trace")
            with open(path, "w") as f:
                f.write(HEADER + "alloc 1 512 0\nfree 1\n")
            status, err = self.run_main(path, "--allocator", "native")
        self.assertEqual(status, 2)
        self.assertTrue(err.startswith("torch_replay: cannot use the GPU: "), err)


if __name__ == "__main__":
    unittest.main()
