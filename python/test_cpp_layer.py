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
print(json.dumps(out))
""".replace("SIZE", str(SIZE))

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
        self.assertEqual((block["state"], block["size"], block["requested_size"]), ("active_allocated", SIZE, SIZE))
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

    def test_memory_fraction_and_empty_cache_reach_cuvmm(self):
        self.assertEqual(self.out["fraction"], 0.25)
        self.assertGreater(self.out["freed"]["reserved_bytes"]["current"], 0)
        self.assertEqual(self.out["emptied"]["reserved_bytes"]["current"], 0)


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

    def install(self, prefix, library_dir="lib", headers=True):
        os.makedirs(os.path.join(prefix, library_dir), exist_ok=True)
        os.makedirs(os.path.join(prefix, "include"), exist_ok=True)
        library = os.path.join(prefix, library_dir, "libcudart.so.13")
        open(library, "w").close()
        if headers:
            open(os.path.join(prefix, "include", "cuda_runtime_api.h"), "w").close()
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
        self.assertEqual(include, os.path.join(self.root, "nvidia", "cu13", "include"))
        self.assertEqual(flags, [wheel])

    def test_a_toolkit_when_pytorchs_runtime_has_no_headers_beside_it(self):
        self.write_maps(self.install(os.path.join(self.root, "bare"), headers=False))
        toolkit = os.path.join(self.root, "cuda")
        self.install(toolkit, "lib64")
        include, flags = cuvmm_torch.cuda_runtime(self.maps, cuda_home=toolkit)
        self.assertEqual(include, os.path.join(toolkit, "include"))
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
