#!/usr/bin/env python3
"""Trains a small GPT with variable sequence lengths under one CUDA allocator (issue 21, step 6).

    python3 tools/train_gpt.py --allocator native              # PyTorch's default allocator
    python3 tools/train_gpt.py --allocator expandable          # expandable_segments:True
    python3 tools/train_gpt.py --allocator cuvmm               # cuvmm plugged in (python/cuvmm_torch/)
    python3 tools/train_gpt.py --allocator cuvmm --fraction 0.1
    python3 tools/train_gpt.py --allocator native --search     # the smallest fraction at which it completes

A decoder-only transformer (``--layers``, ``--width``, ``--vocab``) trains with AdamW under bf16 autocast on
random tokens; each step's sequence length is drawn from ``--min-seq``..``--max-seq`` (multiples of 64, the
same draws for every allocator: ``--seed``), which is what makes the caching allocators' free blocks the wrong
size for the next step. One JSON object is printed: steps completed, the error that stopped it (out of
memory), max reserved and max allocated bytes, and the median step time (each step ends with a
synchronization).

``--fraction F`` limits the memory the allocator may hold to F of the device's: for PyTorch's own
allocators ``torch.cuda.set_per_process_memory_fraction(F)`` (an allocation fails when reserved memory would
pass F of the total); for cuvmm, which never hears of that call (PyTorch installs no memory-fraction hook for a
pluggable allocator), the same rule through ``per_process_memory_fraction:F`` in ``CUVMM_ALLOC_CONF``.
``--ballast`` limits any of them another way: before the training starts, a ``cuMemAlloc`` takes what is free
beyond F of the total, which is stricter than the fraction by whatever CUDA itself takes afterwards (cuBLAS,
kernels). ``--search`` runs the training in child processes, bisecting F to within ``--resolution``, and
prints the smallest F that completed with the figures of that run.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sequence_lengths(steps, low, high, seed):
    """The sequence length of each step: multiples of 64 in [low, high], from a fixed generator."""
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    choices = list(range(max(64, low // 64 * 64), high + 1, 64))
    return [rng.choice(choices) for _ in range(steps)]


def set_up(allocator, fraction, use_ballast=False):
    """Chooses the allocator before PyTorch touches the GPU; returns torch and a peaks() function."""
    if allocator == "expandable":
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
    ballast = None
    if use_ballast and fraction is not None and fraction < 1:
        ballast = take_ballast(fraction)
    if allocator == "cuvmm" and fraction is not None and not use_ballast:
        conf = os.environ.get("CUVMM_ALLOC_CONF", "")
        os.environ["CUVMM_ALLOC_CONF"] = ",".join(filter(None, [conf, f"per_process_memory_fraction:{fraction}"]))
    import torch  # noqa: PLC0415

    if allocator == "cuvmm":
        sys.path.insert(0, os.path.join(ROOT, "python"))
        import cuvmm_torch  # noqa: PLC0415

        cuvmm_torch.install()

        def peaks():
            stats = cuvmm_torch.memory_stats(0)
            return stats["reserved_bytes.all.peak"], stats["allocated_bytes.all.peak"]

    else:
        if fraction is not None and not use_ballast:
            torch.cuda.set_per_process_memory_fraction(fraction, 0)

        def peaks():
            return torch.cuda.max_memory_reserved(0), torch.cuda.max_memory_allocated(0)

    return torch, peaks, ballast


def take_ballast(fraction, device=0):
    """Allocates, with the driver's cuMemAlloc in the device's primary context (PyTorch's), what is free
    beyond `fraction` of the device's total memory; returns the bytes taken."""
    import ctypes  # noqa: PLC0415

    cuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total, ptr = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_uint64()
    for name, call in [
        ("cuInit", lambda: cuda.cuInit(0)),
        ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), device)),
        ("cuDevicePrimaryCtxRetain", lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
        ("cuCtxSetCurrent", lambda: cuda.cuCtxSetCurrent(ctx)),
        ("cuMemGetInfo", lambda: cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))),
    ]:
        if (status := call()) != 0:
            raise RuntimeError(f"{name} failed with CUDA error {status}")
    size = free.value - int(fraction * total.value)
    if size <= 0:
        return 0
    if (status := cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))) != 0:
        raise RuntimeError(f"cuMemAlloc of the {size}-byte ballast failed with CUDA error {status}")
    return size


def build_model(torch, vocab, width, layers, heads, max_seq):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, width))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(max_seq, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    return GPT()


def train(args):
    """One training run in this process; returns the JSON-able result."""
    torch, peaks, ballast = set_up(args.allocator, args.fraction, args.ballast)
    if not torch.cuda.is_available():
        raise RuntimeError("PyTorch sees no CUDA device")
    torch.manual_seed(args.seed)
    lengths = sequence_lengths(args.steps, args.min_seq, args.max_seq, args.seed)
    result = {
        "allocator": args.allocator,
        "fraction": args.fraction,
        "ballast_bytes": ballast,
        "steps": args.steps,
        "device_name": torch.cuda.get_device_name(0),
        "total_bytes": torch.cuda.get_device_properties(0).total_memory,
        "torch_version": torch.__version__,
        "model": {"vocab": args.vocab, "width": args.width, "layers": args.layers, "batch": args.batch,
                  "seq": [args.min_seq, args.max_seq]},
    }
    times, completed, error = [], 0, None
    try:
        model = build_model(torch, args.vocab, args.width, args.layers, args.heads, args.max_seq).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        for length in lengths:
            began = time.perf_counter()
            tokens = torch.randint(0, args.vocab, (args.batch, length + 1), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
            completed += 1
    except RuntimeError as e:
        # PyTorch's own allocators raise OutOfMemoryError (a RuntimeError). A pluggable allocator can only
        # return a null pointer, which PyTorch does not check: the first kernel to touch it fails instead.
        error = " ".join(str(e).split())[:300]
    result.update(
        completed=completed,
        error=error,
        max_reserved_bytes=peaks()[0],
        max_allocated_bytes=peaks()[1],
        # The first steps pay for kernel selection and warm-up: the median is over the rest.
        median_step_ms=round(statistics.median(times[5:] or times or [math.nan]) * 1e3, 3),
        total_seconds=round(sum(times), 3),
    )
    return result


def child(args, fraction):
    """One run in a child process with `fraction`; its result, or None if it printed none."""
    command = [sys.executable, os.path.abspath(__file__), "--allocator", args.allocator, "--fraction", str(fraction)]
    command += ["--ballast"] if args.ballast else []
    for name in ("steps", "seed", "vocab", "width", "layers", "heads", "batch", "min_seq", "max_seq"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    try:
        return json.loads(run.stdout)
    except json.JSONDecodeError:
        print(f"train_gpt: fraction {fraction}: status {run.returncode}: {run.stderr[-500:]}", file=sys.stderr)
        return None


def search(args):
    """Bisects the smallest fraction at which the whole run completes, between what the unconstrained run
    allocated at its peak (no allocator can complete below it) and what it reserved."""
    full = child(args, 1.0)
    limit = "ballast" if args.ballast else {"cuvmm": "per_process_memory_fraction"}.get(
        args.allocator, "set_per_process_memory_fraction"
    )
    result = {"allocator": args.allocator, "limit": limit, "resolution": args.resolution, "at_1.0": full}
    if full is None or full["error"] or full["completed"] != args.steps:
        return {**result, "smallest_fraction": None, "tried": [[1.0, False]]}
    total = full["total_bytes"]
    low = round(full["max_allocated_bytes"] / total * 0.98, 4)
    high, best, tried = 1.0, full, [[1.0, True]]

    def completes(fraction):
        run = child(args, fraction)
        ok = run is not None and run["error"] is None and run["completed"] == args.steps
        tried.append([fraction, ok] + ([] if ok or run is None else [run["error"]]))
        return ok, run

    # The first guess: a little above what the unconstrained run reserved.
    guess = round(min(1.0, full["max_reserved_bytes"] / total * 1.02 + args.resolution), 4)
    ok, run = completes(guess)
    if ok:
        high, best = guess, run
    else:
        low = guess
    while high - low > args.resolution:
        mid = round((low + high) / 2, 4)
        ok, run = completes(mid)
        if ok:
            high, best = mid, run
        else:
            low = mid
    return {**result, "smallest_fraction": high, "tried": tried, "at_smallest": best}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocator", choices=["native", "expandable", "cuvmm"], default="native")
    parser.add_argument("--fraction", type=float, help="the fraction of device memory the allocator may hold")
    parser.add_argument("--search", action="store_true", help="bisect the smallest fraction that completes")
    parser.add_argument("--ballast", action="store_true",
                        help="limit the memory with a ballast allocation rather than the allocator's fraction")
    parser.add_argument("--resolution", type=float, default=0.002, help="the search's resolution (default 0.002)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--min-seq", type=int, default=64)
    parser.add_argument("--max-seq", type=int, default=1024)
    args = parser.parse_args(argv)
    if args.fraction is not None and not 0 < args.fraction <= 1:
        parser.error("--fraction must be in (0, 1]")
    if args.steps < 1 or args.min_seq > args.max_seq or args.max_seq < 64 or args.width % args.heads:
        parser.error("need --steps >= 1, 64 <= --max-seq, --min-seq <= --max-seq and --heads dividing --width")
    if args.search:
        print(json.dumps(search(args), indent=2))
        return 0
    try:
        result = train(args)
    except (ImportError, RuntimeError, OSError) as e:
        print(f"train_gpt: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
