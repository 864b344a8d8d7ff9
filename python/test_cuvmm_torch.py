"""Tests of libcuvmm_torch.so through ctypes, on the simulated backend: no GPU, no PyTorch, stdlib only.

Run from the repository root, after ``cargo build --release -p cuvmm-torch`` and ``cargo build --release``
(the ``cuvmm`` binary writes the workloads and reports what ``compare`` measures)::

    python3 -m unittest discover -s python -v

``CUVMM_TORCH_LIB`` and ``CUVMM_BIN`` name other builds of the library and of the binary.

``CUVMM_TORCH_TEST_INSTALLED=1`` tests an installed copy instead (a wheel, pip-installed): ``cuvmm_torch`` is
imported from site-packages, never from this checkout's ``python/``, its library and header are the
package's, and ``cuvmm`` is the one installed beside the interpreter (``CUVMM_BIN`` still names another).
``tools/wheel_check.sh`` runs them so.
"""

import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import sysconfig
import types
import unittest
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INSTALLED = os.environ.get("CUVMM_TORCH_TEST_INSTALLED") == "1"
if INSTALLED:  # this folder holds the checkout's cuvmm_torch, and is on the path: take it off (run this file
    # as a script then: unittest's discovery imports python/cuvmm_torch itself, as a package beside the tests)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != os.path.realpath(HERE)]
import cuvmm_torch  # noqa: E402

if INSTALLED and os.path.realpath(cuvmm_torch.__file__).startswith(os.path.realpath(ROOT) + os.sep):
    raise ImportError(f"CUVMM_TORCH_TEST_INSTALLED=1, but cuvmm_torch came from the checkout: {cuvmm_torch.__file__}")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import torch_replay  # noqa: E402 (tools/ is not a package: on the path first)
# The package's copy (beside csrc/ in an installed package, cuvmm-torch/ in the checkout).
HEADER = os.path.join(os.path.dirname(cuvmm_torch.csrc_dir()), "cuvmm_torch.h")
DEVICES = 9

# Set before the library's first call, which reads them; the capacity is `cuvmm compare`'s default.
os.environ["CUVMM_BACKEND"] = "sim"
os.environ["CUVMM_SIM_DEVICES"] = str(DEVICES)
os.environ["CUVMM_SIM_CAPACITY"] = "80GiB"
os.environ.pop("CUVMM_ALLOC_CONF", None)

lib = cuvmm_torch.load()

# Devices by test, so that one test's statistics are not moved by another's allocations.
THREADS_DEVICE, BAD_INPUT_DEVICE, REPORTS_DEVICE, SETTINGS_DEVICE, SLEEP_DEVICE = 0, 1, 2, 6, 8
REPLAY_DEVICES = {"stream-producer-consumer": 3, "transformer-train": 4, "llm-serving": 5}


def stream(n):
    """A stream argument: on the simulated backend any pointer-sized number names a stream."""
    return ctypes.c_void_p(n) if n else None


def cuvmm_binary():
    """``$CUVMM_BIN``, else the installed ``cuvmm`` (CUVMM_TORCH_TEST_INSTALLED=1) or the checkout's build."""
    built = os.path.join(sysconfig.get_path("scripts"), "cuvmm") if INSTALLED else os.path.join(ROOT, "target", "release", "cuvmm")
    for candidate in [os.environ.get("CUVMM_BIN"), built]:
        if candidate and os.path.exists(candidate):
            return candidate
    raise AssertionError(f"no cuvmm binary at {built}: run `cargo build --release` first, or set CUVMM_BIN")


def run_python(code, **env):
    """Runs `code` in a fresh interpreter (a fresh library: its settings are read once per process)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CUVMM_") and k != "PYTHONPATH"}
    if not INSTALLED:
        environment["PYTHONPATH"] = HERE
    environment["CUVMM_TORCH_LIB"] = cuvmm_torch.library_path()
    environment.update(env)
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout.strip(), done.stderr


class Symbols(unittest.TestCase):
    def test_every_function_of_the_header_is_exported(self):
        with open(HEADER) as header:
            declared = set(re.findall(r"\b(cuvmm_\w+)\(", header.read()))
        self.assertEqual(
            declared,
            {
                "cuvmm_malloc",
                "cuvmm_free",
                "cuvmm_record_stream",
                "cuvmm_memory_stats_json",
                "cuvmm_memory_summary",
                "cuvmm_string_free",
                "cuvmm_empty_cache",
                "cuvmm_release_stranded",
                "cuvmm_dump_snapshot",
                "cuvmm_begin_allocate_to_pool",
                "cuvmm_begin_allocate_to_pool_capture",
                "cuvmm_end_allocate_to_pool",
                "cuvmm_mark_captures",
                "cuvmm_mark_capture",
                "cuvmm_incref_pool",
                "cuvmm_release_pool",
                "cuvmm_incref_pool",
                "cuvmm_add_peer",
                "cuvmm_free_any",
                "cuvmm_get_device_stats",
                "cuvmm_reset_peak_stats",
                "cuvmm_reset_accumulated_stats",
                "cuvmm_private_pool_stats",
                "cuvmm_recovered_oom",
                "cuvmm_set_memory_fraction",
                "cuvmm_memory_fraction",
                "cuvmm_record_history",
                "cuvmm_attach_trace_tracker",
                "cuvmm_last_oom",
                "cuvmm_snapshot_take",
                "cuvmm_snapshot_free",
                "cuvmm_last_error",
                "cuvmm_set_tag",
                "cuvmm_sleep",
                "cuvmm_wake",
                "cuvmm_prepare_sleep",
                "cuvmm_release_host_buffers",
                "cuvmm_read_kept",
                "cuvmm_set_device_margin",
                "cuvmm_tags_json",
                "cuvmm_device_count",
                "cuvmm_ipc_share",
                "cuvmm_bytes_free",
                "cuvmm_ipc_open",
                "cuvmm_ipc_close",
                "cuvmm_set_torch_version",
                "cuvmm_pool_use_count",
                "cuvmm_set_use_on_oom",
                "cuvmm_set_no_split",
                "cuvmm_pool_blocks",
                "cuvmm_pool_restore",
                "cuvmm_empty_pool_cache",
                "cuvmm_malloc_at",
                "cuvmm_foreign_malloc",
                "cuvmm_foreign_add_segment",
                "cuvmm_foreign_release",
                "cuvmm_foreign_segments_free",
                "cuvmm_foreign_segment_count",
            },
        )
        for name in declared:
            self.assertTrue(hasattr(lib, name), name)


class ThreadsAndStreams(unittest.TestCase):
    def test_allocations_and_frees_from_several_threads_and_streams(self):
        device = THREADS_DEVICE
        results, errors = {}, []

        def work(t):
            live = []
            try:
                for i in range(300):
                    size = 512 * (1 + (i * 13 + t * 7) % 6000)
                    ptr = lib.cuvmm_malloc(size, device, stream(t % 3))
                    if not ptr:
                        raise AssertionError(cuvmm_torch.last_error())
                    live.append((ptr, size, t % 3))
                    if i % 2:
                        ptr, size, s = live.pop(i % len(live))
                        lib.cuvmm_free(ptr, size, device, stream(s))
                        if cuvmm_torch.last_error():
                            raise AssertionError(cuvmm_torch.last_error())
            except AssertionError as e:
                errors.append(e)
            results[t] = live

        threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(errors, [])
        live = sorted(block for blocks in results.values() for block in blocks)
        for (a, size, _), (b, _, _) in zip(live, live[1:]):
            self.assertLessEqual(a + size, b, "live allocations overlap")
        for ptr, _, _ in live:
            self.assertEqual(ptr % 512, 0)
        stats = cuvmm_torch.memory_stats(device)
        self.assertEqual(stats["allocated_bytes.all.current"], sum(size for _, size, _ in live))
        self.assertEqual(stats["allocation.all.current"], len(live))
        self.assertGreaterEqual(stats["reserved_bytes.all.current"], stats["allocated_bytes.all.current"])
        for ptr, size, s in live:
            lib.cuvmm_free(ptr, size, device, stream(s))
            self.assertIsNone(cuvmm_torch.last_error())
        stats = cuvmm_torch.memory_stats(device)
        self.assertEqual(stats["allocated_bytes.all.current"], 0)
        self.assertEqual(stats["num_ooms"], 0)


class Statistics(unittest.TestCase):
    def test_the_json_has_pytorchs_keys_and_cuvmms_and_follows_the_allocations(self):
        device = REPORTS_DEVICE
        before = cuvmm_torch.memory_stats(device)
        for key in [
            "allocated_bytes.all.current",
            "allocated_bytes.all.peak",
            "allocated_bytes.large_pool.freed",
            "reserved_bytes.all.current",
            "reserved_bytes.all.peak",
            "active_bytes.all.current",
            "requested_bytes.small_pool.allocated",
            "inactive_split_bytes.all.current",
            "segment.all.current",
            "num_alloc_retries",
            "num_ooms",
            "num_device_alloc",
            "num_device_free",
            "cuvmm.largest_free_block",
            "cuvmm.idle_mapped_bytes",
            "cuvmm.handles_reused",
            "cuvmm.driver_calls",
        ]:
            self.assertIn(key, before)
        self.assertTrue(all(isinstance(v, int) for v in before.values()))
        small = lib.cuvmm_malloc(1000, device, None)
        large = lib.cuvmm_malloc(30 << 20, device, None)
        self.assertTrue(small and large, cuvmm_torch.last_error())
        stats = cuvmm_torch.memory_stats(device)
        self.assertEqual(stats["allocated_bytes.all.current"], before["allocated_bytes.all.current"] + 1024 + (30 << 20))
        self.assertEqual(stats["requested_bytes.all.current"], before["requested_bytes.all.current"] + 1000 + (30 << 20))
        self.assertEqual(stats["allocated_bytes.small_pool.current"], before["allocated_bytes.small_pool.current"] + 1024)
        self.assertGreater(stats["num_device_alloc"], before["num_device_alloc"])
        summary = cuvmm_torch.memory_summary(device)
        self.assertIn("Allocated memory", summary)
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "snapshot.pickle")
            cuvmm_torch.dump_snapshot(path, device)
            with open(path, "rb") as f:
                self.assertEqual(f.read(1), b"\x80")
        lib.cuvmm_free(small, 1000, device, None)
        lib.cuvmm_free(large, 30 << 20, device, None)
        cuvmm_torch.empty_cache(device)
        stats = cuvmm_torch.memory_stats(device)
        self.assertEqual(stats["reserved_bytes.all.current"], 0)
        self.assertEqual(stats["allocated_bytes.all.peak"], before["allocated_bytes.all.peak"] + 1024 + (30 << 20))


class SleepAndWake(unittest.TestCase):
    def test_a_region_tags_allocations_that_sleep_and_wake_at_the_same_address(self):
        device = SLEEP_DEVICE
        with cuvmm_torch.region("weights"):
            with cuvmm_torch.region("kv_cache"):
                kv = lib.cuvmm_malloc(40 << 20, device, None)
            weights = lib.cuvmm_malloc(20 << 20, device, None)
        other = lib.cuvmm_malloc(20 << 20, device, None)
        self.assertTrue(kv and weights and other, cuvmm_torch.last_error())
        reserved = cuvmm_torch.memory_stats(device)["reserved_bytes.all.current"]
        # The simulated devices hold no bytes here, so nothing is kept (tests/sleep_wake.rs checks bytes).
        self.assertEqual(cuvmm_torch.sleep("kv_cache", keep=False, device=device), 40 << 20)
        self.assertEqual(cuvmm_torch.sleep("kv_cache", keep=False, device=device), 0)
        stats = cuvmm_torch.memory_stats(device)
        self.assertEqual(stats["reserved_bytes.all.current"], reserved - (40 << 20))
        self.assertEqual(stats["cuvmm.asleep_bytes"], 40 << 20)
        self.assertIn("tag kv_cache", cuvmm_torch.memory_summary(device))
        with cuvmm_torch.region("kv_cache"):
            self.assertIsNone(lib.cuvmm_malloc(4096, device, None))
            self.assertIn("asleep", cuvmm_torch.last_error())
        # Freed while asleep (a tensor dropped then): freed at once, as PyTorch counts a free; its memory
        # stays active until the wake, which makes it free.
        before = cuvmm_torch.memory_stats(device)
        lib.cuvmm_free(kv, 40 << 20, device, None)
        self.assertIsNone(cuvmm_torch.last_error())
        after = cuvmm_torch.memory_stats(device)
        self.assertEqual(after["allocation.all.current"], before["allocation.all.current"] - 1)
        self.assertEqual(after["active.all.current"], before["active.all.current"])
        cuvmm_torch.wake("kv_cache", device=device)
        cuvmm_torch.wake("kv_cache", device=device)
        woken = cuvmm_torch.memory_stats(device)
        self.assertEqual(woken["cuvmm.asleep_bytes"], 0)
        self.assertEqual(woken["active.all.current"], before["active.all.current"] - 1)
        for ptr, size in [(weights, 20 << 20), (other, 20 << 20)]:
            lib.cuvmm_free(ptr, size, device, None)
            self.assertIsNone(cuvmm_torch.last_error())
        self.assertEqual(cuvmm_torch.memory_stats(device)["allocation.all.current"], 0)

    def test_the_frameworks_pause_every_tag_though_one_is_refused_then_raise_the_first_error(self):
        made = []

        def call(name, error=None):
            made.append(name)
            if error is not None:
                raise error

        first, second = cuvmm_torch.CuvmmError("capture underway"), ValueError("second")
        with self.assertRaises(cuvmm_torch.CuvmmError) as raised:
            cuvmm_torch._each(lambda n=n, e=e: call(n, e)
                              for n, e in [("a", None), ("b", first), ("c", None), ("d", second)])
        self.assertIs(raised.exception, first)
        self.assertEqual(made, ["a", "b", "c", "d"])
        cuvmm_torch._each(lambda: call("e") for _ in range(1))
        self.assertEqual(made[-1], "e")

    def test_no_device_named_is_device_0_where_torch_has_no_cuda(self):
        # The frameworks' APIs (memory_saver, cumem) name no device; with a PyTorch that sees no GPU (the
        # simulated backend on a CPU machine) torch.cuda.current_device() would raise.
        def no_driver():
            raise RuntimeError("Found no NVIDIA driver on your system")

        cuda = types.SimpleNamespace(is_available=lambda: False, current_device=no_driver)
        saved = sys.modules.get("torch")
        sys.modules["torch"] = types.SimpleNamespace(cuda=cuda)
        try:
            self.assertEqual(cuvmm_torch._device_index(None), 0)
            cuda.is_available, cuda.current_device = (lambda: True), (lambda: 3)
            self.assertEqual(cuvmm_torch._device_index(None), 3)
        finally:
            if saved is None:
                sys.modules.pop("torch", None)
            else:
                sys.modules["torch"] = saved


class BadInput(unittest.TestCase):
    """Each bad input: null / -1 / nothing, an error for cuvmm_last_error, and the allocator still works."""

    device = BAD_INPUT_DEVICE

    def assertFailed(self, expected):
        error = cuvmm_torch.last_error()
        self.assertIsNotNone(error, "no error recorded")
        self.assertIn(expected, error)

    def assertStillUsable(self):
        ptr = lib.cuvmm_malloc(4096, self.device, None)
        self.assertTrue(ptr, cuvmm_torch.last_error())
        lib.cuvmm_free(ptr, 4096, self.device, None)
        self.assertIsNone(cuvmm_torch.last_error())

    def test_sizes_zero_negative_and_absurd(self):
        for size in [0, -1, -(1 << 62)]:
            self.assertIsNone(lib.cuvmm_malloc(size, self.device, None))
            self.assertFailed("invalid size")
        for size in [1 << 62, 81 << 30]:
            self.assertIsNone(lib.cuvmm_malloc(size, self.device, None))
            self.assertIsNotNone(cuvmm_torch.last_error())
        self.assertStillUsable()

    def test_devices_out_of_range(self):
        for device in [-1, DEVICES, 1 << 30]:
            self.assertIsNone(lib.cuvmm_malloc(512, device, None))
            self.assertFailed("out of range")
            self.assertIsNone(lib.cuvmm_memory_stats_json(device))
            self.assertFailed("out of range")
            lib.cuvmm_empty_cache(device)
            self.assertFailed("out of range")
            with self.assertRaisesRegex(cuvmm_torch.CuvmmError, "out of range"):
                cuvmm_torch.memory_summary(device)
        self.assertStillUsable()

    def test_frees_of_foreign_pointers_and_double_frees(self):
        ptr = lib.cuvmm_malloc(1 << 20, self.device, None)
        self.assertTrue(ptr)
        for foreign in [0x1234_5000, ptr + 512, ctypes.addressof(ctypes.c_int(0))]:
            lib.cuvmm_free(foreign, 512, self.device, None)
            self.assertIsNotNone(cuvmm_torch.last_error(), hex(foreign))
        lib.cuvmm_free(ptr, 1 << 20, self.device, None)
        self.assertIsNone(cuvmm_torch.last_error())
        lib.cuvmm_free(ptr, 1 << 20, self.device, None)
        self.assertIsNotNone(cuvmm_torch.last_error(), "double free")
        lib.cuvmm_free(None, 0, self.device, None)
        self.assertIsNone(cuvmm_torch.last_error(), "free(NULL) is nothing")
        with self.assertRaises(cuvmm_torch.CuvmmError):
            cuvmm_torch.record_stream(ptr, 5, self.device)
        self.assertStillUsable()

    def test_null_and_unwritable_snapshot_paths(self):
        self.assertEqual(lib.cuvmm_dump_snapshot(self.device, None), -1)
        self.assertFailed("null path")
        with self.assertRaisesRegex(cuvmm_torch.CuvmmError, "no-such-dir"):
            cuvmm_torch.dump_snapshot("/no-such-dir/snapshot.pickle", self.device)
        self.assertStillUsable()


class Setup(unittest.TestCase):
    """Settings the library reads once per process, each tried in a fresh interpreter."""

    PROBE = (
        "import cuvmm_torch\n"
        "lib = cuvmm_torch.load()\n"
        "ptr = lib.cuvmm_malloc(1 << 20, 0, None)\n"
        "print('ok' if ptr else cuvmm_torch.last_error())\n"
    )

    def test_cuda_without_a_driver_is_a_clear_error(self):
        status, out, err = run_python(self.PROBE)
        self.assertEqual(status, 0, err)
        if out == "ok":
            self.skipTest("a CUDA device is present")
        self.assertIn("CUDA", out)

    def test_bad_settings_name_the_variable(self):
        for env, expected in [
            ({"CUVMM_BACKEND": "tpu"}, "CUVMM_BACKEND"),
            ({"CUVMM_BACKEND": "sim", "CUVMM_SIM_CAPACITY": "lots"}, "CUVMM_SIM_CAPACITY"),
            ({"CUVMM_BACKEND": "sim", "CUVMM_ALLOC_CONF": "no_such_key:1"}, "no_such_key"),
        ]:
            status, out, err = run_python(self.PROBE, **env)
            self.assertEqual(status, 0, err)
            self.assertIn(expected, out, env)

    def test_a_small_simulated_device_runs_out_of_memory_and_counts_it(self):
        code = (
            "import cuvmm_torch\n"
            "lib = cuvmm_torch.load()\n"
            "a = lib.cuvmm_malloc(48 << 20, 0, None)\n"
            "b = lib.cuvmm_malloc(48 << 20, 0, None)\n"
            "error = cuvmm_torch.last_error()\n"
            "lib.cuvmm_free(a, 48 << 20, 0, None)\n"
            "c = lib.cuvmm_malloc(48 << 20, 0, None)\n"
            "print(bool(a), bool(b), bool(c), cuvmm_torch.memory_stats(0)['num_ooms'], error)\n"
        )
        status, out, err = run_python(code, CUVMM_BACKEND="sim", CUVMM_SIM_CAPACITY="64MiB")
        self.assertEqual(status, 0, err)
        self.assertTrue(out.startswith("True False True 1 "), out)
        self.assertIn("out of memory", out.lower())

    def test_pages_stranded_in_chunks_are_named_and_given_back_by_release_stranded(self):
        # Two 20 MiB chunks each kept by a 2 MiB tensor at its end: 36 MiB idle that only a split frees.
        code = (
            "import cuvmm_torch\n"
            "lib = cuvmm_torch.load()\n"
            "MiB = 1 << 20\n"
            "big, kept = [], []\n"
            "for _ in range(2):\n"
            "    big.append(lib.cuvmm_malloc(18 * MiB, 0, None))\n"
            "    kept.append(lib.cuvmm_malloc(2 * MiB, 0, None))\n"
            "for p in big:\n"
            "    lib.cuvmm_free(p, 0, 0, None)\n"
            "refused = lib.cuvmm_malloc(40 * MiB, 0, None)\n"
            "error = cuvmm_torch.last_error()\n"
            "reserved = cuvmm_torch.memory_stats(0)['reserved_bytes.all.current']\n"
            "freed = cuvmm_torch.release_stranded(0)\n"
            "after = cuvmm_torch.memory_stats(0)['reserved_bytes.all.current']\n"
            "served = lib.cuvmm_malloc(40 * MiB, 0, None)\n"
            "print(bool(refused), freed // MiB, (reserved - after) // MiB, bool(served), cuvmm_torch.release_stranded(0))\n"
            "print(error)\n"
        )
        status, out, err = run_python(code, CUVMM_BACKEND="sim", CUVMM_SIM_CAPACITY="64MiB")
        self.assertEqual(status, 0, err)
        first, error = out.split("\n", 1)
        self.assertEqual(first, "False 36 36 True 0", out)
        self.assertIn("36.00 MiB of idle pages lie in multi-page handles", error)
        self.assertIn("release_stranded()", error)


class FakeTorch:
    """A stand-in for the ``torch`` module with what install() touches, recording the calls."""

    def __init__(self, build_error=None, toolkit=True):
        self.calls = []
        self.build_error = build_error
        self.toolkit = toolkit
        fake = self

        class Extension:
            @staticmethod
            def install(path):
                fake.calls.append(("extension.install", path))

        def load(**kwargs):
            fake.calls.append(("cpp_extension.load", kwargs))
            if fake.build_error:
                raise fake.build_error
            return Extension

        def pluggable(path, alloc, free):
            fake.calls.append(("CUDAPluggableAllocator", path, alloc, free))
            return "allocator"

        memory = types.SimpleNamespace(
            CUDAPluggableAllocator=pluggable,
            change_current_allocator=lambda a: fake.calls.append(("change_current_allocator", a)),
        )
        self.cpp_extension = types.SimpleNamespace(load=load, CUDA_HOME=None)
        self.module = types.SimpleNamespace(__version__="2.11.0+cu130", cuda=types.SimpleNamespace(memory=memory))

    def __enter__(self):
        # As if this process had loaded no libcudart: the build takes a CUDA toolkit's headers, a stand-in's.
        self.scratch = tempfile.TemporaryDirectory()
        self.saved_maps, cuvmm_torch.PROCESS_MAPS = cuvmm_torch.PROCESS_MAPS, os.path.join(self.scratch.name, "maps")
        if self.toolkit:
            self.cpp_extension.CUDA_HOME = self.scratch.name
            os.makedirs(os.path.join(self.scratch.name, "include", "crt"))
            os.makedirs(os.path.join(self.scratch.name, "lib64"))
            open(os.path.join(self.scratch.name, "include", "cuda_runtime_api.h"), "w").close()
            open(os.path.join(self.scratch.name, "include", "crt", "host_config.h"), "w").close()
        self.saved = {name: sys.modules.get(name) for name in ["torch", "torch.utils.cpp_extension"]}
        # Nothing installed yet, as in a fresh process (install() returns the layer in place otherwise).
        self.saved_layer, cuvmm_torch._layer = cuvmm_torch._layer, None
        sys.modules["torch"] = self.module
        sys.modules["torch.utils.cpp_extension"] = self.cpp_extension
        return self

    def __exit__(self, *exc):
        for name, module in self.saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        cuvmm_torch.PROCESS_MAPS = self.saved_maps
        cuvmm_torch._layer = self.saved_layer
        self.scratch.cleanup()


class Install(unittest.TestCase):
    """install()'s choice between the C++ layer and the ctypes path, with a stand-in for PyTorch."""

    def setUp(self):
        self.environ = {k: os.environ.pop(k) for k in [cuvmm_torch.CPP_ENV_VAR, cuvmm_torch.BUILD_ENV_VAR] if k in os.environ}
        self.scratch = tempfile.TemporaryDirectory()
        os.environ[cuvmm_torch.BUILD_ENV_VAR] = self.scratch.name

    def tearDown(self):
        os.environ.pop(cuvmm_torch.CPP_ENV_VAR, None)
        os.environ.pop(cuvmm_torch.BUILD_ENV_VAR, None)
        os.environ.update(self.environ)
        self.scratch.cleanup()

    def pluggable_calls(self):
        path = cuvmm_torch.library_path()
        return [("CUDAPluggableAllocator", path, "cuvmm_malloc", "cuvmm_free"), ("change_current_allocator", "allocator")]

    def test_the_cpp_layer_is_built_from_csrc_into_the_cache_and_installed_without_a_warning(self):
        with FakeTorch() as fake, warnings.catch_warnings():
            warnings.simplefilter("error")
            self.assertEqual(cuvmm_torch.install(), "cpp")
            self.assertEqual(cuvmm_torch.active_layer(), "cpp")
        (load, install) = fake.calls
        self.assertEqual(load[0], "cpp_extension.load")
        options = load[1]
        self.assertEqual(options["name"], cuvmm_torch.EXTENSION_NAME)
        self.assertEqual(options["build_directory"], self.scratch.name)
        self.assertFalse(options["with_cuda"], "no kernels: no nvcc, no GPU needed to build")
        for source in options["sources"]:
            self.assertTrue(os.path.exists(source), source)
        self.assertEqual(options["extra_include_paths"],
                         [os.path.dirname(cuvmm_torch.csrc_dir()), os.path.join(fake.cpp_extension.CUDA_HOME, "include")])
        self.assertTrue(os.path.exists(os.path.join(options["extra_include_paths"][0], "cuvmm_torch.h")))
        cudart = ["-L" + os.path.join(fake.cpp_extension.CUDA_HOME, "lib64"), "-lcudart"]
        self.assertEqual(options["extra_ldflags"], ["-ldl", "-lc10_cuda", "-ltorch_cuda", *cudart])
        self.assertEqual(install, ("extension.install", cuvmm_torch.library_path()))

    def test_a_failed_build_falls_back_to_ctypes_with_a_warning_naming_what_it_lacks(self):
        error = RuntimeError("Error building extension 'cuvmm_torch_ext'\nlots of log\nnvcc: not found")
        with FakeTorch(build_error=error) as fake, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertEqual(cuvmm_torch.install(), "ctypes")
        self.assertEqual(fake.calls[1:], self.pluggable_calls())
        (warning,) = caught
        self.assertIs(warning.category, RuntimeWarning)
        text = str(warning.message)
        self.assertIn("RuntimeError: nvcc: not found", text)
        for lacking in ["record_stream", "memory_stats", "CUDA graphs", "OutOfMemoryError", "empty_cache"]:
            self.assertIn(lacking, text)

    def test_without_cuda_runtime_headers_it_falls_back_naming_cuda_home(self):
        with FakeTorch(toolkit=False) as fake, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertEqual(cuvmm_torch.install(), "ctypes")
        self.assertEqual(fake.calls, self.pluggable_calls(), "no build attempted")
        self.assertIn("set CUDA_HOME", str(caught[0].message))

    def test_the_environment_turns_the_cpp_layer_off_or_makes_its_failure_an_error(self):
        os.environ[cuvmm_torch.CPP_ENV_VAR] = "0"
        with FakeTorch() as fake, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertEqual(cuvmm_torch.install(), "ctypes")
        self.assertEqual(fake.calls, self.pluggable_calls(), "no build attempted")
        self.assertIn("CUVMM_TORCH_CPP=0", str(caught[0].message))
        os.environ[cuvmm_torch.CPP_ENV_VAR] = "1"
        with FakeTorch(build_error=OSError("no compiler")) as fake:
            with self.assertRaisesRegex(OSError, "no compiler"):
                cuvmm_torch.install()
        self.assertEqual(len(fake.calls), 1, "no fallback")
        with FakeTorch(build_error=OSError("no compiler")), self.assertRaises(OSError):
            cuvmm_torch.install(cpp=True)

    def test_installed_already_it_returns_the_layer_in_place_and_changes_nothing(self):
        with FakeTorch() as fake:
            self.assertEqual(cuvmm_torch.install(), "cpp")
            self.assertEqual(cuvmm_torch.install(cpp=False), "cpp")
        self.assertEqual([call[0] for call in fake.calls], ["cpp_extension.load", "extension.install"])

    def test_ninja_from_its_package_is_put_on_path_where_path_has_none(self):
        with tempfile.TemporaryDirectory() as scratch:
            ninja = os.path.join(scratch, "ninja")
            with open(ninja, "w") as file:
                file.write("#!/bin/sh\n")
            os.chmod(ninja, 0o755)
            saved = sys.modules.get("ninja")
            sys.modules["ninja"] = types.SimpleNamespace(BIN_DIR=scratch)
            try:
                environ = {"PATH": os.path.join(scratch, "nothing-here")}
                self.assertEqual(cuvmm_torch.ninja_on_path(environ), ninja)
                self.assertEqual(environ["PATH"], os.pathsep.join([os.path.join(scratch, "nothing-here"), scratch]))
                self.assertEqual(cuvmm_torch.ninja_on_path(environ), ninja, "found on PATH now")
                self.assertEqual(environ["PATH"].count(scratch + os.pathsep), 0, "not added twice")
            finally:
                if saved is None:
                    sys.modules.pop("ninja", None)
                else:
                    sys.modules["ninja"] = saved

    def test_a_build_lock_left_long_ago_is_removed_and_a_fresh_one_kept(self):
        # torch.utils.cpp_extension waits with no end while its lock exists: one left by a killed build
        # would make every later install() hang.
        with tempfile.TemporaryDirectory() as directory:
            lock = os.path.join(directory, cuvmm_torch.BUILD_LOCK)
            self.assertFalse(cuvmm_torch._remove_stale_lock(directory))
            open(lock, "w").close()
            now = os.path.getmtime(lock)
            self.assertFalse(cuvmm_torch._remove_stale_lock(directory, now=now + 60), "maybe building now")
            self.assertTrue(os.path.exists(lock))
            with self.assertWarnsRegex(RuntimeWarning, "did not finish"):
                removed = cuvmm_torch._remove_stale_lock(directory, now=now + cuvmm_torch.STALE_LOCK_SECONDS)
            self.assertTrue(removed)
            self.assertFalse(os.path.exists(lock))

    def test_the_build_directory_is_per_torch_version_and_python_and_can_be_named(self):
        python = sys.implementation.cache_tag  # cpython-311: the layer is a module of one Python's ABI
        self.assertEqual(cuvmm_torch.build_dir("2.11.0", {cuvmm_torch.BUILD_ENV_VAR: "/b"}), "/b")
        self.assertEqual(
            cuvmm_torch.build_dir("2.11.0+cu130", {"XDG_CACHE_HOME": "/c"}),
            os.path.join("/c", "cuvmm_torch", f"torch-2.11.0_cu130-{python}"),
        )
        self.assertTrue(cuvmm_torch.build_dir("2.11.0", {}).endswith(
            os.path.join(".cache", "cuvmm_torch", f"torch-2.11.0-{python}")))
        self.assertTrue(os.path.isfile(os.path.join(cuvmm_torch.csrc_dir(), "cuvmm_allocator.cpp")))


@unittest.skipUnless(INSTALLED, "CUVMM_TORCH_TEST_INSTALLED=1 tests an installed copy (tools/wheel_check.sh)")
class Installed(unittest.TestCase):
    """What these tests ran against is the installed package's: its library, C++ sources, header and CLI."""

    def test_the_library_sources_header_and_cli_are_the_installed_packages(self):
        self.assertNotIn("CUVMM_TORCH_LIB", os.environ, "the package must find its own library")
        package = os.path.dirname(os.path.realpath(cuvmm_torch.__file__))
        self.assertEqual(os.path.dirname(os.path.realpath(cuvmm_torch.library_path())), package)
        self.assertEqual(os.path.realpath(cuvmm_torch.csrc_dir()), os.path.join(package, "csrc"))
        self.assertEqual(os.path.realpath(HEADER), os.path.join(package, "cuvmm_torch.h"))
        if "CUVMM_BIN" not in os.environ:
            self.assertEqual(os.path.dirname(cuvmm_binary()), sysconfig.get_path("scripts"))


class Settings(unittest.TestCase):
    """The functions behind PyTorch's settings and resets, through ctypes (what the C++ layer calls)."""

    device = SETTINGS_DEVICE

    def test_memory_fraction_resets_and_history(self):
        device = self.device
        self.assertEqual(lib.cuvmm_memory_fraction(device), 1.0)
        cuvmm_torch.set_memory_fraction(0.5, device)
        self.assertEqual(lib.cuvmm_memory_fraction(device), 0.5)
        with self.assertRaisesRegex(cuvmm_torch.CuvmmError, "per_process_memory_fraction"):
            cuvmm_torch.set_memory_fraction(2, device)
        ptr = lib.cuvmm_malloc(41 << 30, device, None)
        self.assertIsNone(ptr)
        self.assertIn("out of memory", cuvmm_torch.last_error().lower())
        cuvmm_torch.set_memory_fraction(1.0, device)
        cuvmm_torch.record_history(1000, device)
        ptr = lib.cuvmm_malloc(41 << 30, device, None)
        self.assertTrue(ptr, cuvmm_torch.last_error())
        lib.cuvmm_free(ptr, 41 << 30, device, None)
        self.assertIsNone(cuvmm_torch.last_error())
        lib.cuvmm_free_any(ptr)
        self.assertIn("double free", cuvmm_torch.last_error(), "free_any finds an address freed on a device")
        self.assertEqual(cuvmm_torch.memory_stats(device)["allocated_bytes.all.peak"], 41 << 30)
        cuvmm_torch.reset_peak_stats(device)
        self.assertEqual(cuvmm_torch.memory_stats(device)["allocated_bytes.all.peak"], 0)
        cuvmm_torch.reset_accumulated_stats(device)
        stats = cuvmm_torch.memory_stats(device)
        self.assertEqual((stats["allocated_bytes.all.allocated"], stats["num_ooms"]), (0, 0))
        cuvmm_torch.record_history(None, device)


class Replay(unittest.TestCase):
    """A built-in workload replayed event by event through the C functions reaches the same peak reserved as
    `cuvmm compare` reports for cuvmm: same library, same events, same configuration, same answer."""

    def replay(self, workload):
        binary = cuvmm_binary()
        with tempfile.TemporaryDirectory() as scratch:
            trace = os.path.join(scratch, "trace.txt")
            subprocess.run([binary, "workload", workload, "-o", trace], check=True, capture_output=True)
            _, events = torch_replay.read_trace(trace)
        compared = subprocess.run(
            [binary, "compare", "--workload", workload, "--format", "json", "--quiet"],
            check=True,
            capture_output=True,
            text=True,
        )
        (expected,) = [r for r in json.loads(compared.stdout)["results"] if r["allocator"] == "cuvmm"]
        device = REPLAY_DEVICES[workload]
        live = {}
        record_streams = 0
        for event in events:
            if event[0] == "alloc":
                _, ident, size, s = event
                ptr = lib.cuvmm_malloc(size, device, stream(s))
                self.assertTrue(ptr, f"{workload}: allocation {ident}: {cuvmm_torch.last_error()}")
                live[ident] = (ptr, size, s)
            elif event[0] == "free":
                ptr, size, s = live.pop(event[1])
                lib.cuvmm_free(ptr, size, device, stream(s))
                self.assertIsNone(cuvmm_torch.last_error())
            else:
                _, ident, s = event
                lib.cuvmm_record_stream(live[ident][0], device, stream(s))
                self.assertIsNone(cuvmm_torch.last_error())
                record_streams += 1
        stats = cuvmm_torch.memory_stats(device)
        print(
            f"\n{workload}: {len(events)} events ({record_streams} record_stream) through the C ABI: peak reserved "
            f"{stats['reserved_bytes.all.peak']}, cuvmm compare: {expected['peak_reserved_bytes']}",
            file=sys.stderr,
        )
        self.assertEqual(expected["ooms"], 0)
        self.assertEqual(stats["num_ooms"], 0)
        self.assertEqual(stats["reserved_bytes.all.peak"], expected["peak_reserved_bytes"])
        self.assertEqual(stats["allocated_bytes.all.peak"], expected["peak_allocated_bytes"])
        self.assertEqual(stats["num_sync_all_streams"], expected["synchronizations"])
        return record_streams

    def test_stream_producer_consumer_with_record_stream(self):
        self.assertGreater(self.replay("stream-producer-consumer"), 0)

    def test_transformer_train(self):
        self.replay("transformer-train")

    def test_llm_serving(self):
        self.replay("llm-serving")


if __name__ == "__main__":
    unittest.main()
