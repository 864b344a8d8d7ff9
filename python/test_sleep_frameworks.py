"""Tests of the frameworks' sleep APIs over cuvmm's tags (``cuvmm_torch.memory_saver``, torch_memory_saver's;
``cuvmm_torch.cumem``, vLLM's ``CuMemAllocator``), through ctypes on the simulated backend: no GPU, no
PyTorch. Each runs in a fresh interpreter (the library reads its settings once per process), allocating with
``cuvmm_malloc`` where a framework would make tensors, and prints what it saw as JSON.

Run from the repository root, after ``cargo build --release -p cuvmm-torch``::

    python3 -m unittest discover -s python -p test_sleep_frameworks.py -v

The same calls on a GPU, with tensors, CUDA graphs and the bytes checked: ``tools/gpu/sleep_frameworks.py``
(``tools/gpu/run.sh sleep-frameworks``).
"""

import json
import os
import subprocess
import sys
import unittest

import cuvmm_torch

MIB = 1 << 20

PRELUDE = r"""
import json, cuvmm_torch
lib = cuvmm_torch.load()
out = {}
def malloc(size):
    ptr = lib.cuvmm_malloc(size, 0, None)
    assert ptr, cuvmm_torch.last_error()
    return (ptr, size)
def free(block):
    lib.cuvmm_free(block[0], block[1], 0, None)
    assert cuvmm_torch.last_error() is None, cuvmm_torch.last_error()
def tags():
    return {t["name"]: [t["state"], t["bytes_kept"]] for t in cuvmm_torch.tags(0)}
def stat(key):
    return cuvmm_torch.memory_stats(0)[key]
def refused(calls):
    # Each call's exception type by name, or None where it returned.
    seen = {}
    for name, call in calls:
        try:
            call()
            seen[name] = None
        except Exception as error:
            seen[name] = type(error).__name__
    return seen
"""

MEMORY_SAVER = PRELUDE + r"""
import os
from cuvmm_torch.memory_saver import torch_memory_saver as tms, configure_subprocess
tms.hook_mode = "preload"
out["enabled"] = tms.enabled
with tms.region(tag="kv_cache"):
    kv = malloc(32 << 20)
with tms.region(tag="weights", enable_cpu_backup=True):
    weights = malloc(16 << 20)
    with tms.disable():
        plain = malloc(4 << 20)
with tms.region(tag="weights"):
    scratch = malloc(8 << 20)
with tms.region():
    default = malloc(2 << 20)
out["prepared"] = [tms.prepare_pause("weights"), tms.prepare_pause("weights"), tms.prepare_pause("kv_cache"),
                   stat("cuvmm.host_kept_bytes"), tags()["tms-backup:weights"]]
reserved = stat("reserved_bytes.all.current")
tms.pause("weights")
out["host_kept_paused"] = stat("cuvmm.host_kept_bytes")
out["pause_weights"] = tags()
out["given_back"] = reserved - stat("reserved_bytes.all.current")
tms.pause()
out["pause_all"] = tags()
out["asleep_bytes"] = stat("cuvmm.asleep_bytes")
import ctypes, types
class FakeTensor:
    # What get_cpu_backup uses of a torch.Tensor: a device address, or host bytes of its own.
    def __init__(self, nbytes, ptr=None):
        self.nbytes, self.shape, self.is_cuda = nbytes, (nbytes,), ptr is not None
        self.device = types.SimpleNamespace(index=0 if self.is_cuda else None)
        self.host = None if self.is_cuda else (ctypes.c_char * nbytes)(*([0x5A] * nbytes))
        self.ptr = ptr if self.is_cuda else ctypes.addressof(self.host)
    def is_contiguous(self):
        return True
    def data_ptr(self):
        return self.ptr
    def new_empty(self, shape, device):
        assert device == "cpu" and shape == self.shape
        return FakeTensor(self.nbytes)
def backup(block, offset=0, nbytes=64):
    got = tms.get_cpu_backup(FakeTensor(nbytes, block[0] + offset))
    return None if got is None else [got.is_cuda, len(got.host), got.host.raw.hex()]
# The simulated device's memory is zeros: the bytes read are the kept zeros, written over the 0x5A.
out["backup"] = [backup(weights), backup(weights, (16 << 20) - 64), backup(plain)]
out["backup_refused"] = refused([
    ("kv_cache", lambda: backup(kv)),
    ("past_the_end", lambda: backup(weights, (16 << 20) - 8)),
    ("not_a_tensor", lambda: tms.get_cpu_backup(None)),
])
out["read_kept"] = [cuvmm_torch.read_kept(weights[0] + 100, 8).hex(), cuvmm_torch.read_kept(plain[0], 8),
                    cuvmm_torch.read_kept(weights[0], 0).hex()]
with tms.region(tag="kv_cache"):
    out["alloc_while_paused"] = lib.cuvmm_malloc(4096, 0, None)
    out["alloc_error"] = cuvmm_torch.last_error()
tms.resume("kv_cache")
out["resume_kv"] = tags()
tms.resume()
out["resume_all"] = tags()
out["backup_after_resume"] = backup(weights)
out["host_kept"] = stat("cuvmm.host_kept_bytes")
out["retain_default"] = tms.retain_cpu_backup
tms.retain_cpu_backup = False
out["host_kept_after_setting"] = stat("cuvmm.host_kept_bytes")
tms.pause("weights"); tms.resume("weights")
out["host_kept_not_retained"] = stat("cuvmm.host_kept_bytes")
# Every instance drives the same tags and policy, as torch_memory_saver's process-wide library does.
import cuvmm_torch.memory_saver as torch_memory_saver
other = torch_memory_saver.TorchMemorySaver()
other.pause("kv_cache")
out["other_instance_pause"] = tags()["tms:kv_cache"]
out["other_instance_retain"] = other.retain_cpu_backup
other.resume()
out["module_names"] = [torch_memory_saver.torch_memory_saver is tms,
                       torch_memory_saver.configure_subprocess is configure_subprocess]
tms._ensure_initialized()
out["impl"] = tms._impl
env = os.environ
out["retain_env"] = {}
for value in (None, "1", "0", "false", "NO"):
    env.pop("TMS_RETAIN_CPU_BACKUP", None)
    if value is not None:
        env["TMS_RETAIN_CPU_BACKUP"] = value
    out["retain_env"][repr(value)] = torch_memory_saver._retain_default()
out["refusals"] = refused([
    ("disk", lambda: tms.region(enable_disk_backup=True).__enter__()),
    ("backend_without_backup", lambda: tms.region(cpu_backup_backend="pinned").__enter__()),
    ("disk_dir", lambda: tms.set_disk_backup_dir("/tmp")),
    ("hook_mode", lambda: setattr(tms, "hook_mode", "ld")),
])
with configure_subprocess():
    pass
for block in (kv, weights, plain, scratch, default):
    free(block)
out["allocated_after"] = stat("allocated_bytes.all.current")
# 900 MiB of the 1 GiB device kept free: 200 MiB more cannot be had; with the margin back at 0 it can.
tms.memory_margin_bytes = 900 << 20
out["past_margin"] = [lib.cuvmm_malloc(200 << 20, 0, None), "device margin" in (cuvmm_torch.last_error() or "")]
tms.memory_margin_bytes = 0
free(malloc(200 << 20))
out["margin_refusals"] = refused([("get", lambda: tms.memory_margin_bytes),
                                  ("negative", lambda: setattr(tms, "memory_margin_bytes", -1))])
print(json.dumps(out))
"""

CUMEM = PRELUDE + r"""
from cuvmm_torch.cumem import CuMemAllocator, cumem_available
allocator = CuMemAllocator.get_instance()
out["singleton"] = allocator is CuMemAllocator.get_instance()
with allocator.use_memory_pool(tag="weights"):
    out["current_tag"] = allocator.current_tag
    weights = malloc(16 << 20)
with allocator.use_memory_pool(tag="kv_cache"):
    kv = malloc(32 << 20)
with allocator.use_memory_pool():
    default = malloc(2 << 20)
out["usage"] = allocator.get_current_usage()
out["prepared"] = [allocator.prepare_sleep(offload_tags=("weights",)), allocator.prepare_sleep("weights"),
                   stat("cuvmm.host_kept_bytes")]
reserved = stat("reserved_bytes.all.current")
allocator.sleep(offload_tags=("weights",))
out["host_kept_asleep"] = stat("cuvmm.host_kept_bytes")
out["asleep"] = tags()
out["given_back"] = reserved - stat("reserved_bytes.all.current")
allocator.wake_up(tags=["weights"])
out["weights_up"] = tags()
allocator.wake_up()
out["all_up"] = tags()
allocator.sleep()
out["default_offloaded"] = tags()
allocator.wake_up(["kv_cache", "default", "weights"])
out["usage_after"] = allocator.get_current_usage()
# discard: without the bytes; a tag already asleep stays as it sleeps.
allocator.sleep(offload_tags=("weights",))
allocator.wake_up(tags=["kv_cache"])
allocator.discard(("kv_cache", "weights"))
out["discarded"] = tags()
allocator.wake_up()
# The graph pool: PyTorch's graph_pool_handle (a stand-in here: no PyTorch, no GPU), the same at each use,
# its memory under the tag "cudagraph", which a wake_up naming other tags wakes too.
import sys, types
handles = []
torch = types.ModuleType("torch")
torch.cuda = types.SimpleNamespace(is_available=lambda: False,
                                   graph_pool_handle=lambda: handles.append(len(handles)) or (0, len(handles)))
sys.modules["torch"] = torch
with allocator.cudagraph_pool() as first:
    out["graph_tag"] = allocator.current_tag
    graph = malloc(4 << 20)
with allocator.cudagraph_pool() as second:
    pass
out["graph_pools"] = [first, second, len(handles)]
allocator.sleep(offload_tags=("weights",))
out["graph_asleep"] = tags()["vllm:cudagraph"]
allocator.wake_up(tags=["weights"])
out["graph_woken_with_weights"] = tags()
allocator.wake_up()
allocator.release_pools()
allocator.close()
for block in (weights, kv, default, graph):
    free(block)
print(json.dumps(out))
"""

# Three devices; the current one is 0 (no PyTorch here), and a program allocates on device 2 inside regions,
# as one does with `device="cuda:2"` and no set_device.
OTHER_DEVICE = PRELUDE + r"""
import os
from cuvmm_torch import autoinstall
from cuvmm_torch.memory_saver import torch_memory_saver as tms, configure_subprocess
from cuvmm_torch.cumem import CuMemAllocator
def on(device, size):
    ptr = lib.cuvmm_malloc(size, device, None)
    assert ptr, cuvmm_torch.last_error()
    return ptr
def states(device):
    return {t["name"]: t["state"] for t in cuvmm_torch.tags(device)}
with tms.region(tag="kv"):
    on(2, 8 << 20)
with tms.region(tag="weights", enable_cpu_backup=True):
    on(0, 4 << 20)
    on(2, 4 << 20)
tms.pause("kv")
out["tms_pause_kv"] = [states(0), states(1), states(2)]
tms.pause("")
out["tms_pause_all"] = states(2)
tms.resume()
out["tms_resume_all"] = [states(0), states(2)]
allocator = CuMemAllocator.get_instance()
with allocator.use_memory_pool(tag="cache"):
    on(2, 2 << 20)
out["usage"] = allocator.get_current_usage()
allocator.sleep(offload_tags=())
out["vllm_sleep"] = states(2)["vllm:cache"]
allocator.wake_up()
out["vllm_wake"] = states(2)["vllm:cache"]
out["env_before"] = os.environ.get(autoinstall.VARIABLE)
with configure_subprocess():
    out["env_inside"] = os.environ.get(autoinstall.VARIABLE)
out["env_after"] = os.environ.get(autoinstall.VARIABLE)
out["devices"] = {repr(d): cuvmm_torch._device_index(d) for d in (None, "cuda", "cuda:2", 1)}
out["refusals"] = refused([
    ("region_bytes", lambda: cuvmm_torch.region(b"kv").__enter__()),
    ("sleep_none", lambda: cuvmm_torch.sleep(None)),
    ("tag_with_nul", lambda: cuvmm_torch.sleep("kv\0cache")),
    ("tms_region_none", lambda: tms.region(tag=None).__enter__()),
    ("device_cpu", lambda: cuvmm_torch.memory_stats("cpu")),
    ("device_float", lambda: cuvmm_torch.memory_stats(1.5)),
    ("history_negative", lambda: cuvmm_torch.record_history(-5)),
])
print(json.dumps(out))
"""


def run(code, devices=1):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUVMM_")}
    env.update(CUVMM_BACKEND="sim", CUVMM_SIM_DEVICES=str(devices), CUVMM_SIM_CAPACITY="1GiB",
               CUVMM_TORCH_LIB=cuvmm_torch.library_path(),
               PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"status {done.returncode}\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class MemorySaver(unittest.TestCase):
    def test_torch_memory_saver_calls_sleep_and_wake_cuvmm_tags(self):
        out = run(MEMORY_SAVER)
        self.assertTrue(out["enabled"])
        # A tag with and without its CPU backup are two of cuvmm's tags; pause(tag) sleeps both.
        # cuvmm's prepare_pause pins the backed-up tag's memory ahead, once; the pause copies into it.
        self.assertEqual(out["prepared"], [16 * MIB, 0, 0, 16 * MIB, ["awake", False]])
        self.assertEqual(out["host_kept_paused"], 16 * MIB)
        self.assertEqual(out["pause_weights"]["tms-backup:weights"], ["asleep", True])
        self.assertEqual(out["pause_weights"]["tms:weights"], ["asleep", False])
        self.assertEqual(out["pause_weights"]["tms:kv_cache"], ["awake", False])
        self.assertGreaterEqual(out["given_back"], 24 * MIB)  # whole 20 MiB chunks
        self.assertTrue(all(state == "asleep" for state, _ in out["pause_all"].values()))
        self.assertEqual(out["asleep_bytes"], (32 + 16 + 8 + 2) * MIB)
        self.assertIsNone(out["alloc_while_paused"])
        self.assertIn("asleep", out["alloc_error"])
        self.assertEqual(out["resume_kv"]["tms:kv_cache"], ["awake", False])
        self.assertEqual(out["resume_kv"]["tms:default"], ["asleep", False])
        self.assertTrue(all(state == "awake" for state, _ in out["resume_all"].values()))
        # get_cpu_backup reads a paused tag's kept bytes into a new CPU tensor; None where nothing sleeps.
        self.assertEqual(out["backup"], [[False, 64, "00" * 64], [False, 64, "00" * 64], None])
        self.assertEqual(out["backup_refused"], {"kv_cache": "CuvmmError", "past_the_end": "CuvmmError",
                                                 "not_a_tensor": "ValueError"})
        self.assertEqual(out["read_kept"], ["00" * 8, None, ""])
        self.assertIsNone(out["backup_after_resume"])
        # Only the backed-up tag copied bytes: its page-locked memory stays for the next pause.
        self.assertEqual(out["host_kept"], 16 * MIB)
        self.assertTrue(out["retain_default"])
        # Setting it False frees at the next resume, not at once, as torch_memory_saver's.
        self.assertEqual(out["host_kept_after_setting"], 16 * MIB)
        self.assertEqual(out["host_kept_not_retained"], 0)
        self.assertEqual(out["other_instance_pause"], ["asleep", False])
        self.assertFalse(out["other_instance_retain"])
        self.assertEqual(out["module_names"], [True, True])
        self.assertIsNone(out["impl"])
        self.assertEqual(out["retain_env"], {"None": True, "'1'": True, "'0'": False, "'false'": False,
                                             "'NO'": False})
        self.assertEqual(out["refusals"], {
            "disk": "NotImplementedError", "backend_without_backup": "ValueError",
            "disk_dir": "NotImplementedError",
            "hook_mode": "ValueError"})
        self.assertEqual(out["allocated_after"], 0)
        self.assertEqual(out["past_margin"], [None, True])
        self.assertEqual(out["margin_refusals"], {"get": "NotImplementedError", "negative": "ValueError"})


class CuMem(unittest.TestCase):
    def test_vllm_cumem_allocator_calls_sleep_and_wake_cuvmm_tags(self):
        out = run(CUMEM)
        self.assertTrue(out["singleton"])
        self.assertEqual(out["current_tag"], "weights")
        self.assertEqual(out["usage"], 50 * MIB)
        # cuvmm's prepare_sleep pins the offloaded tag's memory ahead, once; the sleep copies into it.
        self.assertEqual(out["prepared"], [16 * MIB, 0, 16 * MIB])
        self.assertEqual(out["host_kept_asleep"], 16 * MIB)
        # Every tag sleeps; only the offloaded one keeps its bytes.
        self.assertEqual(out["asleep"], {"vllm:weights": ["asleep", True], "vllm:kv_cache": ["asleep", False],
                                         "vllm:default": ["asleep", False]})
        self.assertGreaterEqual(out["given_back"], 50 * MIB)  # whole 20 MiB chunks
        # Naming weights wakes every tag but the other deferrable one, kv_cache, as vLLM's.
        self.assertEqual(out["weights_up"], {"vllm:weights": ["awake", False], "vllm:kv_cache": ["asleep", False],
                                             "vllm:default": ["awake", False]})
        self.assertTrue(all(state == "awake" for state, _ in out["all_up"].values()))
        self.assertEqual(out["default_offloaded"]["vllm:default"], ["asleep", True])
        self.assertEqual(out["default_offloaded"]["vllm:weights"], ["asleep", False])
        self.assertEqual(out["usage_after"], 50 * MIB)
        self.assertEqual(out["discarded"]["vllm:kv_cache"], ["asleep", False])
        self.assertEqual(out["discarded"]["vllm:weights"], ["asleep", True])
        self.assertEqual(out["discarded"]["vllm:default"], ["awake", False])  # woken with kv_cache, not discarded
        self.assertEqual(out["graph_tag"], "cudagraph")
        self.assertEqual(out["graph_pools"], [[0, 1], [0, 1], 1])
        self.assertEqual(out["graph_asleep"], ["asleep", False])
        self.assertEqual(out["graph_woken_with_weights"]["vllm:cudagraph"], ["awake", False])
        self.assertEqual(out["graph_woken_with_weights"]["vllm:kv_cache"], ["asleep", False])


class EveryDevice(unittest.TestCase):
    def test_the_frameworks_calls_reach_every_device_the_tag_has_memory_on(self):
        out = run(OTHER_DEVICE, devices=3)
        # pause(tag) sleeps the tag on device 2, where the region allocated though device 0 was current; a
        # device never allocated on lists no tags, and asking did not open it.
        self.assertEqual(out["tms_pause_kv"], [{"tms-backup:weights": "awake"}, {},
                                               {"tms:kv": "asleep", "tms-backup:weights": "awake"}])
        self.assertEqual(out["tms_pause_all"], {"tms:kv": "asleep", "tms-backup:weights": "asleep"})
        self.assertEqual(out["tms_resume_all"], [{"tms-backup:weights": "awake"},
                                                 {"tms:kv": "awake", "tms-backup:weights": "awake"}])
        self.assertEqual(out["usage"], 2 * MIB)
        self.assertEqual([out["vllm_sleep"], out["vllm_wake"]], ["asleep", "awake"])
        # Processes started inside configure_subprocess install cuvmm when they import torch.
        self.assertEqual([out["env_before"], out["env_inside"], out["env_after"]], [None, "1", None])
        self.assertEqual(out["devices"], {"None": 0, "'cuda'": 0, "'cuda:2'": 2, "1": 1})
        self.assertEqual(out["refusals"], {
            "region_bytes": "TypeError", "sleep_none": "TypeError", "tag_with_nul": "ValueError",
            "tms_region_none": "TypeError",
            "device_cpu": "ValueError", "device_float": "TypeError", "history_negative": "ValueError"})


if __name__ == "__main__":
    unittest.main()
