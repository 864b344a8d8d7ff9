"""Cases 3 to 6: CUDA graphs (one, two back to back, replay after heavy allocation, two threads, a tensor
used on a side stream dropped during a capture) and ``torch.compile(mode="reduce-overhead")``."""

import random
import threading
import time

from . import (  # the framework, in __init__.py
    GIB,
    MIB,
    SLEEP_CYCLES,
    _bounds,
    _max_diff,
    _warm_up,
    TOLERANCE,
    case,
    check,
)


# --- 3 to 5. CUDA graphs -----------------------------------------------------------------------------------

N = 1024  # graph tensors are N x N floats: 4 MiB, in the large pool


def _chain(torch, x, w, steps=3, pause=None):
    """Matmuls and elementwise ops whose temporaries are freed as it goes (inside a capture, too)."""
    y = x
    for _ in range(steps):
        a = torch.sin(y * 1.5 + 0.25)
        b = a @ w
        del a
        y = torch.tanh(b) + 0.5 * y
        del b
        if pause is not None:
            pause()
    return y


def _inputs(torch, device, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, N, generator=generator).to(device)
    w = (torch.randn(N, N, generator=generator) / N ** 0.5).to(device)
    return x, w


def _reference(torch, x, w):
    """The eager result for the graph's current input, on the host (computed before any replay)."""
    return _chain(torch, x.clone(), w).cpu()


@case("graphs_back_to_back", "two graphs captured back to back with torch.cuda.graph (each freeing temporaries "
      "inside its capture), replayed in both orders on new inputs: each output equals its eager result",
      timeout=60)
def graphs_back_to_back(ctx):
    torch = ctx.torch
    (x1, w1), (x2, w2) = _inputs(torch, ctx.device, 1), _inputs(torch, ctx.device, 2)
    _warm_up(torch, [lambda: _chain(torch, x1, w1), lambda: _chain(torch, x2, w2)])
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        y1 = _chain(torch, x1, w1)
    with torch.cuda.graph(g2):
        y2 = _chain(torch, x2, w2)
    graphs = {1: (g1, x1, w1, y1), 2: (g2, x2, w2, y2)}
    generator = torch.Generator().manual_seed(3)
    worst, bad = 0.0, []
    for order in ((1, 2), (2, 1), (2, 1, 2), (1, 2, 1)):
        references = {}
        for k, (_, x, w, _) in graphs.items():
            x.copy_(torch.randn(N, N, generator=generator).to(ctx.device))
            references[k] = _reference(torch, x, w)
        for k in order:
            graphs[k][0].replay()
        torch.cuda.synchronize()
        for k, (_, _, _, y) in graphs.items():
            diff = _max_diff(torch, y, references[k])
            worst = max(worst, diff)
            if diff > TOLERANCE:
                bad.append(f"graph {k} after replaying {'-'.join(map(str, order))}: max diff {diff:.3g}")
    ctx.figures.update(max_abs_diff=worst)
    check(not bad, "; ".join(bad))
    return f"4 replay orders, max diff {worst:.2g}"


@case("graph_after_empty_cache", "a graph replayed after many allocations of varied sizes, one of nearly all "
      "free memory, frees and empty_cache between capture and replay: output equals eager, tensors allocated "
      "since are intact", timeout=90)
def graph_after_empty_cache(ctx):
    torch = ctx.torch
    x, w = _inputs(torch, ctx.device, 4)
    _warm_up(torch, [lambda: _chain(torch, x, w)])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _chain(torch, x, w)
    torch.cuda.synchronize()
    # Churn: tensors of 4 KiB to 256 MiB, up to 4 GiB live, each filled.
    rng, live, live_bytes = random.Random(4), [], 0
    for i in range(400):
        size = int(2 ** rng.uniform(12, 28))
        t = torch.empty(size, dtype=torch.uint8, device=ctx.device)
        t.fill_(i % 251)
        live.append(t)
        live_bytes += size
        while live_bytes > 4 * GIB or len(live) > 40:
            live_bytes -= live.pop(rng.randrange(len(live))).numel()
    del live, t
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    big_bytes = max(free - 2 * GIB, 0)
    if big_bytes:
        big = torch.empty(big_bytes, dtype=torch.uint8, device=ctx.device)
        big.fill_(0x33)
        del big
    torch.cuda.synchronize()
    ctx.empty_cache()
    # Tensors allocated after the churn, some of the graph's temporaries' size, filled with 7.
    sentinels = [torch.full((N * N,), 7.0, device=ctx.device) for _ in range(32)]
    sentinels += [torch.full((64 * MIB,), 7.0, device=ctx.device) for _ in range(4)]
    x.copy_(torch.randn(N, N, generator=torch.Generator().manual_seed(5)).to(ctx.device))
    reference = _reference(torch, x, w)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    diff = _max_diff(torch, y, reference)
    overwritten = sum(_bounds(s) != (7.0, 7.0) for s in sentinels)
    ctx.figures.update(max_abs_diff=diff, big_allocation_bytes=big_bytes, sentinels=len(sentinels),
                       sentinels_overwritten=overwritten)
    check(diff <= TOLERANCE, f"the replayed output differs from eager by up to {diff:.3g}")
    check(overwritten == 0, f"{overwritten}/{len(sentinels)} tensors allocated after the capture were overwritten "
          "by the replay")
    return f"max diff {diff:.2g}, {len(sentinels)} later tensors intact"


@case("graph_threads", "two threads each capture a graph on its own stream at the same time "
      "(CUDAGraph.capture_begin(capture_error_mode='thread_local'), as torch.cuda.graph calls it), their "
      "allocations interleaved; replays in both orders equal eager", timeout=60)
def graph_threads(ctx):
    import gc  # noqa: PLC0415

    torch = ctx.torch
    inputs = [_inputs(torch, ctx.device, 6), _inputs(torch, ctx.device, 7)]
    _warm_up(torch, [lambda x=x, w=w: _chain(torch, x, w) for x, w in inputs])
    graphs = [torch.cuda.CUDAGraph() for _ in inputs]
    outputs, errors = [None, None], []
    barrier = threading.Barrier(2)

    # torch.cuda.graph itself cannot be entered while another thread captures: its __enter__ synchronizes the
    # device and empties the cache. Each thread does the rest of what it does.
    def capture(i):
        try:
            x, w = inputs[i]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                _chain(torch, x, w)  # this thread's cuBLAS handle and workspace, on this stream
            stream.synchronize()
            barrier.wait(timeout=30)
            with torch.cuda.stream(stream):
                graphs[i].capture_begin(capture_error_mode="thread_local")
                try:
                    outputs[i] = _chain(torch, x, w, steps=6, pause=lambda: time.sleep(0.002))
                finally:
                    graphs[i].capture_end()
        except Exception as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)
            try:
                barrier.abort()
            except threading.BrokenBarrierError:
                pass

    enabled = gc.isenabled()
    gc.disable()  # a collection inside a capture could free the other thread's tensors
    try:
        threads = [threading.Thread(target=capture, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=45)
    finally:
        if enabled:
            gc.enable()
    if errors:
        raise errors[0]
    check(all(o is not None for o in outputs), "a capture thread did not finish")
    generator = torch.Generator().manual_seed(8)
    worst, bad = 0.0, []
    for order in ((0, 1), (1, 0)):
        references = []
        for x, w in inputs:
            x.copy_(torch.randn(N, N, generator=generator).to(ctx.device))
            references.append(_chain(torch, x.clone(), w, steps=6).cpu())
        for i in order:
            graphs[i].replay()
        torch.cuda.synchronize()
        for i, output in enumerate(outputs):
            diff = _max_diff(torch, output, references[i])
            worst = max(worst, diff)
            if diff > TOLERANCE:
                bad.append(f"graph {i} after replaying {order}: max diff {diff:.3g}")
    ctx.figures.update(max_abs_diff=worst)
    check(not bad, "; ".join(bad))
    return f"both orders, max diff {worst:.2g}"


@case("free_in_capture_used_elsewhere", "a tensor read on a side stream behind a sleep kernel (record_stream) "
      "and dropped while a graph is captured: memory_allocated falls by its size at the free, as PyTorch counts "
      "it; a same-size tensor overwritten after the capture leaves the side stream's read intact; the graph "
      "replays equal to eager", timeout=60)
def free_in_capture_used_elsewhere(ctx):
    import gc  # noqa: PLC0415

    torch = ctx.torch
    x, w = _inputs(torch, ctx.device, 9)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain(torch, x, w)  # cuBLAS's handle and workspace on the capturing stream, before the capture
    stream.synchronize()
    n = 16 * MIB // 4  # 64 MiB of floats
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    t = torch.full((n,), 5.0, device=ctx.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        read = torch.stack([t.min(), t.max()])
    t.record_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Captured without torch.cuda.graph, whose __enter__ synchronizes the device: the side stream still runs.
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin()
            try:
                before = torch.cuda.memory_allocated()
                del t  # its events wait until no capture is underway
                after = torch.cuda.memory_allocated()
                y = _chain(torch, x, w)
            finally:
                graph.capture_end()
    finally:
        if enabled:
            gc.enable()
    u = torch.empty(n, device=ctx.device)
    u.fill_(-1.0)
    torch.cuda.synchronize()
    x.copy_(torch.randn(N, N, generator=torch.Generator().manual_seed(10)).to(ctx.device))
    reference = _reference(torch, x, w)
    graph.replay()
    torch.cuda.synchronize()
    diff = _max_diff(torch, y, reference)
    ctx.figures.update(allocated_drop=before - after, read=read.tolist(), max_abs_diff=diff)
    check(before - after == n * 4, f"memory_allocated fell by {before - after} B at the free, not {n * 4}")
    check(read.tolist() == [5.0, 5.0], f"the side stream read {read.tolist()}, not its tensor's 5.0")
    check(diff <= TOLERANCE, f"the replayed output differs from eager by up to {diff:.3g}")
    del u
    return f"allocated fell by {(before - after) >> 20} MiB at the free, read intact, max diff {diff:.2g}"


# --- 6. torch.compile ---------------------------------------------------------------------------------------


@case("compile_reduce_overhead", "torch.compile(mode='reduce-overhead') of a small MLP, 6 calls with varying "
      "inputs and other allocations between them: each output (cloned at once) equals eager, and still does "
      "at the end", timeout=240, fresh=True)
def compile_reduce_overhead(ctx):
    torch = ctx.torch
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                          nn.Linear(512, 64)).to(ctx.device)
    compiled = torch.compile(model, mode="reduce-overhead")
    kept, junk, worst, bad = [], [], 0.0, []
    began = time.perf_counter()
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(64, 256, device=ctx.device) * (1 + 0.5 * i)
            reference = model(x).cpu()
            got = compiled(x).clone()  # the next call may overwrite a CUDA graph's output
            diff = _max_diff(torch, got, reference)
            worst = max(worst, diff)
            if diff > TOLERANCE * max(1.0, reference.abs().max().item()):
                bad.append(f"call {i}: max diff {diff:.3g}")
            kept.append((got, reference))
            junk.append([torch.full((MIB,), float(i), device=ctx.device) for _ in range(8)])
    torch.cuda.synchronize()
    later = max(_max_diff(torch, got, reference) for got, reference in kept)
    junk_intact = all(_bounds(t) == (float(i), float(i)) for i, ts in enumerate(junk) for t in ts)
    ctx.figures.update(max_abs_diff=worst, max_abs_diff_at_end=later, junk_intact=junk_intact,
                       seconds_with_compilation=round(time.perf_counter() - began, 2))
    check(not bad, "; ".join(bad))
    check(later <= TOLERANCE * 10, f"outputs kept from earlier calls changed later (max diff {later:.3g})")
    check(junk_intact, "tensors allocated between calls were overwritten")
    return f"6 calls, max diff {worst:.2g}"
