"""The cases of tools/gpu/torch_suite.py: what PyTorch users do with the CUDA allocator, each checked against a
reference computed without the hazard (on the CPU, or before the hazard, synchronously).

Importing this module does not import PyTorch: every case receives a ``Context`` (``ctx.torch``, ``ctx.cuvmm``,
``ctx.device``, ``ctx.figures``) built in the case's process after the allocator was chosen. A case returns a
short detail on success, raises ``CaseFailure`` when a result differs from its reference, ``SkipCase`` when it
does not apply; any other exception is classified by ``torch_suite.classify_exception``.
"""

import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALLOCATORS = ("native", "expandable", "cuvmm")
GIB = 1 << 30
MIB = 1 << 20
# torch.cuda._sleep's argument, in GPU cycles: about 35 ms at an H100's 1.98 GHz, long enough that the host
# queues everything after it (a free, an allocation, an overwrite) before the sleeping stream reads.
SLEEP_CYCLES = 1 << 26


class CaseFailure(AssertionError):
    """A result differed from its reference (status fail)."""


class SkipCase(Exception):
    """The case does not apply here (status skip)."""


def check(condition, message):
    if not condition:
        raise CaseFailure(message)


@dataclass(frozen=True)
class Case:
    name: str
    summary: str  # what it asserts, one line
    run: object  # run(ctx) -> detail
    timeout: float  # seconds, within the case's process
    fresh: bool = False  # in a process of its own (state it leaves, or an allocator setting of its own)
    prepare: object = None  # prepare(allocator): before the allocator is chosen (fresh cases only)
    allocators: tuple = field(default=ALLOCATORS)  # where it applies; elsewhere it is reported as skip


CASES = {}


def case(name, summary, timeout, fresh=False, prepare=None, allocators=ALLOCATORS):
    def register(function):
        if name in CASES:
            raise ValueError(f"case {name} registered twice")
        CASES[name] = Case(name, summary, function, timeout, fresh, prepare, tuple(allocators))
        return function

    return register


# --- choosing the allocator ------------------------------------------------------------------------------


def _without_expandable(conf):
    return ",".join(part for part in conf.split(",") if part and not part.strip().startswith("expandable_segments"))


def allocator_environment(allocator, environ, root=ROOT):
    """The environment variables to set for `allocator` (a dict: name -> value, or None to remove), given
    the current environment: expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF for `expandable` (and
    out of it for the others, so that a setting left in the shell does not make every column expandable);
    for `cuvmm`, CUVMM_TORCH_LIB defaults to libcuvmm_torch.so of the folder tools/gpu/build.sh filled."""
    conf = _without_expandable(environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    changes = {}
    if allocator == "expandable":
        changes["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
    elif "PYTORCH_CUDA_ALLOC_CONF" in environ:
        changes["PYTORCH_CUDA_ALLOC_CONF"] = conf or None
    if allocator == "cuvmm" and not environ.get("CUVMM_TORCH_LIB"):
        built = os.path.join(os.path.realpath(environ.get("GPU_BIN") or os.path.join(root, "gpu-bin")),
                             "libcuvmm_torch.so")
        if os.path.exists(built):
            changes["CUVMM_TORCH_LIB"] = built
    return changes


def setup_allocator(allocator):
    """Chooses `allocator` before PyTorch touches the GPU (as tools/train_gpt.py does); returns
    (torch, cuvmm_torch or None)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator}")
    for name, value in allocator_environment(allocator, os.environ).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    import torch  # noqa: PLC0415 (the suite's driver runs without PyTorch)

    cuvmm = None
    if allocator == "cuvmm":
        python = os.path.join(ROOT, "python")
        if python not in sys.path:
            sys.path.insert(0, python)
        import cuvmm_torch  # noqa: PLC0415

        cuvmm_torch.install()
        cuvmm = cuvmm_torch
    return torch, cuvmm


class Context:
    """What a case gets: the chosen allocator, PyTorch, cuvmm_torch (None unless cuvmm), the device, and
    ``figures``, a dict whose contents go into the case's result (also when it fails)."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.torch, self.cuvmm = setup_allocator(allocator)
        self.figures = {}
        if not self.torch.cuda.is_available():
            raise SkipCase("PyTorch sees no CUDA device")
        self.device = self.torch.device("cuda", 0)

    def empty_cache(self):
        """torch.cuda.empty_cache(), and with cuvmm also cuvmm_torch.empty_cache() (README: PyTorch may not
        forward the first to a pluggable allocator)."""
        self.torch.cuda.empty_cache()
        if self.cuvmm is not None:
            self.cuvmm.empty_cache(0)

    def max_reserved(self):
        if self.cuvmm is not None:
            return self.cuvmm.memory_stats(0)["reserved_bytes.all.peak"]
        return self.torch.cuda.max_memory_reserved(0)


def device_total_memory(index=0):
    """The device's memory in bytes, from the driver, without creating a context (so before PyTorch chose its
    allocator)."""
    import ctypes  # noqa: PLC0415

    cuda = ctypes.CDLL("libcuda.so.1")
    device, total = ctypes.c_int(), ctypes.c_size_t()
    for name, call in [("cuInit", lambda: cuda.cuInit(0)),
                       ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(device), index)),
                       ("cuDeviceTotalMem", lambda: cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device))]:
        if (status := call()) != 0:
            raise RuntimeError(f"{name} failed with CUDA error {status}")
    return total.value


def _max_diff(torch, got, reference):
    """The largest absolute difference between a GPU tensor and a CPU reference (inf if shapes differ)."""
    got = got.detach().float().cpu()
    if got.shape != reference.shape:
        return float("inf")
    diff = (got - reference.float()).abs().max().item()
    return float("inf") if diff != diff else diff  # NaN: as far off as it gets


def _bounds(tensor):
    """(min, max) of a GPU tensor, on the host."""
    return tensor.min().item(), tensor.max().item()


# --- 1. record_stream --------------------------------------------------------------------------------------


def _record_stream_trials(ctx, trials, record, cuvmm_record):
    """Each trial: a tensor filled on the default stream is read on a side stream behind a sleep kernel,
    dropped, and a same-size tensor is allocated and overwritten on the default stream at once. Returns
    (trials whose read was wrong, trials whose new tensor got the dropped one's address)."""
    torch = ctx.torch
    n = 16 * MIB // 4  # 16 Mi floats, 64 MiB
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    reads, reused = [], 0
    for trial in range(trials):
        value = float(trial + 1)
        t = torch.full((n,), value, device=ctx.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            read = torch.stack([t.min(), t.max()])
        if record:
            t.record_stream(side)
        if cuvmm_record:
            ctx.cuvmm.record_stream(t, side)
        address = t.data_ptr()
        del t
        u = torch.empty(n, device=ctx.device)
        u.fill_(-1.0)
        reused += u.data_ptr() == address
        reads.append((value, read))
        del u
    torch.cuda.synchronize()
    wrong = sum(read.tolist() != [value, value] for value, read in reads)
    return wrong, reused


def _record_stream(ctx, cuvmm_record):
    trials = 20
    wrong, reused = _record_stream_trials(ctx, trials, record=True, cuvmm_record=cuvmm_record)
    # The control, without record_stream: it should read wrong values under every allocator, which shows the
    # trials above can see the race at all.
    control_trials = 10
    control_wrong, control_reused = _record_stream_trials(ctx, control_trials, record=False, cuvmm_record=False)
    ctx.figures.update(trials=trials, wrong=wrong, reused_address=reused, control_trials=control_trials,
                       control_wrong=control_wrong, control_reused_address=control_reused)
    control = f"control without record_stream: {control_wrong}/{control_trials} wrong"
    check(wrong == 0, f"{wrong}/{trials} side-stream reads saw the overwrite ({reused} reused the address; {control})")
    return f"0/{trials} wrong ({control}" + ("" if control_wrong else ": the race was not provoked") + ")"


@case("record_stream", "t.record_stream(side), then drop t and overwrite a same-size tensor on the default "
      "stream: the side stream's read (behind a sleep kernel) still sees t's values, 20 trials", timeout=60)
def record_stream(ctx):
    return _record_stream(ctx, cuvmm_record=False)


@case("record_stream_cuvmm", "as record_stream, also calling cuvmm_torch.record_stream(t, side)", timeout=60,
      allocators=("cuvmm",))
def record_stream_cuvmm(ctx):
    if not hasattr(ctx.cuvmm, "record_stream"):
        raise SkipCase("cuvmm_torch has no record_stream")
    return _record_stream(ctx, cuvmm_record=True)


# --- 2. a memory limit -------------------------------------------------------------------------------------

LIMIT_BYTES = 3 * GIB + 256 * MIB


def _limit_fraction(total):
    return LIMIT_BYTES / total


def _prepare_limit(allocator):
    """cuvmm never hears of torch.cuda.set_per_process_memory_fraction (PyTorch installs no hook for a
    pluggable allocator): its limit is per_process_memory_fraction in CUVMM_ALLOC_CONF, read on first use."""
    if allocator == "cuvmm":
        fraction = _limit_fraction(device_total_memory())
        conf = os.environ.get("CUVMM_ALLOC_CONF", "")
        os.environ["CUVMM_ALLOC_CONF"] = ",".join(filter(None, [conf, f"per_process_memory_fraction:{fraction!r}"]))


@case("memory_limit", "under a memory fraction of 3.25 GiB, a 2 GiB block freed on stream A while A's kernel "
      "still reads it (behind a sleep) is not handed to stream B and overwritten: A reads its values, B's "
      "tensor holds B's, a witness tensor is intact, no CUDA error", timeout=90, fresh=True, prepare=_prepare_limit)
def memory_limit(ctx):
    torch = ctx.torch
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = _limit_fraction(total)
    limits = []
    try:
        torch.cuda.set_per_process_memory_fraction(fraction, 0)  # what a user calls; a no-op for cuvmm
        limits.append("set_per_process_memory_fraction")
    except Exception as e:  # noqa: BLE001 (cuvmm's own limit below still applies)
        if ctx.cuvmm is None:
            raise
        limits.append(f"set_per_process_memory_fraction raised {_first_line(e)}")
    if ctx.cuvmm is not None:
        limits.append(os.environ.get("CUVMM_ALLOC_CONF", ""))
        if hasattr(ctx.cuvmm, "set_per_process_memory_fraction"):
            ctx.cuvmm.set_per_process_memory_fraction(fraction, 0)
            limits.append("cuvmm_torch.set_per_process_memory_fraction")
    ctx.figures.update(limit_bytes=LIMIT_BYTES, fraction=fraction, limit=limits)
    n = 2 * GIB // 4
    witness = torch.full((16 * MIB,), 7.0, device=ctx.device)  # 64 MiB, live throughout
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    trials, wrong_reads, wrong_writes = 3, 0, 0
    for trial in range(trials):
        first, second = (a, b) if trial % 2 == 0 else (b, a)
        value = float(trial + 1)
        first.wait_stream(torch.cuda.current_stream())
        second.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(first):
            x = torch.full((n,), value, device=ctx.device)
            torch.cuda._sleep(4 * SLEEP_CYCLES)
            read = torch.stack([x.min(), x.max()])
        del x  # freed on `first` while its kernel has yet to read it
        with torch.cuda.stream(second):
            y = torch.empty(n, device=ctx.device)  # past the limit unless x's memory is reused
            y.fill_(-1.0)
            written = torch.stack([y.min(), y.max()])
        torch.cuda.synchronize()
        wrong_reads += read.tolist() != [value, value]
        wrong_writes += written.tolist() != [-1.0, -1.0]
        del y, read, written
    intact = _bounds(witness) == (7.0, 7.0)
    ctx.figures.update(trials=trials, wrong_reads=wrong_reads, wrong_writes=wrong_writes, witness_intact=intact,
                       max_reserved_bytes=ctx.max_reserved())
    check(wrong_reads == 0, f"{wrong_reads}/{trials} reads on stream A saw stream B's overwrite")
    check(wrong_writes == 0, f"{wrong_writes}/{trials} tensors on stream B did not hold what B wrote")
    check(intact, "the witness tensor was overwritten")
    return f"{trials} trials correct, max reserved {ctx.figures['max_reserved_bytes'] / GIB:.2f} GiB"


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


def _warm_up(torch, functions):
    """Runs each function twice on a side stream, as PyTorch's CUDA graph documentation asks before capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for function in functions:
            for _ in range(2):
                function()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


TOLERANCE = 1e-3


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


# --- 7. memory statistics -----------------------------------------------------------------------------------

# Request sizes whose allocated size is exact under PyTorch's rules: rounded up to 512, and each large one with
# more than 1 MiB left in its segment, so that its block is split.
STATS_SIZES = [1, 100, 511, 512, 513, 4096, 100_000, MIB - 1, 3 * MIB + 7, 36 * MIB + 1]


def round_512(size):
    return max(512, (size + 511) // 512 * 512)


@case("memory_stats", "torch.cuda.memory_stats() works; allocated_bytes.all.current grows by the live tensors' "
      "sizes rounded to 512 and comes back when they are freed; max_memory_reserved() works",
      timeout=60, fresh=True)
def memory_stats(ctx):
    torch = ctx.torch
    expected = sum(round_512(s) for s in STATS_SIZES)
    ctx.figures.update(sizes=STATS_SIZES, expected_delta=expected)
    if ctx.cuvmm is not None:  # cuvmm's own answer, recorded whatever PyTorch's call does below
        before = ctx.cuvmm.memory_stats(0)["allocated_bytes.all.current"]
        tensors = [torch.empty(s, dtype=torch.uint8, device=ctx.device) for s in STATS_SIZES]
        during = ctx.cuvmm.memory_stats(0)["allocated_bytes.all.current"]
        del tensors
        after = ctx.cuvmm.memory_stats(0)["allocated_bytes.all.current"]
        ctx.figures.update(cuvmm_torch_delta=during - before, cuvmm_torch_back=after == before)
    anchor = torch.zeros(1, device=ctx.device)  # noqa: F841 (memory_stats() is {} until CUDA is initialized)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_stats(0)
    key = "allocated_bytes.all.current"
    check(key in before, f"memory_stats() has no {key} ({len(before)} keys)")
    tensors = [torch.empty(s, dtype=torch.uint8, device=ctx.device) for s in STATS_SIZES]
    during = torch.cuda.memory_stats(0)
    allocated, reserved, peak = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0), \
        torch.cuda.max_memory_reserved(0)
    del tensors
    after = torch.cuda.memory_stats(0)
    delta = during[key] - before[key]
    ctx.figures.update(delta=delta, allocated_before=before[key], allocated_after_free=after[key],
                       memory_allocated=allocated, memory_reserved=reserved, max_memory_reserved=peak)
    check(delta == expected, f"allocated grew by {delta} bytes for live tensors of {expected} (rounded to 512)")
    check(after[key] == before[key], f"allocated went from {before[key]} to {after[key]} after the frees")
    check(allocated == during[key], f"memory_allocated() {allocated} != memory_stats()'s {during[key]}")
    check(peak >= reserved >= allocated > 0, f"max_memory_reserved {peak}, memory_reserved {reserved}, "
          f"memory_allocated {allocated} are not in order")
    return f"delta {delta} bytes as expected; max_memory_reserved {peak}"


# --- 8. out of memory -----------------------------------------------------------------------------------------


def _filled(torch, size, value, device):
    """A tensor of `size` bytes holding `value`, synchronized; raises what the allocation or the fill raised
    (with a pluggable allocator that returned null, the fill)."""
    t = torch.empty(size, dtype=torch.uint8, device=device)
    t.fill_(value)
    torch.cuda.synchronize()
    return t


def _oom_class(torch):
    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def _first_line(error):
    return f"{type(error).__name__}: " + (str(error).strip().splitlines() or [""])[0][:240]


@case("oom", "a request beyond the device's memory, and filling the device with 2 GiB tensors, each raise "
      "torch.OutOfMemoryError; the tensors filled before are intact; afterwards a 4 GiB tensor can be "
      "allocated and used", timeout=90, fresh=True)
def oom(ctx):
    torch = ctx.torch
    oom_error = _oom_class(torch)
    total = torch.cuda.get_device_properties(0).total_memory
    problems = []
    try:
        t = _filled(torch, total + 2 * GIB, 1, ctx.device)
        problems.append(f"a request of {(total + 2 * GIB) / GIB:.1f} GiB succeeded (data_ptr {t.data_ptr():#x})")
        del t
    except Exception as e:  # noqa: BLE001 (what it raised is the finding)
        ctx.figures["huge_request"] = _first_line(e)
        if not isinstance(e, oom_error):
            problems.append(f"a request beyond the device raised {_first_line(e)}")
    chunks, chunk = [], 2 * GIB
    try:
        for i in range(total // chunk + 4):
            chunks.append(_filled(torch, chunk, i % 251, ctx.device))
        problems.append(f"{len(chunks)} tensors of 2 GiB fit on a {total / GIB:.1f} GiB device")
    except Exception as e:  # noqa: BLE001
        ctx.figures["filling"] = _first_line(e)
        if not isinstance(e, oom_error):
            problems.append(f"filling the device raised {_first_line(e)}")
    ctx.figures["chunks_before_oom"] = len(chunks)
    del chunks[-2:]  # room for the checks' own small allocations (a reduction's result, its workspace)
    ctx.empty_cache()
    damaged = sum(_bounds(t) != (i % 251, i % 251) for i, t in enumerate(chunks))
    ctx.figures["chunks_damaged"] = damaged
    if damaged:
        problems.append(f"{damaged}/{len(chunks)} tensors filled before the out-of-memory lost their contents")
    del chunks
    ctx.empty_cache()
    again = torch.empty(GIB, device=ctx.device)  # 4 GiB of floats
    again.fill_(3.0)
    if _bounds(again) != (3.0, 3.0):
        problems.append("the 4 GiB tensor allocated afterwards does not hold what was written")
    check(not problems, "; ".join(problems))
    return f"OutOfMemoryError both times (after {ctx.figures['chunks_before_oom']} x 2 GiB); allocates again"


# --- 9. torch.multiprocessing --------------------------------------------------------------------------------


def mp_child(allocator, connection):
    """The child process of the multiprocessing case: chooses the same allocator, receives the CUDA tensor,
    writes 2 * t + 1 into it, and answers ("ok", info) or ("error", message)."""
    try:
        torch, _ = setup_allocator(allocator)
        t = connection.recv()
        t.mul_(2).add_(1)
        torch.cuda.synchronize()
        info = {"numel": t.numel()}
        del t
        connection.send(("ok", info))
    except Exception as e:  # noqa: BLE001 (sent to the parent)
        connection.send(("error", _first_line(e)))
    if connection.poll(60):
        connection.recv()


@case("multiprocessing", "a CUDA tensor sent to a spawned torch.multiprocessing child, which writes 2t+1 into "
      "it: the parent sees 2t+1", timeout=120)
def multiprocessing_case(ctx):
    import torch.multiprocessing as mp  # noqa: PLC0415

    torch = ctx.torch
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    process = spawn.Process(target=mp_child, args=(ctx.allocator, child), daemon=True)
    process.start()
    try:
        n = 4 * MIB
        t = torch.arange(n, dtype=torch.float32, device=ctx.device)
        torch.cuda.synchronize()
        parent.send(t)  # CUDA IPC: raises here if the memory cannot be shared
        if not parent.poll(90):
            raise CaseFailure("the child did not answer within 90 s" + ("" if process.is_alive() else
                                                                        f" (it exited with {process.exitcode})"))
        answer, info = parent.recv()
        if answer != "ok":
            raise RuntimeError(f"in the child: {info}")
        expected = torch.arange(n, dtype=torch.float32) * 2 + 1
        diff = _max_diff(torch, t, expected)
        ctx.figures.update(max_abs_diff=diff)
        check(diff == 0, f"the parent's tensor differs from the child's writes by up to {diff}")
        parent.send("done")
        process.join(30)
        return "the child's writes are seen"
    finally:
        if process.is_alive():
            process.terminate()
            process.join(10)


# --- 10. NCCL -----------------------------------------------------------------------------------------------


@case("nccl", "init_process_group('nccl', world_size=1, file:// store): all_reduce gives the input back; an "
      "async all_gather_into_tensor whose input is dropped and its memory overwritten before the collective "
      "ran still gathers the input", timeout=90)
def nccl(ctx):
    import datetime  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    torch = ctx.torch
    dist = torch.distributed
    if not dist.is_available() or not dist.is_nccl_available():
        raise SkipCase("PyTorch was built without NCCL")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # one rank, no network
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("nccl", init_method=f"file://{folder}/store", world_size=1, rank=0,
                                timeout=datetime.timedelta(seconds=60))
        try:
            n = 16 * MIB // 4
            t = torch.arange(n, dtype=torch.float32, device=ctx.device)
            dist.all_reduce(t)
            diff = _max_diff(torch, t, torch.arange(n, dtype=torch.float32))
            check(diff == 0, f"all_reduce over one rank changed the tensor (max diff {diff})")
            wrong = 0
            for trial in range(5):
                value = float(trial + 1)
                source = torch.full((n,), value, device=ctx.device)
                out = torch.empty(n, device=ctx.device)
                torch.cuda._sleep(SLEEP_CYCLES)  # the collective waits for it on NCCL's stream
                work = dist.all_gather_into_tensor(out, source, async_op=True)
                del source
                junk = torch.empty(n, device=ctx.device)
                junk.fill_(-1.0)
                work.wait()
                torch.cuda.synchronize()
                wrong += _bounds(out) != (value, value)
                del out, junk
            ctx.figures.update(async_trials=5, async_wrong=wrong)
            check(wrong == 0, f"{wrong}/5 async all_gathers gathered memory overwritten after their input was "
                  "dropped")
        finally:
            dist.destroy_process_group()
    return "all_reduce correct, 5 async all_gathers correct"


# --- 11. transformers ---------------------------------------------------------------------------------------


@case("transformers", "a tiny LlamaForCausalLM from a config trains 6 steps with varying sequence lengths on the "
      "GPU and, from the same weights, on the CPU: every loss finite and equal to the CPU's within 0.02, "
      "logits after training within 0.05; generate() returns new tokens", timeout=180, fresh=True)
def transformers_case(ctx):
    import copy  # noqa: PLC0415

    torch = ctx.torch
    try:
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415
    except ImportError as e:
        raise SkipCase(f"transformers is not importable ({e})") from e
    vocab = 512
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    cpu_model = LlamaForCausalLM(config).float()
    gpu_model = copy.deepcopy(cpu_model).to(ctx.device)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (cpu_model, gpu_model)]
    generator = torch.Generator().manual_seed(1)
    lengths, losses, bad = [17, 64, 33, 128, 49, 96], [], []
    for length in lengths:
        ids = torch.randint(3, vocab, (4, length), generator=generator)
        step = []
        for model, optimizer, device in zip((cpu_model, gpu_model), optimizers, ("cpu", ctx.device)):
            batch = ids.to(device)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step.append(loss.item())
        losses.append([round(v, 5) for v in step])
        if not all(v == v and abs(v) != float("inf") for v in step):
            bad.append(f"seq {length}: loss not finite {step}")
        elif abs(step[0] - step[1]) > 0.02:
            bad.append(f"seq {length}: loss {step[1]:.4f} on the GPU, {step[0]:.4f} on the CPU")
    ctx.figures.update(sequence_lengths=lengths, losses_cpu_gpu=losses)
    for model in (cpu_model, gpu_model):
        model.eval()
    prompt = torch.randint(3, vocab, (2, 8), generator=generator)
    with torch.no_grad():
        logits_diff = _max_diff(torch, gpu_model(input_ids=prompt.to(ctx.device)).logits,
                                cpu_model(input_ids=prompt).logits)
        generated = gpu_model.generate(prompt.to(ctx.device), attention_mask=torch.ones_like(prompt).to(ctx.device),
                                       max_new_tokens=16, do_sample=False, pad_token_id=0).cpu()
        on_cpu = cpu_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                                    do_sample=False, pad_token_id=0)
    ctx.figures.update(logits_max_abs_diff=logits_diff, generated_shape=list(generated.shape),
                       generate_same_as_cpu=bool(torch.equal(generated, on_cpu)))
    if logits_diff > 0.05:
        bad.append(f"logits differ from the CPU's by up to {logits_diff:.3g}")
    if generated.shape[0] != 2 or generated.shape[1] <= prompt.shape[1] or not torch.equal(generated[:, :8], prompt):
        bad.append(f"generate returned shape {list(generated.shape)} not continuing the prompt")
    elif not ((generated >= 0) & (generated < vocab)).all():
        bad.append("generate returned tokens outside the vocabulary")
    check(not bad, "; ".join(bad))
    return f"6 steps, losses match the CPU's, generate gave {generated.shape[1] - 8} tokens"


# --- 12. sleep and wake (cuvmm only; issue 33) ---------------------------------------------------------------

_OTHER_JOB = """
import sys, torch
t = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
t.fill_(7)
torch.cuda.synchronize()
print(int(t[-1].item()))
"""


@case("sleep_wake", "weights and a KV cache under cuvmm tags, a graph captured using them; sleep with contents "
      "kept raises cudaMemGetInfo's free memory by their bytes, another process allocates and fills that "
      "memory, wake, and the replay equals the output before the sleep; a kernel still running on the tags' "
      "stream at the sleep reads the right values", timeout=180, fresh=True, allocators=("cuvmm",))
def sleep_wake(ctx):
    torch, cuvmm, dev = ctx.torch, ctx.cuvmm, ctx.device
    if not hasattr(cuvmm, "region"):
        raise SkipCase("cuvmm_torch has no region/sleep/wake")
    n = 4096
    with cuvmm.region("weights"):
        w = torch.randn(n, n, device=dev)  # 64 MiB
    with cuvmm.region("kv_cache"):
        kv = torch.randn(16, n, n // 4, device=dev)  # 256 MiB
    x = torch.randn(n, n, device=dev)
    tagged = w.numel() * 4 + kv.numel() * 4

    def step():
        return (x @ w) + kv[:, :, :1].sum()

    _warm_up(torch, [step])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    graph.replay()
    torch.cuda.synchronize()
    before = y.clone()
    w_copy = w.clone()

    # A kernel still running on the tags' stream when they go to sleep: it must finish reading first.
    torch.cuda._sleep(SLEEP_CYCLES)
    z = w * 2
    free_before = torch.cuda.mem_get_info(0)[0]
    began = time.monotonic()
    released = cuvmm.sleep("weights", keep=True) + cuvmm.sleep("kv_cache", keep=True)
    sleep_s = time.monotonic() - began
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info(0)[0]
    gained = free_after - free_before
    ctx.figures.update(tagged_bytes=tagged, released_bytes=released, free_gain_bytes=gained, sleep_s=sleep_s)
    check(released >= tagged, f"sleep gave back {released} bytes of {tagged}")
    check(gained >= tagged * 9 // 10, f"free device memory rose by {gained} bytes, the tags hold {tagged}")

    other = subprocess.run([sys.executable, "-c", _OTHER_JOB, str(gained * 9 // 10)], capture_output=True,
                           text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if not k.startswith("CUVMM_")})
    check(other.returncode == 0 and other.stdout.strip() == "7",
          f"the other job could not use the memory: {other.stderr.strip()[-300:]}")

    began = time.monotonic()
    cuvmm.wake("weights")
    cuvmm.wake("kv_cache")
    ctx.figures.update(wake_s=time.monotonic() - began)
    check(torch.equal(w, w_copy), "the weights' contents did not survive the sleep")
    check(torch.equal(z, w_copy * 2), "a kernel running at the sleep read memory that was already gone")
    graph.replay()
    torch.cuda.synchronize()
    diff = _max_diff(torch, y, before)
    ctx.figures.update(replay_max_abs_diff=diff)
    check(diff <= TOLERANCE, f"the replay after wake differs from before the sleep by {diff:.3g}")
    return f"{released / MIB:.0f} MiB slept and woke, free memory +{gained / MIB:.0f} MiB, replay equal"
