"""Cases 1 and 2: ``record_stream`` with a long kernel on a side stream, and a memory limit."""

import os

from . import (  # the framework, in __init__.py
    GIB,
    MIB,
    SLEEP_CYCLES,
    SkipCase,
    _bounds,
    _first_line,
    case,
    check,
    device_total_memory,
)


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
        ctx.cuvmm.set_memory_fraction(fraction, 0)  # the same limit again, through cuvmm's own call
        limits.append("cuvmm_torch.set_memory_fraction")
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
