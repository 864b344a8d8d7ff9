"""Tests of the GPU tools' logic that needs no GPU: tools/train_gpt.py's sequence lengths and fraction search
(on a fake training run), tools/gpu/fit_latency.py's fit, and tools/gpu/tables.py's reader.

    python3 -m unittest discover -s python -v
"""

import argparse
import io
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tools", "gpu"))
import fit_latency  # noqa: E402 (tools/ is not a package: on the path first)
import tables  # noqa: E402
import train_gpt  # noqa: E402

GIB = 1 << 30
TOTAL = 80 * GIB


def fake_run(needs, calls):
    """A training run that completes with a limit of at least `needs` of the device, recording each fraction."""

    def child(args, fraction):
        calls.append(fraction)
        ok = fraction >= needs
        return {"error": None if ok else "out of memory", "completed": args.steps if ok else 3,
                "total_bytes": TOTAL, "max_allocated_bytes": int(0.15 * TOTAL),
                "max_reserved_bytes": int(0.19 * TOTAL), "median_step_ms": 10.0}

    return child


def search_args(resolution=0.002):
    return argparse.Namespace(allocator="native", steps=50, resolution=resolution, ballast=False)


class TrainGptTest(unittest.TestCase):
    def test_sequence_lengths_are_multiples_of_64_in_range_and_repeatable(self):
        lengths = train_gpt.sequence_lengths(500, 64, 1024, seed=3)
        self.assertEqual(lengths, train_gpt.sequence_lengths(500, 64, 1024, seed=3))
        self.assertNotEqual(lengths, train_gpt.sequence_lengths(500, 64, 1024, seed=4))
        self.assertTrue(all(64 <= n <= 1024 and n % 64 == 0 for n in lengths))
        self.assertTrue({64, 1024} <= set(lengths))

    def test_search_finds_the_smallest_fraction_within_the_resolution(self):
        for needs in (0.1613, 0.25, 0.5):
            calls = []
            child = train_gpt.child
            train_gpt.child = fake_run(needs, calls)
            try:
                result = train_gpt.search(search_args())
            finally:
                train_gpt.child = child
            found = result["smallest_fraction"]
            self.assertGreaterEqual(found, needs, result)
            self.assertLessEqual(found - needs, 0.002, result)
            self.assertEqual(calls[0], 1.0, "the unconstrained run comes first")
            # Every fraction tried is recorded with its outcome, failures with their error.
            self.assertEqual([t[0] for t in result["tried"]], calls)
            self.assertTrue(all(t[1] == (t[0] >= needs) for t in result["tried"]))
            self.assertTrue(all(len(t) == 3 for t in result["tried"] if not t[1]))
            self.assertEqual(result["limit"], "set_per_process_memory_fraction")

    def test_a_run_that_fails_unconstrained_has_no_fraction(self):
        child = train_gpt.child
        train_gpt.child = fake_run(2.0, [])
        try:
            result = train_gpt.search(search_args())
        finally:
            train_gpt.child = child
        self.assertIsNone(result["smallest_fraction"])

    def test_bad_arguments_are_refused(self):
        for argv in (["--fraction", "0"], ["--fraction", "1.5"], ["--min-seq", "2048"], ["--heads", "7"]):
            with self.assertRaises(SystemExit) as stop, redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
                train_gpt.main(argv)
            self.assertEqual(stop.exception.code, 2, argv)


class FitLatencyTest(unittest.TestCase):
    def test_a_line_is_recovered_exactly(self):
        points = [(x, 13.0 + 0.5 * x) for x in (1, 10, 32, 256, 512)]
        a, b = fit_latency.line(points)
        self.assertAlmostEqual(a, 13.0, places=6)
        self.assertAlmostEqual(b, 0.5, places=6)

    def test_neither_part_goes_below_zero(self):
        a, b = fit_latency.line([(1, 20.0), (10, 15.0), (100, 5.0)])
        self.assertEqual(b, 0.0)
        self.assertGreater(a, 0.0)


class TablesTest(unittest.TestCase):
    def test_objects_are_read_between_other_lines(self):
        text = 'running\n{"a": 1,\n "b": {"c": 2}}\nnoise {not json}\n{"d": [1, 2]}\n'
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(text)
        try:
            self.assertEqual(tables.objects(f.name), [{"a": 1, "b": {"c": 2}}, {"d": [1, 2]}])
        finally:
            os.unlink(f.name)

    def test_the_driver_bench_files_in_the_docs_fit(self):
        path = os.path.join(ROOT, "docs", "gpu-results", "driver-bench-h100.json")
        with open(path) as f:
            report = json.load(f)
        pages = report["pages"]
        a, b = fit_latency.line([(p["page_bytes"] / fit_latency.UNIT, p["map_us"]) for p in pages])
        # latency.rs: map 1 130 ns fixed, 1 ns per 2 MiB on the H100.
        self.assertAlmostEqual(a * 1000, 1130, delta=1)
        self.assertAlmostEqual(b * 1000, 1, delta=1)


if __name__ == "__main__":
    unittest.main()
