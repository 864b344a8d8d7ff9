#!/usr/bin/env python3
"""The frameworks' sleep APIs on a GPU (issue 44), as their users call them, over cuvmm's tags: each case a
script in the style of the framework's own examples, run in a fresh process with cuvmm installed as
PyTorch's allocator, checking results, addresses, bytes and free memory.

    python3 tools/gpu/sleep_frameworks.py [--case NAME,...]

Cases:
- ``memory_saver``: torch_memory_saver's API (``cuvmm_torch.memory_saver``): a KV cache in
  ``region(tag="kv_cache")``, a model's weights in ``region(tag="weights", enable_cpu_backup=True)``, a CUDA
  graph captured with ``torch_memory_saver.cuda_graph(g, tag="graph")`` whose temporaries are large;
  ``pause`` of each tag gives its memory back (free memory rises; the graph's while a replay on another
  stream still runs), ``get_cpu_backup`` of a paused weight gives its bytes, another job uses the memory and
  empties the cache, ``resume`` brings it back at the same addresses: the weights' bytes are back, the graph
  replays with the right result; with ``memory_margin_bytes`` set, 2 GiB past it is refused as out of memory.
- ``cumem``: vLLM's ``CuMemAllocator`` (``cuvmm_torch.cumem``): weights in ``use_memory_pool(tag="weights")``,
  a KV cache in ``use_memory_pool(tag="kv_cache")``, a decode graph captured into ``cudagraph_pool()`` (as
  vLLM does with ``sleep_mode_offload_cudagraph``); ``sleep(offload_tags=("weights",))`` (vLLM's level 1),
  other work, ``wake_up(tags=["weights"])`` (which wakes the graph's tag too, not the KV cache) then
  ``wake_up(tags=["kv_cache"])``: greedy outputs and the graph's output are the same as before.
- ``graph_region``: cuvmm's own API: a graph captured inside ``cuvmm_torch.region``, its memory slept with
  its bytes and woken five times, with another job writing over the memory each time: every replay gives the
  first replay's result.
- ``dropped_asleep``: a tensor of a tag dropped while the tag sleeps (its deleter runs then): still counted
  until the wake, freed by it; the tag's other tensor has its bytes back.

Needs PyTorch, a GPU and cuvmm's library (``CUVMM_TORCH_LIB``). Prints a JSON line per case; exit status 1 if
any failed.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))

SCHEMA = "cuvmm-sleep-frameworks/1"
GIB = 1 << 30
# Seconds a case's process may take: run.sh gives the four cases 300 s together.
CASE_TIMEOUT_S = 90


def free_bytes(torch):
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def other_job(torch, size):
    """Another job takes `size` bytes, writes over them and gives them back."""
    other = torch.full((size,), 0x5A, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    del other
    torch.cuda.empty_cache()


def case_memory_saver(torch, cuvmm):
    from cuvmm_torch.memory_saver import torch_memory_saver  # noqa: PLC0415

    torch_memory_saver.hook_mode = "preload"
    out = {}
    with torch_memory_saver.region(tag="kv_cache"):
        kv = torch.full((5, 100_000_000), 1.0, dtype=torch.float32, device="cuda")
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda()
    x = torch.randn(64, 4096, device="cuda")
    expected = model(x)
    # cuvmm's own: the weights' host memory pinned now, so that their first pause pins nothing.
    weight_bytes = sum(p.nbytes for p in model.parameters())
    out["prepared_bytes"] = torch_memory_saver.prepare_pause("weights")
    static_input = torch.zeros((5,), dtype=torch.float32, device="cuda")

    def step():
        value = (static_input + kv.mean(dim=1)).mean()
        # A large temporary inside the graph: its memory is the graph pool's, under the tag "graph".
        return (torch.ones((1_000_000_000,), device="cuda") * value).mean()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch_memory_saver.cuda_graph(graph, tag="graph"):
        static_output = step()
    static_input[...] = 100
    graph.replay()
    out["replay_before"] = static_output.item()
    addresses = (kv.data_ptr(), model[0].weight.data_ptr())
    weight_on_host = model[0].weight.detach().cpu()
    torch.cuda.empty_cache()
    free = free_bytes(torch)
    # A replay still running, on a stream the graph was not captured on and cuvmm never saw, when the
    # graph's tag pauses: the pause waits for the device (else it unmaps under the kernels).
    replayer = torch.cuda.Stream()
    replayer.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(replayer):
        graph.replay()
    torch_memory_saver.pause("graph")
    out["graph_given_back"] = free_bytes(torch) - free
    torch_memory_saver.pause("kv_cache")
    out["kv_given_back"] = free_bytes(torch) - free - out["graph_given_back"]
    torch_memory_saver.pause("weights")
    out["all_given_back"] = free_bytes(torch) - free
    # slime reads a paused model's weights this way, to send them to its inference engine.
    backup = torch_memory_saver.get_cpu_backup(model[0].weight, zero_copy=True)
    out["cpu_backup_equal"] = backup is not None and bool(torch.equal(backup, weight_on_host))
    other_job(torch, int(out["all_given_back"] * 0.9))
    began = time.monotonic()
    torch_memory_saver.resume()
    out["resume_s"] = round(time.monotonic() - began, 4)
    out["same_addresses"] = addresses == (kv.data_ptr(), model[0].weight.data_ptr())
    out["weights_intact"] = bool(torch.equal(model(x), expected))
    out["cpu_backup_after_resume"] = torch_memory_saver.get_cpu_backup(model[0].weight) is not None
    kv[...] = 2
    static_input[...] = 200
    graph.replay()
    out["replay_after"] = static_output.item()
    # slime sets memory_margin_bytes (1 GiB by default): keep all but 1 GiB of what is free now, then ask
    # for 2 GiB of new memory, refused as PyTorch's out-of-memory that names the margin; then 0 again.
    torch.cuda.empty_cache()
    torch_memory_saver.memory_margin_bytes = free_bytes(torch) - GIB
    try:
        torch.empty((2 * GIB,), dtype=torch.uint8, device="cuda")
        out["margin_refused"] = "served"
    except torch.OutOfMemoryError as error:
        out["margin_refused"] = "device margin" in str(error)
    torch_memory_saver.memory_margin_bytes = 0
    out["after_margin"] = torch.empty((2 * GIB,), dtype=torch.uint8, device="cuda").numel() == 2 * GIB
    out["ok"] = (out["replay_before"] == 101 and out["replay_after"] == 202 and out["same_addresses"]
                 and out["weights_intact"] and out["cpu_backup_equal"] and not out["cpu_backup_after_resume"]
                 and out["margin_refused"] is True and out["after_margin"]
                 and out["prepared_bytes"] >= weight_bytes
                 and out["kv_given_back"] >= 1.9e9 and out["graph_given_back"] >= 3.9e9)
    return out


def case_cumem(torch, cuvmm):
    from cuvmm_torch.cumem import CuMemAllocator  # noqa: PLC0415

    allocator = CuMemAllocator.get_instance()
    out = {}
    with allocator.use_memory_pool(tag="weights"):
        torch.manual_seed(0)
        vocab, dim = 32_000, 2048
        embed = torch.nn.Embedding(vocab, dim).cuda().half()
        layers = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(8)]).cuda().half()
        head = torch.nn.Linear(dim, vocab, bias=False).cuda().half()
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = torch.zeros((4 * GIB // 2,), dtype=torch.half, device="cuda")

    def decode(tokens, steps=16):
        out_tokens = []
        for _ in range(steps):
            h = layers(embed(tokens)) + kv[: dim].view(1, dim)
            tokens = head(h).argmax(dim=-1)
            out_tokens.append(tokens)
        return torch.cat(out_tokens)

    prompt = torch.arange(8, device="cuda") % vocab
    greedy = decode(prompt)
    static_tokens = prompt.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode(static_tokens, steps=1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with allocator.cudagraph_pool() as pool:
        with torch.cuda.graph(graph, pool=pool):
            graph_out = decode(static_tokens, steps=1)
    graph.replay()
    graph_before = graph_out.clone()
    out["usage"] = allocator.get_current_usage()
    torch.cuda.empty_cache()
    free = free_bytes(torch)
    began = time.monotonic()
    allocator.sleep(offload_tags=("weights",))
    out["sleep_s"] = round(time.monotonic() - began, 4)
    out["given_back"] = free_bytes(torch) - free
    other_job(torch, int(out["given_back"] * 0.9))
    began = time.monotonic()
    allocator.wake_up(tags=["weights"])
    out["states_after_weights"] = {t["name"]: t["state"] for t in cuvmm.tags()}
    allocator.wake_up(tags=["kv_cache"])
    out["wake_s"] = round(time.monotonic() - began, 4)
    kv.zero_()
    out["greedy_same"] = bool(torch.equal(decode(prompt), greedy))
    graph.replay()
    out["graph_same"] = bool(torch.equal(graph_out, graph_before))
    woken = out["states_after_weights"]
    out["ok"] = (out["greedy_same"] and out["graph_same"] and out["given_back"] >= 0.9 * out["usage"]
                 and woken.get("vllm:cudagraph") == "awake" and woken.get("vllm:kv_cache") == "asleep")
    return out


def case_graph_region(torch, cuvmm):
    out = {"replays": []}
    with cuvmm.region("graph"):
        a = torch.randn(4096, 4096, device="cuda")
        b = torch.randn(4096, 4096, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        (a @ b).relu().sum()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with cuvmm.region("graph"):
        with torch.cuda.graph(graph):
            total = ((a @ b).relu() @ b).sum()
    graph.replay()
    first = total.item()
    torch.cuda.empty_cache()
    for _ in range(5):
        free = free_bytes(torch)
        given = cuvmm.sleep("graph", keep=True)
        gained = free_bytes(torch) - free
        other_job(torch, int(gained * 0.9))
        cuvmm.wake("graph")
        total.zero_()
        graph.replay()
        out["replays"].append({"given_back": given, "free_gain": gained, "result": total.item()})
    out["first"] = first
    out["ok"] = all(r["result"] == first and r["given_back"] > 0 for r in out["replays"])
    return out


def case_dropped_asleep(torch, cuvmm):
    with cuvmm.region("dropped"):
        a = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
        b = torch.arange(16 << 20, dtype=torch.float32, device="cuda")
    expected = b.sum().item()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cuvmm.sleep("dropped", keep=True)
    del a  # its deleter runs while the tag sleeps
    asleep = torch.cuda.memory_allocated()
    cuvmm.wake("dropped")
    woken = torch.cuda.memory_allocated()
    out = {"allocated": [before, asleep, woken], "sum": b.sum().item(), "expected": expected}
    # Freed at once, as PyTorch counts a free; its memory is free again at the wake.
    out["ok"] = before - asleep == 64 << 20 and woken == asleep and out["sum"] == expected
    return out


CASES = {"memory_saver": case_memory_saver, "cumem": case_cumem, "graph_region": case_graph_region,
         "dropped_asleep": case_dropped_asleep}


def run_case(name):
    import cuvmm_torch as cuvmm  # noqa: PLC0415 (after sys.path)
    import torch  # noqa: PLC0415

    layer = cuvmm.install()
    try:
        result = CASES[name](torch, cuvmm)
    except Exception as error:  # noqa: BLE001 (reported as the case's failure)
        result = {"ok": False, "error": repr(error)[:600]}
    result.update(suite=SCHEMA, case=name, layer=layer)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default=",".join(CASES), help="comma-separated cases: " + ", ".join(CASES))
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [n for n in args.case.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--case: unknown {', '.join(unknown)}")
    if args.in_process:
        return run_case(names[0])
    failed = 0
    for name in names:
        # A fresh process per case: PyTorch takes one allocator per process.
        try:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", name, "--in-process"],
                                  capture_output=True, text=True, timeout=CASE_TIMEOUT_S, check=False)
            status, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as error:
            # What the killed process wrote comes as bytes here, whatever `text` says.
            status, stdout = f"timed out after {CASE_TIMEOUT_S} s", ""
            stderr = (error.stderr or b"").decode(errors="replace")
        line = next((l for l in reversed(stdout.splitlines()) if l.startswith("{")), None)
        if line is None:
            line = json.dumps({"suite": SCHEMA, "case": name, "ok": False, "status": status,
                               "stderr": stderr[-1500:]})
        print(line, flush=True)
        failed += status != 0
    print(f"sleep-frameworks: {len(names) - failed} of {len(names)} cases passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
