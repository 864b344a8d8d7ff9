#!/usr/bin/env python3
"""Two processes take turns on one GPU (issue 44): an inference process (a model's weights, kept at its
sleep; a KV cache and a decode CUDA graph's memory, discarded) and a training process (parameters and
optimizer state, kept; activations allocated and freed each step), each holding more than half of the
device's free memory, so each sleeps what the other needs before the other wakes. Both run cuvmm as
PyTorch's allocator; the parent passes the turn with pipes and times each phase.

    python3 tools/two_process_bench.py [--cycles 5] [--fraction 0.6] [--steps 4] [--timeout 120]

A cycle: inference wakes (its weights copied back), checks its weights, serves ``--steps`` graph replays and
checks their result, sleeps; training wakes (its state copied back), makes ``--steps`` optimizer steps, sleeps.
Each process's first sleep, when it pins its host memory, comes before the cycles and is reported on its
``ready`` line.
Prints a JSON line per cycle as it ends (each phase's seconds, the bytes woken and their GB/s, the cycle's
total), then a table and the mean time per cycle from the second on. Exit status 1 if a check failed: the
weights or the replayed output changed, a parameter was lost, or a process could not wake; also, at once, if a
process exits or stays silent ``--timeout`` seconds (a line names it, with its exit code).
"""

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing.connection import wait

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

SCHEMA = "cuvmm-two-process-bench/1"
GIB = 1 << 30


def timed(f):
    began = time.monotonic()
    value = f()
    return value, round(time.monotonic() - began, 4)


def tag_bytes(cuvmm, tag):
    """The bytes of `tag`'s live tensors: what its sleep copies out and its wake back."""
    return next(t["live_bytes"] for t in cuvmm.tags() if t["name"] == tag)


def inference(conn, budget, steps):
    import cuvmm_torch as cuvmm  # noqa: PLC0415
    import torch  # noqa: PLC0415

    cuvmm.install()
    dim = 8192
    weight_bytes = int(budget * 0.6)  # and a KV cache of 0.35: 0.95 of the budget awake
    layers = max(1, weight_bytes // (dim * dim * 2))
    with cuvmm.region("weights"):
        torch.manual_seed(0)
        # He's scale keeps the signal's size through the ReLUs: with 1/sqrt(dim) it halves at each layer and
        # is 0 in fp16 long before the last, so the output check below could never fail.
        weights = [torch.randn(dim, dim, device="cuda", dtype=torch.half) * (2 / dim) ** 0.5
                   for _ in range(layers)]
    with cuvmm.region("kv_cache"):
        kv = torch.zeros(int(budget * 0.35) // 2, dtype=torch.half, device="cuda")
    x = torch.randn(64, dim, device="cuda", dtype=torch.half)

    def decode():
        h = x
        for w in weights:
            h = torch.relu(h @ w)
        return h.float().sum() + kv[:1].float().sum()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with cuvmm.region("graph"):
        with torch.cuda.graph(graph):
            out = decode()
    graph.replay()
    expected = out.item()

    def checksum():
        return sum(w.sum(dtype=torch.float64).item() for w in weights)

    first = checksum()
    kept = tag_bytes(cuvmm, "weights")
    sleep_tags = [("graph", False), ("kv_cache", False), ("weights", True)]
    _, sleep_s = timed(lambda: [cuvmm.sleep(t, keep=k) for t, k in sleep_tags])
    conn.send({"ready": True, "kept_bytes": kept, "first_sleep_s": sleep_s})
    while conn.recv() == "turn":
        report = {"kept_bytes": kept}
        try:
            _, report["wake_s"] = timed(lambda: [cuvmm.wake(t) for t in ("weights", "kv_cache", "graph")])
            report["weights_same"] = checksum() == first
            kv.zero_()

            def serve():
                results = []
                for _ in range(steps):
                    graph.replay()
                    results.append(out.item())
                return results

            results, report["work_s"] = timed(serve)
            report["output_same"] = all(r == expected for r in results)
            _, report["sleep_s"] = timed(lambda: [cuvmm.sleep(t, keep=k) for t, k in sleep_tags])
        except Exception as error:  # noqa: BLE001 (reported to the parent)
            report["error"] = repr(error)[:400]
        conn.send(report)


def training(conn, budget, steps):
    import cuvmm_torch as cuvmm  # noqa: PLC0415
    import torch  # noqa: PLC0415

    cuvmm.install()
    dim = 8192
    # Parameters, Adam's two moments and a gradient: four copies of the parameters, 0.9 of the budget.
    layers = max(1, int(budget * 0.9) // (4 * dim * dim * 4))
    with cuvmm.region("train"):
        torch.manual_seed(1)
        model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)]).cuda()
        # Backward runs on autograd's own thread, where this thread's tag does not apply: the gradients are
        # made here, in the tag, and backward adds into them (zero_grad keeps them).
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        x = torch.randn(256, dim, device="cuda")
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    kept = tag_bytes(cuvmm, "train")
    _, sleep_s = timed(lambda: (cuvmm.sleep("train", keep=True), torch.cuda.empty_cache()))
    conn.send({"ready": True, "kept_bytes": kept, "first_sleep_s": sleep_s})
    last = None
    while conn.recv() == "turn":
        report = {"kept_bytes": kept}
        try:
            _, report["wake_s"] = timed(lambda: cuvmm.wake("train"))
            checksum = sum(p.double().sum().item() for p in model.parameters())
            report["state_kept"] = last is None or checksum == last

            def train():
                for _ in range(steps):
                    with cuvmm.region(None):
                        loss = model(x).square().mean()
                        loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=False)
                torch.cuda.synchronize()

            _, report["work_s"] = timed(train)
            last = sum(p.double().sum().item() for p in model.parameters())
            _, report["sleep_s"] = timed(lambda: (cuvmm.sleep("train", keep=True), torch.cuda.empty_cache()))
        except Exception as error:  # noqa: BLE001 (reported to the parent)
            report["error"] = repr(error)[:400]
        conn.send(report)


def host_available():
    """The host's available memory in bytes (/proc/meminfo's MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--fraction", type=float, default=0.6,
                        help="of the device's free memory, what each process holds awake (more than half)")
    parser.add_argument("--steps", type=int, default=4, help="graph replays and training steps per turn")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for a process's ready line or turn before failing")
    args = parser.parse_args(argv)
    if args.cycles < 1 or not 0.0 < args.fraction < 1.0 or args.timeout <= 0:
        parser.error("--cycles at least 1, --fraction in (0, 1), --timeout above 0")

    import torch  # noqa: PLC0415

    free = torch.cuda.mem_get_info()[0]
    budget = int(free * args.fraction)
    # What the two keep at their sleeps is page-locked host memory, 1.5 budgets (0.6 of one for the weights,
    # 0.9 for the training state): at most 0.6 of the host's available memory (an H200 has more device memory
    # than some of its hosts have RAM). Capped, the two no longer need each other's memory, and it says so.
    available = host_available()
    if available is not None and budget * 1.5 > 0.6 * available:
        budget = int(0.6 * available / 1.5)
        print(f"budget capped by the host's {available / GIB:.1f} GiB available: the processes now fit together",
              flush=True)
    print(f"two processes on {torch.cuda.get_device_name()}, {free / GIB:.1f} GiB free, "
          f"{budget / GIB:.1f} GiB each", flush=True)
    context = multiprocessing.get_context("spawn")
    roles = {}

    def answer(name, message=None):
        """Sends `name` the message, if any, and returns its answer; None, its failure printed and every process
        ended, if it exits without one or stays silent --timeout seconds."""
        process, conn = roles[name]
        try:
            if message is not None:
                conn.send(message)
            if conn in wait([conn, process.sentinel], args.timeout) or conn.poll(1):
                return conn.recv()
        except (EOFError, BrokenPipeError):
            pass
        process.join(5)
        why = f"no answer within {args.timeout:g} s" if process.is_alive() else "exited without answering"
        print(json.dumps({"suite": SCHEMA, "process": name, "error": why, "exitcode": process.exitcode}),
              flush=True)
        for other, _ in roles.values():
            other.terminate()
            other.join(10)
        return None

    # The trainer starts first and sleeps; then the inference process starts (so both are never awake).
    for name, target in (("training", training), ("inference", inference)):
        parent, child = context.Pipe()
        process = context.Process(target=target, args=(child, budget, args.steps), daemon=True)
        process.start()
        child.close()  # so that the child's exit shows here as the end of its pipe
        roles[name] = (process, parent)
        ready = answer(name)
        if ready is None:
            return 1
        print(json.dumps({"suite": SCHEMA, "process": name, **ready}), flush=True)
    cycles, failed = [], False
    for cycle in range(args.cycles):
        began = time.monotonic()
        row = {"suite": SCHEMA, "cycle": cycle}
        for name in ("inference", "training"):
            report = answer(name, "turn")
            if report is None:
                return 1
            row[name] = report
            woken = report.get("kept_bytes", 0)
            if "wake_s" in report and report["wake_s"] > 0:
                report["wake_gbps"] = round(woken / report["wake_s"] / 1e9, 2)
            if "sleep_s" in report and report["sleep_s"] > 0:
                report["sleep_gbps"] = round(woken / report["sleep_s"] / 1e9, 2)
            if "error" in report or any(report.get(k) is False for k in ("weights_same", "output_same", "state_kept")):
                failed = True
        row["cycle_s"] = round(time.monotonic() - began, 4)
        cycles.append(row)
        print(json.dumps(row), flush=True)
    for process, conn in roles.values():
        conn.send("stop")
        process.join(timeout=60)
    print("| cycle | inference wake s | serve s | sleep s | training wake s | train s | sleep s | cycle s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in cycles:
        i, t = row["inference"], row["training"]
        print(f"| {row['cycle']} | {i.get('wake_s')} | {i.get('work_s')} | {i.get('sleep_s')} | {t.get('wake_s')} "
              f"| {t.get('work_s')} | {t.get('sleep_s')} | {row['cycle_s']} |")
    later = [row["cycle_s"] for row in cycles[1:]] or [cycles[0]["cycle_s"]]
    print(f"two-process: {statistics.mean(later):.3f} s per cycle from the second on"
          f"{' (a check failed)' if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
