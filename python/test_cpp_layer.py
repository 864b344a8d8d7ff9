"""Tests of the C++ layer (``cuvmm-torch/csrc``) without a GPU: built against the PyTorch installed in the
interpreter that runs them, installed as PyTorch's CUDA allocator over the simulated device, and driven
through PyTorch's own entry points that need no CUDA driver (statistics, snapshot, resets, memory fraction,
empty_cache). The allocations themselves go through the C functions, since PyTorch's malloc path asks the
driver for the current device first.

Needs a CUDA build of PyTorch (``pip install torch ninja``; no CUDA toolkit: the layer builds against the
headers PyTorch's wheel brings) and ``cargo build --release -p cuvmm-torch``. Elsewhere the build tests skip,
saying why, and only :class:`CudaRuntime` runs. From the repository root, with that interpreter::

    python -m unittest discover -s python -p test_cpp_layer.py -v

The layer is built once into ``target/cpp-layer/torch-<version>`` and rebuilt when its sources change
(about a minute).
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import cuvmm_torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 3 << 20

# Runs in a fresh interpreter (PyTorch takes one allocator per process). Prints one JSON object.
PROBE = r"""
import json, torch, cuvmm_torch
C, lib, size, out = torch._C, cuvmm_torch.load(), int(SIZE), {}

def stats():
    s = C._cuda_memoryStats(0)
    keys = ("allocated_bytes", "reserved_bytes", "allocation", "segment")
    return {**{key: s[key]["all"] for key in keys}, "num_ooms": s["num_ooms"]}

out["layer"] = cuvmm_torch.install(cpp=True)
out["backend"] = torch.cuda.memory.get_allocator_backend()
ptr = lib.cuvmm_malloc(size, 0, None)
out["ptr"] = ptr
out["live"] = stats()
out["own_live"] = cuvmm_torch.memory_stats(0)
out["segments"] = C._cuda_memorySnapshot(None)["segments"]
lib.cuvmm_free(ptr, size, 0, None)
out["freed"] = stats()
C._cuda_resetPeakMemoryStats(0)
out["after_reset_peak"] = stats()
C._cuda_resetAccumulatedMemoryStats(0)
out["after_reset_accumulated"] = stats()
C._cuda_setMemoryFraction(0.25, 0)
out["fraction"] = lib.cuvmm_memory_fraction(0)
C._cuda_emptyCache()
out["emptied"] = stats()
try:
    cuvmm_torch.build_extension(torch).install(cuvmm_torch.library_path())
    out["second_install"] = "installed"
except RuntimeError as error:
    out["second_install"] = str(error)

# A CUDA graph's private pool, as torch.cuda.graph and cudagraph trees drive it.
pool = (0, 7)
C._cuda_beginAllocateCurrentThreadToPool(0, pool)
in_pool = lib.cuvmm_malloc(size, 0, None)
C._cuda_endAllocateToPool(0, pool)
outside = lib.cuvmm_malloc(size, 0, None)
out["pool_of"] = {str(ptr): [s["segment_pool_id"] for s in C._cuda_memorySnapshot(None)["segments"]
                             if any(b["address"] == ptr for b in s["blocks"])] for ptr in (in_pool, outside)}
out["pool_ptrs"] = [in_pool, outside]
out["live_in_pool"] = [C._cuda_checkPoolLiveAllocations(0, pool, {in_pool}),
                       C._cuda_checkPoolLiveAllocations(0, pool, {outside}),
                       C._cuda_checkPoolLiveAllocations(0, pool, set())]
state = C._cuda_getCheckpointState(0, pool)
C._cuda_setCheckpointPoolState(0, state, [], [])  # the same live allocations: allowed
lib.cuvmm_free(in_pool, size, 0, None)
try:
    C._cuda_setCheckpointPoolState(0, state, [], [])
    out["rewind"] = "rewound"
except RuntimeError as error:
    out["rewind"] = str(error)
C._cuda_releasePool(0, pool)
lib.cuvmm_free(outside, size, 0, None)
C._cuda_emptyCache()
out["after_pool"] = stats()
print(json.dumps(out))
""".replace("SIZE", str(SIZE))

# Stand-ins for the few CUDA calls PyTorch's allocator interface makes around an allocator (the current device,
# the device count, stream priorities, capture state, a synchronization, the primary context's state), so that
# PyTorch's own malloc, free, OOM and IPC paths reach the C++ layer without a GPU. Anything else still goes to
# the real runtime and fails, which the probe shows.
FAKE_CUDART = r"""
static int current;
int cudaGetDevice(int *device) { *device = current; return 0; }
int cudaSetDevice(int device) { current = device; return 0; }
int cudaGetDeviceCount(int *count) { *count = 1; return 0; }
int cudaDeviceSynchronize(void) { return 0; }
int cudaGetLastError(void) { return 0; }
int cudaDeviceGetStreamPriorityRange(int *least, int *greatest) { *least = 0; *greatest = -5; return 0; }
int cudaStreamIsCapturing(void *stream, int *status) { (void)stream; *status = 0; return 0; }
int cudaThreadExchangeStreamCaptureMode(int *mode) { (void)mode; return 0; }
int cudaDriverGetVersion(int *version) { *version = 13000; return 0; }
"""
FAKE_LIBCUDA = r"""
int cuDevicePrimaryCtxGetState(int device, unsigned *flags, int *active) {
    (void)device; *flags = 0; *active = 1; return 0;
}
int cuInit(unsigned flags) { (void)flags; return 100; }
"""
# Calls PyTorch's allocator interface (c10::cuda::CUDACachingAllocator) as PyTorch does.
HARNESS = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <map>
namespace CCA = c10::cuda::CUDACachingAllocator;
static std::map<uint64_t, std::shared_ptr<void>> opened;
static std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> observed_;
void observe() {
  CCA::attachOutOfMemoryObserver([](int64_t device, size_t alloc, size_t total, size_t free) {
    observed_.emplace_back(device, alloc, total, free);
  });
}
std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> observed() { return observed_; }
uint64_t alloc(size_t n) { return reinterpret_cast<uint64_t>(CCA::raw_alloc(n)); }
void release(uint64_t p) { CCA::raw_delete(reinterpret_cast<void*>(p)); }
std::string try_alloc(size_t n) {
  try {
    release(alloc(n));
    return "allocated";
  } catch (const c10::OutOfMemoryError& e) {
    return std::string("OutOfMemoryError: ") + e.what_without_backtrace();
  } catch (const c10::Error& e) {
    return std::string("Error: ") + e.what_without_backtrace();
  }
}
py::tuple share(uint64_t p) {
  auto h = CCA::shareIpcHandle(reinterpret_cast<void*>(p));
  return py::make_tuple(py::bytes(h.handle), static_cast<int64_t>(h.offset));
}
uint64_t open_handle(py::bytes handle) {
  auto mapping = CCA::getIpcDevPtr(std::string(handle));
  uint64_t p = reinterpret_cast<uint64_t>(mapping.get());
  opened[p] = mapping;
  return p;
}
std::string try_open(py::bytes handle) {
  try {
    open_handle(handle);
    return "opened";
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}
void close_handle(uint64_t p) { opened.erase(p); }
"""

SHIM_PROBE = r"""
import json, torch, cuvmm_torch
from torch.utils import cpp_extension
C, size = torch._C, int(SIZE)
out = {"layer": cuvmm_torch.install(cpp=True)}
h = cpp_extension.load_inline(
    "cuvmm_test_harness", cpp_sources=[HARNESS], build_directory=BUILD,
    functions=["observe", "observed", "alloc", "release", "try_alloc", "share", "open_handle", "try_open",
               "close_handle"],
    extra_include_paths=cuvmm_torch.cuda_runtime()[0], extra_ldflags=["-lc10_cuda"])
h.observe()
ptr = h.alloc(size)
out["allocated"] = C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"]
handle, out["offset"] = h.share(ptr)
out["magic"] = handle[:8].decode("latin-1")
opened = h.open_handle(handle)
out["opened"] = [ptr, opened, h.open_handle(handle)]
h.close_handle(opened)
out["reopen"] = h.try_open(handle)
h.release(ptr)
out["released"] = C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"]
out["huge"] = h.try_alloc(100 << 30)
C._cuda_setMemoryFraction(0.5, 0)
out["over_limit"] = h.try_alloc(3 << 30)
out["observed"] = h.observed()
out["num_ooms"] = cuvmm_torch.memory_stats(0)["num_ooms"]
print(json.dumps(out))
"""

FALLBACK_PROBE = r"""
import json, warnings, torch, cuvmm_torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    layer = cuvmm_torch.install()
print(json.dumps({"layer": layer, "warnings": [str(w.message) for w in caught],
                  "backend": torch.cuda.memory.get_allocator_backend()}))
"""


def missing_for_install():
    """Why cuvmm cannot be installed into PyTorch here, or None."""
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed in this interpreter"
    import torch  # noqa: PLC0415

    if not torch.version.cuda:
        return f"PyTorch {torch.__version__} is a build without CUDA"
    try:
        cuvmm_torch.library_path()
    except FileNotFoundError as error:
        return str(error)
    return None


def missing_for_build():
    """Why the C++ layer cannot be built here, or None."""
    if missing_for_install():
        return missing_for_install()
    from torch.utils import cpp_extension  # noqa: PLC0415

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def run_probe(code, **env):
    """Runs `code` on the simulated device in a fresh interpreter; returns its JSON output."""
    import torch  # noqa: PLC0415

    environment = {k: v for k, v in os.environ.items() if not k.startswith("CUVMM_")}
    environment.update(
        CUVMM_BACKEND="sim",
        CUVMM_SIM_DEVICES="1",
        CUVMM_SIM_CAPACITY="4GiB",
        CUVMM_TORCH_LIB=cuvmm_torch.library_path(),
        CUVMM_TORCH_BUILD=os.path.join(ROOT, "target", "cpp-layer", f"torch-{torch.__version__}"),
        PYTHONPATH=os.path.join(ROOT, "python"),
        **env,
    )
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                          timeout=900, check=False)
    if done.returncode != 0:
        raise AssertionError(f"the probe failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@unittest.skipIf(missing_for_build(), missing_for_build())
class CppLayer(unittest.TestCase):
    """PyTorch's statistics, snapshot and settings calls reach cuvmm through the C++ layer."""

    @classmethod
    def setUpClass(cls):
        cls.out = run_probe(PROBE)

    def test_it_is_pytorchs_allocator(self):
        self.assertEqual((self.out["layer"], self.out["backend"]), ("cpp", "cuvmm"))

    def test_a_second_install_is_refused(self):
        self.assertIn("already installed", self.out["second_install"])

    def test_memory_stats_are_cuvmms(self):
        live, own = self.out["live"], self.out["own_live"]
        self.assertEqual(live["allocated_bytes"]["current"], SIZE)
        self.assertEqual(live["allocation"]["current"], 1)
        self.assertGreater(live["reserved_bytes"]["current"], 0)
        for key in ("allocated_bytes", "reserved_bytes", "allocation", "segment"):
            for field in ("current", "peak", "allocated", "freed"):
                self.assertEqual(live[key][field], own[f"{key}.all.{field}"], (key, field))
        self.assertEqual(live["num_ooms"], own["num_ooms"])

    def test_the_snapshot_shows_the_block(self):
        ptr = self.out["ptr"]
        blocks = [(segment, block) for segment in self.out["segments"] for block in segment["blocks"]
                  if block["address"] == ptr]
        self.assertEqual(len(blocks), 1, self.out["segments"])
        segment, block = blocks[0]
        self.assertEqual((block["state"], block["size"], block["requested_size"]),
                         ("active_allocated", SIZE, SIZE))
        self.assertEqual(segment["total_size"], sum(b["size"] for b in segment["blocks"]))
        self.assertEqual(segment["allocated_size"], SIZE)
        self.assertTrue(segment["address"] <= ptr < segment["address"] + segment["total_size"])
        self.assertEqual(segment["device"], 0)

    def test_a_free_and_the_resets_reach_cuvmm(self):
        freed = self.out["freed"]["allocated_bytes"]
        self.assertEqual((freed["current"], freed["peak"], freed["freed"]), (0, SIZE, SIZE))
        self.assertEqual(self.out["after_reset_peak"]["allocated_bytes"]["peak"], 0)
        accumulated = self.out["after_reset_accumulated"]["allocated_bytes"]
        self.assertEqual((accumulated["allocated"], accumulated["freed"]), (0, 0))

    def test_a_graph_pool_keeps_its_allocations_and_checks_them(self):
        in_pool, outside = self.out["pool_ptrs"]
        self.assertEqual(self.out["pool_of"], {str(in_pool): [[0, 7]], str(outside): [[0, 0]]})
        self.assertEqual(self.out["live_in_pool"], [True, False, False])
        self.assertIn("cudagraph_trees = False", self.out["rewind"])
        self.assertEqual(self.out["after_pool"]["reserved_bytes"]["current"], 0, "released and emptied")

    def test_memory_fraction_and_empty_cache_reach_cuvmm(self):
        self.assertEqual(self.out["fraction"], 0.25)
        self.assertGreater(self.out["freed"]["reserved_bytes"]["current"], 0)
        self.assertEqual(self.out["emptied"]["reserved_bytes"]["current"], 0)


@unittest.skipIf(missing_for_build(), missing_for_build())
class ThroughPyTorchsInterface(unittest.TestCase):
    """PyTorch's raw_alloc / raw_delete, out-of-memory and IPC calls reach cuvmm through the C++ layer, with
    stand-ins for the CUDA calls PyTorch makes around them (FAKE_CUDART, FAKE_LIBCUDA)."""

    @classmethod
    def setUpClass(cls):
        import torch  # noqa: PLC0415

        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise unittest.SkipTest("no C compiler for the CUDA stand-ins")
        cls.scratch = tempfile.TemporaryDirectory()
        fakes = cls.scratch.name
        for source, target, flags in [(FAKE_CUDART, "libfakecudart.so", []),
                                      (FAKE_LIBCUDA, "libcuda.so.1", ["-Wl,-soname,libcuda.so.1"])]:
            with open(os.path.join(fakes, target + ".c"), "w") as file:
                file.write(source)
            subprocess.run([compiler, "-shared", "-fPIC", *flags, "-o", os.path.join(fakes, target),
                            os.path.join(fakes, target + ".c")], check=True)
        build = os.path.join(ROOT, "target", "cpp-layer", f"harness-{torch.__version__}")
        os.makedirs(build, exist_ok=True)
        code = SHIM_PROBE.replace("SIZE", str(SIZE)).replace("HARNESS", repr(HARNESS))
        code = code.replace("BUILD", repr(build))
        cls.out = run_probe(code, LD_PRELOAD=os.path.join(fakes, "libfakecudart.so"), LD_LIBRARY_PATH=fakes)

    @classmethod
    def tearDownClass(cls):
        cls.scratch.cleanup()

    def test_raw_alloc_and_raw_delete_are_cuvmms(self):
        self.assertEqual(self.out["layer"], "cpp")
        self.assertEqual((self.out["allocated"], self.out["released"]), (SIZE, 0))

    def test_a_request_larger_than_the_device_is_torch_out_of_memory(self):
        self.assertTrue(self.out["huge"].startswith("OutOfMemoryError: cuvmm:"), self.out["huge"])
        self.assertIn("can never fit", self.out["huge"])

    def test_a_request_over_the_memory_fraction_is_torch_out_of_memory_with_the_diagnosis(self):
        self.assertTrue(self.out["over_limit"].startswith("OutOfMemoryError: cuvmm:"), self.out["over_limit"])
        self.assertIn("out of memory", self.out["over_limit"].lower())

    def test_out_of_memory_observers_are_called_with_the_numbers(self):
        gib = 1 << 30
        huge, over_limit = self.out["observed"]
        self.assertEqual(huge[:3], [0, 100 * gib, 4 * gib])
        self.assertEqual(over_limit[:3], [0, 3 * gib, 2 * gib], "the limit, as PyTorch passes it")
        self.assertGreaterEqual(self.out["num_ooms"], 1)

    def test_a_shared_allocation_opens_once_at_an_address_of_its_own(self):
        ptr, opened, again = self.out["opened"]
        self.assertEqual(self.out["magic"], "CUVMMIPC")
        self.assertEqual(self.out["offset"], 0)
        self.assertNotEqual(opened, ptr, "mapped again, elsewhere")
        self.assertEqual(again, opened, "one mapping per handle while it is in use")
        self.assertIn("no such export", self.out["reopen"])


@unittest.skipIf(missing_for_install(), missing_for_install())
class Fallback(unittest.TestCase):
    def test_cuvmm_torch_cpp_0_takes_the_ctypes_path_and_says_what_it_lacks(self):
        out = run_probe(FALLBACK_PROBE, CUVMM_TORCH_CPP="0")
        self.assertEqual(out["layer"], "ctypes")
        self.assertNotEqual(out["backend"], "cuvmm")
        self.assertTrue(any("CUVMM_TORCH_CPP=0" in w and "record_stream" in w for w in out["warnings"]), out)


class CudaRuntime(unittest.TestCase):
    """Which CUDA runtime the layer builds against (no PyTorch needed)."""

    def setUp(self):
        scratch = tempfile.TemporaryDirectory()
        self.addCleanup(scratch.cleanup)
        self.root = scratch.name
        self.maps = os.path.join(self.root, "maps")

    def install(self, prefix, library_dir="lib", headers=True, crt=True):
        """A runtime at `prefix`: its library, and (as asked) its API header and crt/host_config.h."""
        os.makedirs(os.path.join(prefix, library_dir), exist_ok=True)
        os.makedirs(os.path.join(prefix, "include", "crt"), exist_ok=True)
        library = os.path.join(prefix, library_dir, "libcudart.so.13")
        open(library, "w").close()
        if headers:
            open(os.path.join(prefix, "include", "cuda_runtime_api.h"), "w").close()
        if crt:
            open(os.path.join(prefix, "include", "crt", "host_config.h"), "w").close()
        return library

    def write_maps(self, *libraries):
        with open(self.maps, "w") as maps:
            maps.write("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
            for library in libraries:
                maps.write(f"7f10-7f20 r-xp 00000000 08:01 2 {library}\n")

    def test_pytorchs_own_runtime_and_the_headers_beside_it_come_first(self):
        wheel = self.install(os.path.join(self.root, "nvidia", "cu13"))
        toolkit = os.path.join(self.root, "cuda")
        self.install(toolkit, "lib64")
        self.write_maps(wheel)
        include, flags = cuvmm_torch.cuda_runtime(self.maps, cuda_home=toolkit)
        self.assertEqual(include, [os.path.join(self.root, "nvidia", "cu13", "include")])
        self.assertEqual(flags, [wheel])

    def test_pytorchs_headers_without_crt_take_it_from_the_toolkit_or_a_package_beside(self):
        # As on a GPU machine's PyTorch 2.11 (cu130): nvidia/cu13/include has cuda_runtime.h, not crt/.
        wheel = self.install(os.path.join(self.root, "nvidia", "cu13"), crt=False)
        toolkit = os.path.join(self.root, "cuda")
        self.install(toolkit, "lib64")
        self.write_maps(wheel)
        own = os.path.join(self.root, "nvidia", "cu13", "include")
        include, flags = cuvmm_torch.cuda_runtime(self.maps, cuda_home=toolkit)
        self.assertEqual(include, [own, os.path.join(toolkit, "include")])
        self.assertEqual(flags, [wheel], "still PyTorch's own runtime")
        self.install(os.path.join(self.root, "nvidia", "cuda_nvcc"), headers=False)
        include, flags = cuvmm_torch.cuda_runtime(self.maps, cuda_home=None)
        self.assertEqual(include, [own, os.path.join(self.root, "nvidia", "cuda_nvcc", "include")])
        self.assertEqual(flags, [wheel])

    def test_headers_without_crt_anywhere_are_a_clear_error(self):
        wheel = self.install(os.path.join(self.root, "nvidia", "cu13"), crt=False)
        self.write_maps(wheel)
        with self.assertRaisesRegex(RuntimeError, "has no crt/host_config.h.*CUDA_HOME"):
            cuvmm_torch.cuda_runtime(self.maps, cuda_home=None)

    def test_a_toolkit_when_pytorchs_runtime_has_no_headers_beside_it(self):
        self.write_maps(self.install(os.path.join(self.root, "bare"), headers=False))
        toolkit = os.path.join(self.root, "cuda")
        self.install(toolkit, "lib64")
        include, flags = cuvmm_torch.cuda_runtime(self.maps, cuda_home=toolkit)
        self.assertEqual(include, [os.path.join(toolkit, "include")])
        self.assertEqual(flags, [f"-L{os.path.join(toolkit, 'lib64')}", "-lcudart"])

    def test_neither_is_a_clear_error(self):
        bare = self.install(os.path.join(self.root, "bare"), headers=False)
        self.write_maps(bare)
        for home in [None, os.path.join(self.root, "nowhere")]:
            with self.assertRaisesRegex(RuntimeError, "CUDA_HOME") as caught:
                cuvmm_torch.cuda_runtime(self.maps, cuda_home=home)
            self.assertIn(bare, str(caught.exception))
        with self.assertRaisesRegex(RuntimeError, "none loaded"):
            cuvmm_torch.cuda_runtime(os.path.join(self.root, "no-maps"), cuda_home=None)


if __name__ == "__main__":
    unittest.main()
