"""Tests of tools/gpu/torch_suite.py's parts that need no PyTorch and no GPU: the case registry, argument
parsing, the plan of processes, the classification of exceptions, result and table formatting, and the driver
running fake child processes (one that answers, one that crashes, one that hangs).

    python3 -m unittest discover -s python -v
"""

import io
import json
import os
import sys
import tempfile
import textwrap
import unittest
from contextlib import redirect_stderr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "gpu"))
_had_torch = "torch" in sys.modules
import torch_cases  # noqa: E402 (tools/gpu is not a package: on the path first)
import torch_suite  # noqa: E402

BRIEF_CASES = ["record_stream", "record_stream_cuvmm", "memory_limit", "graphs_back_to_back",
               "graph_after_empty_cache", "graph_threads", "free_in_capture_used_elsewhere",
               "compile_reduce_overhead", "memory_stats", "oom",
               "multiprocessing", "nccl", "cudnn_benchmark", "caching_allocator_off", "transformers", "sleep_wake",
               "mempool", "mempool_own_allocator",
               "compile_train_two_shapes", "ipc_cuvmm_to_pytorch", "ipc_pytorch_to_cuvmm",
               "ipc_many_tensors", "sleep_mode_pool",
               "release_stranded", "split_under_limit"]


def parse(*argv):
    with redirect_stderr(io.StringIO()):
        return torch_suite.parse_args(list(argv))


class RegistryTest(unittest.TestCase):
    def test_importing_the_suite_does_not_import_torch(self):
        if _had_torch:
            self.skipTest("torch was imported before this test")
        self.assertNotIn("torch", sys.modules)

    def test_every_case_is_registered_in_order_with_a_limit_and_a_summary(self):
        self.assertEqual(list(torch_cases.CASES), BRIEF_CASES)
        for case in torch_cases.CASES.values():
            self.assertTrue(callable(case.run), case.name)
            self.assertTrue(0 < case.timeout <= 300, case.name)
            self.assertGreater(len(case.summary), 20, case.name)
            self.assertTrue(set(case.allocators) <= set(torch_cases.ALLOCATORS), case.name)

    def test_a_case_that_prepares_the_allocator_has_a_process_of_its_own(self):
        for case in torch_cases.CASES.values():
            if case.prepare is not None:
                self.assertTrue(case.fresh, case.name)
        self.assertIsNotNone(torch_cases.CASES["memory_limit"].prepare)
        # Exact accounting, or a state later cases would inherit.
        for name in ("memory_stats", "oom", "memory_limit", "compile_reduce_overhead", "transformers"):
            self.assertTrue(torch_cases.CASES[name].fresh, name)

    def test_the_cuvmm_variant_applies_to_cuvmm_only(self):
        self.assertEqual(torch_cases.CASES["record_stream_cuvmm"].allocators, ("cuvmm",))
        self.assertEqual(torch_cases.CASES["ipc_cuvmm_to_pytorch"].allocators, ("cuvmm",))
        self.assertEqual(torch_cases.CASES["release_stranded"].allocators, ("cuvmm",))
        self.assertEqual(torch_cases.CASES["split_under_limit"].allocators, ("cuvmm",))
        self.assertIsNotNone(torch_cases.CASES["split_under_limit"].prepare)
        self.assertEqual(torch_cases.CASES["ipc_pytorch_to_cuvmm"].allocators, ("native", "expandable"))
        self.assertEqual(torch_cases.CASES["record_stream"].allocators, torch_cases.ALLOCATORS)

    def test_a_name_cannot_be_registered_twice(self):
        with self.assertRaises(ValueError):
            torch_cases.case("oom", "again", 1)(lambda ctx: "")

    def test_memory_stats_sizes_round_to_512(self):
        self.assertEqual([torch_cases.features.round_512(s) for s in (1, 511, 512, 513, 1024)], [512, 512, 512, 1024, 1024])
        for size in torch_cases.features.STATS_SIZES:
            if size > torch_cases.MIB:
                # Large blocks are exact only if the segment keeps more than 1 MiB after them (then PyTorch
                # splits it): 20 MiB segments below 10 MiB, else rounded up to 2 MiB.
                segment = 20 * torch_cases.MIB if size < 10 * torch_cases.MIB else -(-size // (2 << 20)) * (2 << 20)
                self.assertGreater(segment - torch_cases.features.round_512(size), torch_cases.MIB, size)


class AllocatorEnvironmentTest(unittest.TestCase):
    def test_expandable_is_added_once_and_kept_out_of_the_others(self):
        env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"}
        self.assertEqual(torch_cases.allocator_environment("expandable", env, ROOT),
                         {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"})
        self.assertEqual(torch_cases.allocator_environment("native", env, ROOT),
                         {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
        self.assertEqual(torch_cases.allocator_environment("native", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, ROOT),
                         {"PYTORCH_CUDA_ALLOC_CONF": None})
        self.assertEqual(torch_cases.allocator_environment("native", {}, ROOT), {})
        self.assertEqual(torch_cases.allocator_environment("expandable", {}, ROOT),
                         {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})

    def test_cuvmm_finds_the_built_library_unless_told(self):
        with tempfile.TemporaryDirectory() as folder:
            library = os.path.join(folder, "libcuvmm_torch.so")
            open(library, "w").close()
            found = torch_cases.allocator_environment("cuvmm", {"GPU_BIN": folder}, ROOT)
            self.assertEqual(found, {"CUVMM_TORCH_LIB": os.path.realpath(library)})
            told = torch_cases.allocator_environment("cuvmm", {"GPU_BIN": folder, "CUVMM_TORCH_LIB": "/x.so"}, ROOT)
            self.assertEqual(told, {})
            self.assertEqual(torch_cases.allocator_environment("cuvmm", {}, folder), {})


class ArgumentsTest(unittest.TestCase):
    def test_defaults_are_every_allocator_and_case(self):
        args = parse()
        self.assertEqual(args.allocators, ["native", "expandable", "cuvmm"])
        self.assertEqual(args.cases, BRIEF_CASES)
        self.assertIsNone(args.json)
        self.assertFalse(args.isolate)
        self.assertGreater(args.budget, 0)

    def test_names_repeat_or_come_comma_separated_and_keep_the_registry_order(self):
        args = parse("--allocator", "cuvmm,native", "--case", "oom", "--case", "record_stream, nccl")
        self.assertEqual(args.allocators, ["native", "cuvmm"])
        self.assertEqual(args.cases, ["record_stream", "oom", "nccl"])

    def test_unknown_names_and_bad_numbers_are_refused(self):
        for argv in (["--allocator", "classic"], ["--case", "nope"], ["--budget", "0"], ["--timeout-scale", "-1"],
                     ["--child", "classic"]):
            with self.assertRaises(SystemExit, msg=argv):
                parse(*argv)


class PlanTest(unittest.TestCase):
    def test_shared_cases_first_per_allocator_then_fresh_ones_cheapest_first(self):
        units, skipped = torch_suite.plan(["native", "cuvmm"], BRIEF_CASES)
        registry = torch_cases.CASES
        shared = [c for c in BRIEF_CASES if not registry[c].fresh]
        applies = {a: [c for c in shared if a in registry[c].allocators] for a in ("native", "cuvmm")}
        self.assertEqual(units[0], ("native", applies["native"]))
        self.assertEqual(units[1], ("cuvmm", applies["cuvmm"]))
        self.assertNotIn("record_stream_cuvmm", applies["native"])
        self.assertNotIn("ipc_pytorch_to_cuvmm", applies["cuvmm"])
        fresh = units[2:]
        self.assertTrue(all(len(names) == 1 and registry[names[0]].fresh for _, names in fresh))
        limits = [registry[names[0]].timeout for _, names in fresh]
        self.assertEqual(limits, sorted(limits))
        applies = [(a, c.name) for c in registry.values() if c.fresh for a in ("native", "cuvmm") if a in c.allocators]
        self.assertEqual(sorted((a, names[0]) for a, names in fresh), sorted(applies))
        self.assertEqual([(r["allocator"], r["case"], r["status"]) for r in skipped],
                         [("native", "record_stream_cuvmm", "skip"), ("native", "sleep_wake", "skip"),
                          ("native", "ipc_cuvmm_to_pytorch", "skip"), ("native", "release_stranded", "skip"),
                          ("native", "split_under_limit", "skip"), ("cuvmm", "ipc_pytorch_to_cuvmm", "skip")])

    def test_isolate_gives_every_case_a_process(self):
        units, skipped = torch_suite.plan(["expandable"], ["record_stream", "oom", "record_stream_cuvmm"], isolate=True)
        self.assertEqual(units, [("expandable", ["record_stream"]), ("expandable", ["oom"])])
        self.assertEqual(len(skipped), 1)

    def test_every_case_is_run_or_skipped_exactly_once(self):
        units, skipped = torch_suite.plan(list(torch_cases.ALLOCATORS), BRIEF_CASES)
        seen = [(a, c) for a, names in units for c in names] + [(r["allocator"], r["case"]) for r in skipped]
        self.assertEqual(sorted(seen), sorted((a, c) for a in torch_cases.ALLOCATORS for c in BRIEF_CASES))


class ClassificationTest(unittest.TestCase):
    def test_statuses(self):
        classify = torch_suite.classify_exception

        class OutOfMemoryError(RuntimeError):
            pass

        class AcceleratorError(RuntimeError):
            pass

        self.assertEqual(classify(torch_cases.CaseFailure("3/20 wrong")), ("fail", "3/20 wrong"))
        self.assertEqual(classify(torch_cases.SkipCase("no transformers"))[0], "skip")
        self.assertEqual(classify(RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats. "
                                               "If you need it, please file an issue"))[0], "error")
        self.assertEqual(classify(NotImplementedError("x"))[0], "error")
        self.assertEqual(classify(RuntimeError("CUDA error: operation not supported"))[0], "error")
        self.assertEqual(classify(AcceleratorError("CUDA error: an illegal memory access was encountered"))[0], "fail")
        self.assertEqual(classify(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))[0], "fail")
        self.assertEqual(classify(RuntimeError("The tensor has a non-zero number of elements, but its data is "
                                               "not allocated yet."))[0], "fail")
        self.assertEqual(classify(RuntimeError("CUDA error: operation not permitted when stream is capturing"))[0],
                         "fail")
        status, detail = classify(KeyError("allocated_bytes.all.current"))
        self.assertEqual(status, "error")
        self.assertTrue(detail.startswith("KeyError: "))


class FormattingTest(unittest.TestCase):
    def results(self):
        make = torch_suite.make_result
        return [make("native", "record_stream", "pass", "0/20 wrong", {"wrong": 0}, 1.234),
                make("cuvmm", "record_stream", "fail", "7/20 side-stream reads saw the overwrite", {"wrong": 7}, 1.5),
                make("cuvmm", "memory_stats", "error", "RuntimeError: does not yet support getDeviceStats", {}, 0.5),
                make("native", "record_stream_cuvmm", "skip", "applies to cuvmm only")]

    def test_a_result_is_one_json_line_with_its_fields(self):
        result = torch_suite.make_result("cuvmm", "oom", "fail", "a\nb   c" + "x" * 1000, {"n": 1}, 2.345, torch="2.11")
        self.assertEqual(json.loads(json.dumps(result)), result)
        self.assertEqual(result["suite"], torch_suite.SCHEMA)
        self.assertEqual(result["seconds"], 2.35)
        self.assertNotIn("\n", result["detail"])
        self.assertLessEqual(len(result["detail"]), torch_suite.DETAIL_CHARS)
        self.assertEqual(result["torch"], "2.11")
        with self.assertRaises(ValueError):
            torch_suite.make_result("cuvmm", "oom", "crashed")

    def test_the_table_has_a_cell_per_allocator_and_case_and_notes_what_did_not_pass(self):
        table = torch_suite.format_table(self.results(), ["native", "expandable", "cuvmm"],
                                         ["record_stream", "record_stream_cuvmm", "memory_stats"])
        lines = table.splitlines()
        self.assertEqual(lines[0], "| case | native | expandable | cuvmm |")
        self.assertEqual(lines[2], "| record_stream | pass (1 s) | - | FAIL (2 s) |")
        self.assertEqual(lines[3], "| record_stream_cuvmm | skip | - | - |")
        self.assertEqual(lines[4], "| memory_stats | - | - | ERROR (0 s) |")
        self.assertIn("- cuvmm / record_stream: fail: 7/20 side-stream reads saw the overwrite", lines)
        self.assertIn("- cuvmm / memory_stats: error: RuntimeError: does not yet support getDeviceStats", lines)
        self.assertFalse(any("native / record_stream:" in line for line in lines))
        self.assertFalse(any("applies to cuvmm only" in line for line in lines), "not-applicable skips are no news")

    def test_the_table_defaults_to_what_the_results_hold(self):
        table = torch_suite.format_table(self.results())
        self.assertTrue(table.startswith("| case | native | cuvmm |"))
        self.assertIn("| memory_stats |", table)

    def test_summary_counts_each_status(self):
        self.assertEqual(torch_suite.summary_line(self.results(), 12.4),
                         "torch-suite: 1 pass, 1 fail, 1 error, 1 skip (12 s)")

    def test_results_are_read_back_from_a_run_output(self):
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("noise\n")
            for result in self.results():
                f.write(json.dumps(result) + "\n")
            f.write('{"not": "ours"}\n| case | native |\n')
        try:
            self.assertEqual(torch_suite.read_results(f.name), self.results())
        finally:
            os.unlink(f.name)


FAKE_CHILD = textwrap.dedent("""
    import json, os, sys, time
    prefix = {prefix!r}
    allocator, names = sys.argv[1], sys.argv[2].split(",")
    behaviour = json.loads(os.environ["FAKE_BEHAVIOUR"])
    for name in names:
        print("library noise", flush=True)
        print(prefix + json.dumps({{"event": "start", "case": name}}), flush=True)
        what = behaviour.get(name, "pass")
        if what == "crash":
            sys.stderr.write("Fatal Python error: Segmentation fault\\n"); sys.stderr.flush()
            os.kill(os.getpid(), 11)
        if what == "hang":
            time.sleep(60)
        if what == "silent":
            sys.exit(1)
        print(prefix + json.dumps({{"event": "result", "result": {{"suite": {schema!r}, "allocator": allocator,
              "case": name, "status": what, "detail": "", "figures": {{"pid": os.getpid()}}, "seconds": 0}}}}),
              flush=True)
        if what == "fail":  # as a broken CUDA context: the process stops after its result
            sys.exit(3)
""")


class DriverTest(unittest.TestCase):
    """run_unit on fake children that follow the protocol, crash, hang or exit without a word."""

    def run_fake(self, names, behaviour, budget=30.0, scale=1.0):
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(FAKE_CHILD.format(prefix=torch_suite.PREFIX, schema=torch_suite.SCHEMA))
        os.environ["FAKE_BEHAVIOUR"] = json.dumps(behaviour)
        results, commands = [], []

        def command(allocator, pending):
            commands.append(list(pending))
            return [sys.executable, f.name, allocator, ",".join(pending)]

        try:
            torch_suite.run_unit("cuvmm", names, torch_suite.Budget(budget), results.append, command, scale)
        finally:
            os.unlink(f.name)
            del os.environ["FAKE_BEHAVIOUR"]
        return results, commands

    def test_cases_share_a_process_until_one_breaks_it(self):
        results, commands = self.run_fake(["record_stream", "graphs_back_to_back", "nccl"],
                                          {"graphs_back_to_back": "fail"})
        self.assertEqual([(r["case"], r["status"]) for r in results],
                         [("record_stream", "pass"), ("graphs_back_to_back", "fail"), ("nccl", "pass")])
        self.assertEqual(commands, [["record_stream", "graphs_back_to_back", "nccl"], ["nccl"]])
        self.assertEqual(results[0]["figures"]["pid"], results[1]["figures"]["pid"])
        self.assertNotEqual(results[1]["figures"]["pid"], results[2]["figures"]["pid"])

    def test_a_crash_fails_its_case_with_the_signal_and_stderr_and_the_rest_run_in_a_new_process(self):
        results, commands = self.run_fake(["record_stream", "graphs_back_to_back", "nccl"],
                                          {"record_stream": "crash"})
        self.assertEqual([(r["case"], r["status"]) for r in results],
                         [("record_stream", "fail"), ("graphs_back_to_back", "pass"), ("nccl", "pass")])
        self.assertIn("SIGSEGV", results[0]["detail"])
        self.assertIn("Segmentation fault", results[0]["detail"])
        self.assertEqual(commands[1], ["graphs_back_to_back", "nccl"])

    def test_a_hang_is_an_error_after_the_case_limit(self):
        names = ["record_stream", "nccl"]
        # record_stream's limit scaled down to about 1 s past the start-up allowance.
        scale = 1.0 / torch_cases.CASES["record_stream"].timeout
        startup = torch_suite.STARTUP_SECONDS
        torch_suite.STARTUP_SECONDS = 0
        try:
            results, _ = self.run_fake(names, {"record_stream": "hang"}, scale=scale)
        finally:
            torch_suite.STARTUP_SECONDS = startup
        self.assertEqual([(r["case"], r["status"]) for r in results], [("record_stream", "error"), ("nccl", "pass")])
        self.assertIn("timed out", results[0]["detail"])

    def test_a_process_that_exits_without_a_result_fails_its_case(self):
        results, _ = self.run_fake(["record_stream", "nccl"], {"nccl": "silent"})
        self.assertEqual([(r["case"], r["status"]) for r in results], [("record_stream", "pass"), ("nccl", "fail")])
        self.assertIn("exited with status 1", results[1]["detail"])

    def test_a_spent_budget_skips_what_is_left(self):
        results, commands = self.run_fake(["record_stream", "nccl"], {}, budget=1.0)
        self.assertEqual(commands, [])
        self.assertEqual([r["status"] for r in results], ["skip", "skip"])
        self.assertIn("budget", results[0]["detail"])


class SuiteTest(unittest.TestCase):
    def test_run_suite_prints_json_lines_a_table_and_a_summary_and_writes_the_file(self):
        def command(allocator, pending):
            code = ("import json, sys; p = sys.argv[1]\n"
                    "for n in sys.argv[3].split(','):\n"
                    "    print(p + json.dumps({'event': 'start', 'case': n}))\n"
                    "    print(p + json.dumps({'event': 'result', 'result': {'suite': sys.argv[4], 'allocator': "
                    "sys.argv[2], 'case': n, 'status': 'pass', 'detail': '', 'figures': {}, 'seconds': 0.1}}))\n")
            return [sys.executable, "-c", code, torch_suite.PREFIX, allocator, ",".join(pending), torch_suite.SCHEMA]

        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "out.jsonl")
            args = parse("--allocator", "native,cuvmm", "--case", "record_stream_cuvmm,oom", "--json", path)
            out = io.StringIO()
            status = torch_suite.run_suite(args, out, command)
            self.assertEqual(status, 0)
            written = torch_suite.read_results(path)
        text = out.getvalue()
        self.assertEqual(len(written), 4)
        self.assertEqual(sum(line.startswith('{"suite"') for line in text.splitlines()), 4)
        self.assertIn("| oom | pass (0 s) | pass (0 s) |", text)
        self.assertIn("| record_stream_cuvmm | skip | pass (0 s) |", text)
        self.assertTrue(text.rstrip().splitlines()[-1].startswith("torch-suite: 3 pass, 0 fail, 0 error, 1 skip"))


if __name__ == "__main__":
    unittest.main()
