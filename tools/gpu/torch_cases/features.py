"""Cases 7 to 10: ``torch.cuda.memory_stats``, ``torch.OutOfMemoryError``, ``torch.multiprocessing`` and
NCCL; then cuDNN's benchmark mode, which sizes its workspaces by what the allocator says it has free, and
caching turned off (`caching_allocator_enable(False)`)."""

import os
from multiprocessing.connection import wait

from . import (  # the framework, in __init__.py
    CaseFailure,
    GIB,
    MIB,
    SLEEP_CYCLES,
    SkipCase,
    _bounds,
    _first_line,
    _max_diff,
    case,
    check,
    setup_allocator,
)


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
    """The child process of the multiprocessing case: chooses the same allocator, receives CUDA tensors,
    writes 2 * t + 1 into each, and answers ("ok", info) or ("error", message)."""
    try:
        torch, _ = setup_allocator(allocator)
        tensors = connection.recv()
        for t in tensors:
            t.mul_(2).add_(1)
        torch.cuda.synchronize()
        info = {"numel": [t.numel() for t in tensors]}
        del t, tensors
        connection.send(("ok", info))
    except Exception as e:  # noqa: BLE001 (sent to the parent)
        connection.send(("error", _first_line(e)))
    if connection.poll(60):
        connection.recv()


def ramp(torch, n):
    """0, 1, 2, ... as n float32 on the CPU, wrapping at 65536: t and 2t+1 stay exact in float32, which rounds
    odd integers above 2**24 (and the CPU's arange rounds them as its thread count has it)."""
    return (torch.arange(n, dtype=torch.int64) % 65536).float()


def mp_answer(process, connection, seconds):
    """The child's answer, or (None, why) if it exits without one or is silent `seconds`: the parent has closed
    its end of the child's pipe, so the child's exit shows at once."""
    if connection in wait([connection, process.sentinel], seconds) or connection.poll(1):
        try:
            return connection.recv()
        except EOFError:
            pass
    process.join(5)
    if process.is_alive():
        return None, f"the child did not answer within {seconds} s"
    return None, f"the child exited with {process.exitcode} without answering"


@case("multiprocessing", "CUDA tensors sent to a spawned torch.multiprocessing child, which writes 2t+1 into "
      "each: a 16 MiB one, a small one that shares its page with a neighbour, a 100 MiB one over several "
      "handles and a view with a storage offset; the parent sees 2t+1 in each and its neighbour unchanged",
      timeout=120)
def multiprocessing_case(ctx):
    import torch.multiprocessing as mp  # noqa: PLC0415

    torch = ctx.torch
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    process = spawn.Process(target=mp_child, args=(ctx.allocator, child), daemon=True)
    process.start()
    child.close()
    try:
        sizes = [4 * MIB, 1000, 25 * MIB]
        tensors = [ramp(torch, n).to(ctx.device) for n in sizes[:1]]
        neighbour = torch.full((1000,), 7.0, device=ctx.device)  # the small one's page-mate
        tensors.append(ramp(torch, sizes[1]).to(ctx.device))
        tensors.append(ramp(torch, sizes[2]).to(ctx.device))
        base = torch.zeros(2000, dtype=torch.float32, device=ctx.device)
        view = base[1000:]
        view.copy_(ramp(torch, 1000))
        tensors.append(view)
        torch.cuda.synchronize()
        parent.send(tensors)  # CUDA IPC: raises here if the memory cannot be shared
        answer, info = mp_answer(process, parent, 90)
        if answer is None:
            raise CaseFailure(info)
        if answer != "ok":
            raise RuntimeError(f"in the child: {info}")
        diffs = [_max_diff(torch, t, ramp(torch, t.numel()) * 2 + 1) for t in tensors]
        neighbour_diff = _max_diff(torch, neighbour, torch.full((1000,), 7.0))
        head_diff = _max_diff(torch, base[:1000], torch.zeros(1000))
        ctx.figures.update(max_abs_diff=max(diffs), neighbour_diff=neighbour_diff, view_head_diff=head_diff)
        check(max(diffs) == 0, f"the parent's tensors differ from the child's writes by up to {diffs}")
        check(neighbour_diff == 0 and head_diff == 0, "the child's writes reached memory outside its tensors")
        parent.send("done")
        process.join(30)
        return "the child's writes are seen, and only where it wrote"
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


# --- cuDNN's benchmark mode -----------------------------------------------------------------------------------


@case("cudnn_benchmark", "torch.backends.cudnn.benchmark: a 3x3 convolution's forward and backward, its algorithms "
      "tried with the workspace the allocator says it can give (cacheInfo), equal to the same steps without "
      "benchmark within 1e-3 relative (TF32 off); figures: the extra peak while choosing, ms per step each way",
      timeout=120, fresh=True)
def cudnn_benchmark(ctx):
    import time  # noqa: PLC0415

    torch = ctx.torch
    if not torch.backends.cudnn.is_available():
        raise SkipCase("PyTorch has no cuDNN")
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).to(ctx.device)
    x = torch.randn(32, 64, 56, 56, device=ctx.device, requires_grad=True)

    def step():
        x.grad = None
        conv.zero_grad(set_to_none=True)
        y = conv(x)
        y.square().mean().backward()
        torch.cuda.synchronize()
        return y.detach(), x.grad.detach(), conv.weight.grad.detach()

    def peak_of(benchmark):
        torch.backends.cudnn.benchmark = benchmark
        torch.cuda.synchronize()
        live = torch.cuda.memory_allocated(0)
        torch.cuda.reset_peak_memory_stats(0)
        results = step()
        return results, torch.cuda.max_memory_allocated(0) - live

    def ms_per_step(benchmark, steps=10):
        torch.backends.cudnn.benchmark = benchmark
        step()
        began = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - began) / steps * 1e3

    reference, reference_peak = peak_of(False)
    got, chosen_peak = peak_of(True)  # the first benchmarked call tries each algorithm with its workspace
    worst = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) for a, b in zip(got, reference))
    ctx.figures.update(peak_without_benchmark=reference_peak, peak_choosing=chosen_peak,
                       extra_peak_choosing=chosen_peak - reference_peak, max_rel_diff=worst,
                       ms_without_benchmark=ms_per_step(False), ms_with_benchmark=ms_per_step(True))
    check(worst <= 1e-3, f"benchmarked results differ from the default algorithms' by {worst:.2e} relative")
    return (f"equal within {worst:.1e}; {ctx.figures['ms_with_benchmark']:.2f} ms per step benchmarked, "
            f"{ctx.figures['ms_without_benchmark']:.2f} without; {(chosen_peak - reference_peak) // MIB} MiB more "
            "at the peak while choosing")


# --- caching turned off ---------------------------------------------------------------------------------------


@case("caching_allocator_off", "torch.cuda.caching_allocator_enable(False): a tensor allocated while caching is off "
      "holds its values, is in no statistic (memory_allocated unchanged) and its memory goes back to the device "
      "when it is freed (mem_get_info); caching on again, a tensor is counted",
      timeout=60, fresh=True)
def caching_allocator_off(ctx):
    torch = ctx.torch
    size = 256 * MIB
    elements = size // 4
    anchor = torch.zeros(1, device=ctx.device)  # noqa: F841 (CUDA initialized: caching_allocator_enable acts)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(0)
    torch.cuda.memory.caching_allocator_enable(False)
    try:
        x = torch.ones(elements, dtype=torch.float32, device=ctx.device)
        allocated_off = torch.cuda.memory_allocated(0)
        total = x.sum().item()
        free_holding = torch.cuda.mem_get_info(0)[0]
        del x
        torch.cuda.synchronize()
        free_released = torch.cuda.mem_get_info(0)[0]
    finally:
        torch.cuda.memory.caching_allocator_enable(True)
    y = torch.ones(elements, dtype=torch.float32, device=ctx.device)
    allocated_on = torch.cuda.memory_allocated(0)
    del y
    ctx.figures.update(allocated_off_delta=allocated_off - before, allocated_on_delta=allocated_on - before,
                       given_back_at_free=free_released - free_holding, sum=total)
    check(total == elements, f"the tensor allocated with caching off sums to {total}, not {elements}")
    check(allocated_off == before, f"memory_allocated grew by {allocated_off - before} with caching off")
    check(free_released - free_holding >= size * 9 // 10,
          f"freeing it gave {(free_released - free_holding) // MIB} MiB back to the device, not {size // MIB}")
    check(allocated_on - before == size, f"caching on again: memory_allocated grew by {allocated_on - before}")
    return f"uncounted and given back at free ({(free_released - free_holding) // MIB} MiB); counted once on again"
