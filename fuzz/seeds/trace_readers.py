#!/usr/bin/env python3
"""Writes the seed inputs of the pytorch_snapshot, rmm_csv and kineto_json fuzz targets into fuzz/corpus/.

The snapshots are pickled by Python's own pickle, as PyTorch's _dump_snapshot does (protocol 4, frames
shared through the memo), with made-up addresses and sizes: small, and no copy of a real trace. Seeds
named bad_* must be refused by the readers, the others read. Run from anywhere:
    python3 fuzz/seeds/trace_readers.py
"""
import gzip
import json
import os
import pickle

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "corpus")
MIB = 1 << 20
BASE = 0x7F00_4000_0000


def write(target, name, data):
    os.makedirs(os.path.join(CORPUS, target), exist_ok=True)
    with open(os.path.join(CORPUS, target, name), "wb") as f:
        f.write(data)


FRAMES = [
    {"filename": "train.py", "line": 42, "name": "forward"},
    {"filename": "torch/nn/modules/linear.py", "line": 125, "name": "linear"},
]


def entry(action, addr, size, stream=0, frames=FRAMES):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": frames}


def block(addr, size, requested, state):
    return {"address": addr, "size": size, "requested_size": requested, "state": state, "frames": FRAMES}


def segment(addr, size, blocks, device=0, kind="large", expandable=False, stream=0):
    return {
        "device": device,
        "address": addr,
        "total_size": size,
        "stream": stream,
        "segment_type": kind,
        "is_expandable": expandable,
        "blocks": blocks,
    }


def warm_start():
    """A weight live throughout, an activation freed but never allocated in the trace, a cached segment
    released by empty_cache (its frames name it), a new segment."""
    seg = BASE
    return {
        "segments": [
            segment(seg, 20 * MIB, [
                block(seg, 4 * MIB, 4 * MIB, "active_allocated"),
                block(seg + 4 * MIB, 10 * MIB, 10 * MIB, "active_allocated"),
                block(seg + 14 * MIB, 6 * MIB, 0, "inactive"),
            ]),
            segment(BASE + 128 * MIB, 30 * MIB, [block(BASE + 128 * MIB, 30 * MIB, 0, "inactive")]),
            segment(BASE + 256 * MIB, 2 * MIB, [block(BASE + 256 * MIB, 512, 100, "active_allocated")], kind="small"),
        ],
        "device_traces": [[
            entry("free_requested", seg + 4 * MIB, 8 * MIB),
            entry("free_completed", seg + 4 * MIB, 8 * MIB),
            entry("segment_free", BASE + 64 * MIB, 12 * MIB,
                  frames=[{"filename": "memory.py", "line": 1, "name": "emptyCache"}]),
            entry("alloc", seg + 4 * MIB, 10 * MIB),
            entry("segment_alloc", BASE + 128 * MIB, 30 * MIB),
            entry("alloc", BASE + 128 * MIB, 30 * MIB, stream=7),
            entry("free_requested", BASE + 128 * MIB, 30 * MIB, stream=7),
            entry("free_completed", BASE + 128 * MIB, 30 * MIB, stream=7),
            entry("alloc", BASE + 256 * MIB, 100),
        ]],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1},
    }


def two_devices():
    traces = []
    for d in range(2):
        addr = BASE + d * (1 << 32)
        traces.append([entry("alloc", addr, 3 * MIB + d), entry("free_completed", addr, 3 * MIB + d)])
    return {"segments": [], "device_traces": traces}


def expandable():
    addr = BASE
    return {
        "segments": [segment(addr, 4 * MIB, [block(addr, 4 * MIB, 3 * MIB, "active_allocated")], expandable=True)],
        "device_traces": [[
            entry("segment_map", addr, 4 * MIB),
            entry("alloc", addr, 3 * MIB),
            entry("alloc", addr + 4 * MIB, MIB + 1),
            entry("segment_unmap", addr + 4 * MIB, 2 * MIB),
        ]],
        "allocator_settings": {"expandable_segments": True},
    }


def oom_release():
    return {
        "segments": [segment(BASE, 20 * MIB, [block(BASE, 20 * MIB, 20 * MIB, "active_allocated")]),
                     segment(BASE + 128 * MIB, 50 * MIB, [block(BASE + 128 * MIB, 50 * MIB, 50 * MIB, "active_allocated")])],
        "device_traces": [[
            entry("oom", 0, 50 * MIB),
            entry("segment_free", BASE + 64 * MIB, 40 * MIB, frames=[]),
            entry("segment_alloc", BASE + 128 * MIB, 50 * MIB),
            entry("alloc", BASE + 128 * MIB, 50 * MIB),
        ]],
    }


def snapshots():
    warm = pickle.dumps(warm_start(), protocol=4)
    write("pytorch_snapshot", "seed_warm_start", warm)
    write("pytorch_snapshot", "seed_two_devices", pickle.dumps(two_devices(), protocol=4))
    write("pytorch_snapshot", "seed_expandable", pickle.dumps(expandable(), protocol=4))
    write("pytorch_snapshot", "seed_oom_release", pickle.dumps(oom_release(), protocol=4))
    write("pytorch_snapshot", "seed_protocol2", pickle.dumps(two_devices(), protocol=2))
    # The largest device number serde-pickle reads (2^63 - 1): a snapshot of that many devices.
    far = {
        "segments": [segment(BASE, 2 * MIB, [], device=2**63 - 1)],
        "device_traces": [[entry("alloc", BASE + 64 * MIB, 4096), entry("free_completed", BASE + 64 * MIB, 4096)]],
    }
    write("pytorch_snapshot", "seed_far_device", pickle.dumps(far, protocol=4))
    write("pytorch_snapshot", "bad_truncated", warm[: len(warm) // 2])
    bad = {
        "bad_missing_action": {"device_traces": [[{"addr": BASE, "size": 4096}]]},
        "bad_text_size": {"device_traces": [[entry("alloc", BASE, "4096")]]},
        "bad_negative_size": {"device_traces": [[entry("alloc", BASE, -4096)]]},
        "bad_huge_int": {"device_traces": [[entry("alloc", BASE, 2**70)]]},
        "bad_absurd_size": {"device_traces": [[entry("alloc", BASE, 2**60)]]},
        "bad_device_max": {"segments": [segment(BASE, 2 * MIB, [], device=2**64 - 1)]},
        "bad_not_a_dict": [1, 2, 3],
        # Segments and no trace entries: _dump_snapshot without _record_memory_history.
        "bad_no_history": {"segments": [segment(BASE, 2 * MIB, [])], "device_traces": [[]]},
        "bad_inconsistent": {"segments": [], "device_traces": [[entry("segment_alloc", BASE, 20 * MIB)]]},
    }
    for name, value in bad.items():
        write("pytorch_snapshot", name, pickle.dumps(value, protocol=4))
    recursive = []
    recursive.append(recursive)
    write("pytorch_snapshot", "bad_recursive", pickle.dumps({"device_traces": recursive}, protocol=4))
    # Hand-written opcodes Python's pickler never emits: DUP doubling a list, deep nesting.
    write("pytorch_snapshot", "bad_dup_doubling", b"\x80\x02]" + b"2a" * 40 + b".")
    write("pytorch_snapshot", "bad_deep", b"\x80\x02" + b"](" * 200 + b"e" * 200 + b".")


HEADER = "Thread,Time,Action,Pointer,Size,Stream"


def log(rows, newline="\n", bom=""):
    return (bom + newline.join([HEADER] + rows) + newline).encode()


def rmm_logs():
    t = "140212,10:21:03.123456"
    seeds = {
        # fmt builds: 0x-prefixed pointers and streams.
        "seed_fmt_style": log([f"{t},allocate,0x7f2a40000000,1048576,0x0",
                               f"{t},allocate,0x7f2a40100000,4096,0x5a5a",
                               f"{t},allocate failure,0x0,85899345920,0x0",
                               f"{t},free,0x7f2a40000000,1048576,0x0",
                               f"{t},free,0x7f2a40100000,4096,0x5a5a"]),
        # printf builds: bare hexadecimal.
        "seed_printf_style": log([f"{t},allocate,7f2a40000000,1048576,0",
                                  f"{t},allocate,7f2a40100000,300,7f00aa00",
                                  f"{t},free,7f2a40000000,1048576,0"]),
        # Frees of memory allocated before logging began, and reuse of a pointer.
        "seed_seeded_frees": log([f"{t},free,0x7f2a40400000,2097152,0x0",
                                  f"{t},allocate,0x7f2a40400000,512,0x0",
                                  f"{t},free,0x7f2a40000000,65536,0x3",
                                  f"{t},free,0x7f2a40400000,512,0x0"]),
        "seed_crlf_bom": log([f"{t},allocate,0x1000,8,0x0", f"{t},free,0x1000,8,0x0"], "\r\n", "\ufeff"),
        "seed_zero_and_null": log([f"{t},allocate,0x0,0,0x0", f"{t},free,0x0,0,0x0",
                                   f"{t},free,0x0,4096,0x0", f"{t},allocate,0x2000,1,0x0"]),
        "bad_header": b"Thread,Time,Action,Pointer,Size\n1,t,allocate,0x10,8\n",
        "bad_columns": log([f"{t},allocate,0x1000,8"]),
        "bad_action": log([f"{t},malloc,0x1000,8,0x0"]),
        "bad_pointer": log([f"{t},allocate,0xfoo,8,0x0"]),
        "bad_negative_size": log([f"{t},allocate,0x1000,-8,0x0"]),
        "bad_absurd_size": log([f"{t},allocate,0x1000,1125899906842625,0x0"]),
        "bad_null_allocate": log([f"{t},allocate,0x0,8,0x0"]),
        "bad_allocate_live": log([f"{t},allocate,0x1000,8,0x0", f"{t},allocate,0x1000,8,0x0"]),
        "bad_double_free": log([f"{t},allocate,0x1000,8,0x0", f"{t},free,0x1000,8,0x0",
                                f"{t},free,0x1000,8,0x0"]),
    }
    for name, data in seeds.items():
        write("rmm_csv", name, data)


def memory(ts, nbytes, addr=None, total=None, device=0, device_type=1):
    args = {"Device Type": device_type, "Device Id": device, "Bytes": nbytes}
    if addr is not None:
        args["Addr"] = addr
    if total is not None:
        args["Total Allocated"] = total
        args["Total Reserved"] = 2 * MIB
    return {"ph": "i", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": ts, "args": args}


def profiler(events):
    kernel = {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 5,
              "args": {"device": 0, "stream": 7, "Device Id": "gpu0"}}
    return json.dumps({"schemaVersion": 1, "traceEvents": [kernel] + events}).encode()


def profiler_traces():
    a, b = BASE, BASE + MIB
    seeds = {
        # Today's profiler: addresses and the device's allocated bytes (4 MiB allocated before, never freed,
        # and one 512-byte block freed); a free not recorded before its address is taken again.
        "seed_today": profiler([memory(10, 512, a, 4 * MIB + 1024), memory(11, 512, b, 4 * MIB + 1536),
                                memory(12, -512, a, 4 * MIB + 1024), memory(13, -512, BASE - MIB, 4 * MIB + 512),
                                memory(14, 512, b, 4 * MIB + 512), memory(15, -512, b, 4 * MIB)]),
        # An early profiler: no addresses, frees paired by size; CPU events ignored.
        "seed_early": profiler([memory(1, 4096), memory(2, 4096), memory(3, -4096), memory(4, -8192),
                                memory(5, 64, device_type=0, device=-1)]),
        "seed_two_devices": profiler([memory(1, 512, a, 512), memory(2, 1024, b, 1024, device=1),
                                      memory(3, -512, a, 0)]),
        "seed_gzipped": gzip.compress(profiler([memory(1, 512, a, 512), memory(2, -512, a, 0)]), mtime=0),
        "bad_bytes_text": profiler([memory(1, "512", a, 512)]),
        "bad_bytes_zero": profiler([memory(1, 0, a, 0)]),
        "bad_absurd_size": profiler([memory(1, 1 << 50, a, 1 << 50)]),
        "bad_no_memory_events": profiler([memory(1, 64, device_type=0)]),
        "bad_not_a_trace": b'{"traceEvents": {"name": "[memory]"}}',
    }
    for name, data in seeds.items():
        write("kineto_json", name, data)


snapshots()
rmm_logs()
profiler_traces()
