"""Cases 18 and 19 (issue 43): idle pages stranded in 20 MiB handles that live tensors still touch, given back by
moving the live tensors' pages: once at a moment the program chooses (``cuvmm_torch.release_stranded()``), and
under a memory limit by ``compaction:split``. Both move bytes a kernel wrote just before, so each checks every
kept tensor's contents on the device afterwards. cuvmm only: PyTorch's allocators have no such operation."""

import os

from . import (  # the framework, in __init__.py
    MIB,
    SLEEP_CYCLES,
    _bounds,
    case,
    check,
    device_total_memory,
)

# Pairs of (18 MiB freed, 2 MiB kept): each 20 MiB handle keeps 18 MiB idle behind a 2 MiB tensor at its end.
PAIRS = 48
FREED, KEPT = 18 * MIB, 2 * MIB
# compaction:split's case: a limit that holds the pairs and a little more, so that a request of the freed
# bytes fits only once the stranded pages are given back.
SPLIT_LIMIT = PAIRS * (FREED + KEPT) + 256 * MIB


def _strand(ctx):
    """The pairs allocated in order and the freed ones freed; returns the kept tensors (tensor i holds i % 251)."""
    torch = ctx.torch
    kept, freed = [], []
    for i in range(PAIRS):
        freed.append(torch.empty(FREED, dtype=torch.uint8, device=ctx.device))
        kept.append(torch.full((KEPT,), i % 251, dtype=torch.uint8, device=ctx.device))
    torch.cuda.synchronize()
    del freed
    return kept


def _write_behind_sleep(ctx, kept):
    """Adds 1 to every kept tensor on a side stream behind a sleep: the kernels still run when the caller's
    next call starts, which must wait for them before it moves the pages."""
    torch = ctx.torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in kept:
            t.add_(1)
    for t in kept:
        t.record_stream(side)
    return side


def _check_kept(ctx, kept):
    damaged = [i for i, t in enumerate(kept) if _bounds(t) != ((i % 251) + 1,) * 2]
    ctx.figures["kept_damaged"] = len(damaged)
    check(not damaged, f"{len(damaged)}/{len(kept)} kept tensors lost the side stream's write "
          f"(first: {damaged[:3]})")


@case("release_stranded", f"{PAIRS} pairs of an 18 MiB tensor (freed) and a 2 MiB one (kept, written by a side "
      "stream's kernel still running): cuvmm_torch.release_stranded() gives back at least 80% of the freed "
      "bytes, reserved memory falls by what it says, every kept tensor holds the kernel's write, a tensor of "
      "the freed size is then allocated and used", timeout=90, fresh=True, allocators=("cuvmm",))
def release_stranded(ctx):
    torch = ctx.torch
    kept = _strand(ctx)
    ctx.empty_cache()  # whole idle handles go; the stranded ones stay
    _write_behind_sleep(ctx, kept)
    before = ctx.cuvmm.memory_stats(0)["reserved_bytes.all.current"]
    released = ctx.cuvmm.release_stranded(0)
    torch.cuda.synchronize()  # the checks below read on another stream than the one that wrote
    after = ctx.cuvmm.memory_stats(0)["reserved_bytes.all.current"]
    ctx.figures.update(released=released, reserved_before=before, reserved_after=after)
    check(released >= 0.8 * PAIRS * FREED, f"release_stranded gave back {released / MIB:.0f} MiB of "
          f"{PAIRS * FREED / MIB:.0f} MiB stranded")
    check(before - after == released, f"reserved fell by {(before - after) / MIB:.0f} MiB, release_stranded "
          f"said {released / MIB:.0f} MiB")
    _check_kept(ctx, kept)
    again = torch.full((PAIRS * FREED,), 7, dtype=torch.uint8, device=ctx.device)
    check(_bounds(again) == (7, 7), "the tensor allocated after it does not hold its fill")
    _check_kept(ctx, kept)
    check(ctx.cuvmm.release_stranded(0) >= 0, "a second call failed")
    return f"gave back {released / MIB:.0f} MiB; {PAIRS} kept tensors intact"


def _prepare_split(allocator):
    """compaction:split and a memory limit, read by cuvmm on first use."""
    if allocator == "cuvmm":
        fraction = SPLIT_LIMIT / device_total_memory()
        conf = os.environ.get("CUVMM_ALLOC_CONF", "")
        os.environ["CUVMM_ALLOC_CONF"] = ",".join(
            filter(None, [conf, "compaction:split", f"per_process_memory_fraction:{fraction!r}"]))


@case("split_under_limit", f"under compaction:split and a limit of {SPLIT_LIMIT // MIB} MiB, {PAIRS} pairs of an "
      "18 MiB tensor (freed) and a 2 MiB one (kept, written by a side stream's kernel still running), then a "
      "request of the freed bytes: it is served (the stranded handles split), every kept tensor holds the "
      "kernel's write, reserved stays within the limit", timeout=90, fresh=True, prepare=_prepare_split,
      allocators=("cuvmm",))
def split_under_limit(ctx):
    torch = ctx.torch
    kept = _strand(ctx)
    _write_behind_sleep(ctx, kept)
    big = torch.full((PAIRS * FREED,), 7, dtype=torch.uint8, device=ctx.device)
    torch.cuda.synchronize()  # the checks below read on another stream than the one that wrote
    stats = ctx.cuvmm.memory_stats(0)
    ctx.figures.update(reserved=stats["reserved_bytes.all.current"], peak=stats["reserved_bytes.all.peak"],
                       limit=SPLIT_LIMIT)
    check(_bounds(big) == (7, 7), "the request served by the split does not hold its fill")
    _check_kept(ctx, kept)
    check(stats["reserved_bytes.all.peak"] <= SPLIT_LIMIT, f"reserved peaked at "
          f"{stats['reserved_bytes.all.peak'] / MIB:.0f} MiB over the limit of {SPLIT_LIMIT / MIB:.0f} MiB")
    return f"served {PAIRS * FREED / MIB:.0f} MiB under {SPLIT_LIMIT / MIB:.0f} MiB; {PAIRS} kept tensors intact"
