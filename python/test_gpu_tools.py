"""Tests of the GPU tools' logic that needs no GPU: tools/train_gpt.py's sequence lengths and fraction search
(on a fake training run), tools/gpu/fit_latency.py's fit, tools/gpu/tables.py's reader, the `wheel` step's
verdict (tools/gpu/wheel_reports.py), tools/cli_check.py's reading of the README and tools/gpu/pin_rate.py's
pieces, arguments, table and answer without a driver.

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
import cli_check  # noqa: E402
import fit_latency  # noqa: E402 (tools/ is not a package: on the path first)
import pin_rate  # noqa: E402
import tables  # noqa: E402
import train_gpt  # noqa: E402
import wheel_reports  # noqa: E402

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


def train_report(backend, **changes):
    """What tools/gpu/train_transformers.py writes, for a run that went well."""
    report = {"backend": backend, "rank": None, "device": 0, "torch": "2.11.0", "steps": 20, "seconds": 4.5,
              "losses": [9.2, 7.9], "losses_finite": True, "max_memory_reserved": 900 << 20, "segments": 3,
              "expandable_segments": 3 if backend == "cuvmm" else 0,
              "memory_stats": {"allocated_bytes.all.current": 300 << 20, "allocated_bytes.all.peak": 800 << 20,
                               "reserved_bytes.all.peak": 900 << 20}}
    report.update(changes)
    return report


class WheelReports(unittest.TestCase):
    """The `wheel` step's verdict on the training script's reports."""

    def reports(self, **changes):
        reports = {"cuvmm": train_report("cuvmm"), "torchrun": train_report("cuvmm", rank="0"),
                   "native": train_report("native")}
        reports.update(changes)
        return reports

    def test_cuvmms_figures_under_both_runs_pass(self):
        self.assertEqual(wheel_reports.problems(self.reports()), [])

    def test_each_sign_of_another_allocator_is_named(self):
        cases = {
            "python -m cuvmm_torch: allocator backend 'native'": {"cuvmm": dict(train_report("cuvmm"), backend="native")},
            "python -m cuvmm_torch: 2 of 3 segments expandable": {"cuvmm": train_report("cuvmm", expandable_segments=2)},
            "torchrun -m cuvmm_torch: no report": {"torchrun": None},
            "torchrun -m cuvmm_torch: a loss is not finite": {"torchrun": train_report("cuvmm", rank="0",
                                                                                      losses_finite=False)},
            "python -m cuvmm_torch: 0 of 0 segments expandable": {"cuvmm": train_report("cuvmm", segments=0,
                                                                                         expandable_segments=0)},
            "PyTorch's own allocator: backend 'cuvmm'": {"native": train_report("cuvmm")},
        }
        for expected, changes in cases.items():
            self.assertEqual(wheel_reports.problems(self.reports(**changes)), [expected])
        empty = train_report("cuvmm", memory_stats={"allocated_bytes.all.current": 0, "allocated_bytes.all.peak": 0,
                                                    "reserved_bytes.all.peak": 0})
        (problem,) = wheel_reports.problems(self.reports(cuvmm=empty))
        self.assertTrue(problem.startswith("python -m cuvmm_torch: memory_stats"), problem)

    def test_it_reads_the_files_and_sets_the_status(self):
        with tempfile.TemporaryDirectory() as out:
            for name, report in self.reports().items():
                with open(os.path.join(out, f"wheel-{name}.json"), "w") as file:
                    json.dump(report, file)
            with redirect_stdout(io.StringIO()) as printed:
                self.assertEqual(wheel_reports.main(out), 0)
            self.assertIn("cuvmm: backend cuvmm, peak allocated 838860800", printed.getvalue())
            os.remove(os.path.join(out, "wheel-torchrun.json"))
            with redirect_stdout(io.StringIO()) as printed:
                self.assertEqual(wheel_reports.main(out), 1)
            self.assertTrue(printed.getvalue().strip().endswith("torchrun -m cuvmm_torch: no report"))


class CliCheckReadme(unittest.TestCase):
    """tools/cli_check.py finds in the README what it checks a cuvmm binary against."""

    @classmethod
    def setUpClass(cls):
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as file:
            cls.text = file.read()

    def test_the_capacity_and_frontier_examples(self):
        examples = {" ".join(args): lines for args, lines in cli_check.readme_examples(self.text)}
        self.assertIn("capacity --workload moe", examples)
        self.assertTrue(any(args.startswith("frontier --workload moe") for args in examples), examples)
        self.assertTrue(examples["capacity --workload moe"][0].startswith("trace  allocator"))
        lines = examples["capacity --workload moe"]
        self.assertEqual(lines.index(""), 4, "the header and one line per allocator, then the stranded pages'")
        self.assertTrue(any(line.startswith("moe    cuvmm") and "compaction:split" in line for line in lines[5:]),
                        lines)

    def test_a_traces_rows_of_the_results_table(self):
        rows = cli_check.readme_table_rows(self.text, "bert_large_inference.pickle")
        self.assertEqual(sorted(rows), ["classic", "cuvmm", "cuvmm, compaction:split", "pytorch-expandable"])
        min_capacity, reserved, calls = rows["cuvmm"]
        self.assertRegex(min_capacity, r"^\d+\.\d\d GiB \(\d\.\d{3}\)$")
        self.assertRegex(reserved, r"^\d+\.\d\d GiB$")
        self.assertTrue(calls.isdigit(), calls)
        self.assertEqual(cli_check.readme_table_rows(self.text, "no_such_trace.pickle"), {})


if __name__ == "__main__":
    unittest.main()


class PinRateTest(unittest.TestCase):
    def test_pieces_cover_the_bytes_once(self):
        parts = pin_rate.pieces(10 * pin_rate.MIB + 5, 4 * pin_rate.MIB)
        self.assertEqual([length for _, length in parts], [4 * pin_rate.MIB, 4 * pin_rate.MIB, 2 * pin_rate.MIB + 5])
        self.assertEqual([at for at, _ in parts], [0, 4 * pin_rate.MIB, 8 * pin_rate.MIB])

    def test_bad_arguments_are_refused(self):
        for argv in (["--threads", "0"], ["--threads", "a"], ["--gib", "0"], ["--piece-mib", "-1"], ["--way", "x"]):
            with redirect_stderr(io.StringIO()), self.assertRaises(SystemExit) as raised:
                pin_rate.parse_args(argv)
            self.assertEqual(raised.exception.code, 2, argv)
        self.assertEqual(pin_rate.parse_args(["--threads", "2,16"]).threads, [2, 16])

    def test_the_table_shows_each_way_and_a_failure(self):
        ok = {"way": "alloc", "threads": 4, "bytes": 8 * GIB, "pin_s": 4.2, "gbps": 2.05, "copy_gbps": 47.9}
        failed = {"way": "register-huge", "threads": 8, "bytes": 8 * GIB, "error": "cuMemHostRegister_v2 failed"}
        text = pin_rate.table([ok, failed])
        self.assertIn("| alloc | 4 | 8 | - | 4.2 | 2.05 | 47.9 |", text)
        self.assertIn("| register-huge | 8 | 8 | error: cuMemHostRegister_v2 failed |", text)

    def test_without_a_driver_it_says_so_in_one_line_and_exits_2(self):
        try:
            import ctypes

            ctypes.CDLL("libcuda.so.1")
        except OSError:
            pass
        else:
            self.skipTest("a CUDA driver is here")
        out = io.StringIO()
        with redirect_stdout(out):
            status = pin_rate.main(["--gib", "1"])
        self.assertEqual(status, 2)
        self.assertTrue(out.getvalue().startswith("pin_rate: no CUDA driver found: "), out.getvalue())
        self.assertEqual(out.getvalue().count("\n"), 1)
