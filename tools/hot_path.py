#!/usr/bin/env python3
"""Cached alloc+free pairs per second through PyTorch's allocator interface (issue 21, step 7).

    python3 tools/hot_path.py --allocator native        # PyTorch's default allocator
    python3 tools/hot_path.py --allocator expandable    # expandable_segments:True
    python3 tools/hot_path.py --allocator cuvmm         # cuvmm plugged in (python/cuvmm_torch/)

For each size, one allocation warms the cache, then ``--pairs`` pairs of
``torch.cuda.caching_allocator_alloc`` + ``caching_allocator_delete`` on the default stream are timed,
``--repetitions`` times; the median rate is reported. Every allocator is reached the same way (Python, then
PyTorch's C++ allocator interface, then the allocator), so the rates compare the allocators plus a common
overhead, which is measured too: the same loop calling two Python functions that do nothing
(``python_loop_pairs_per_second``). One JSON object is printed.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_replay import TorchAllocator  # noqa: E402

SIZES = [512, 64 << 10, 1 << 20, 20 << 20]


def rate(alloc, free, size, pairs):
    began = time.perf_counter()
    for _ in range(pairs):
        free(alloc(size))
    return pairs / (time.perf_counter() - began)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocator", choices=["native", "expandable", "cuvmm"], default="native")
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        allocator = TorchAllocator(args.allocator)
    except (ImportError, RuntimeError, OSError) as e:
        print(f"hot_path: cannot use the GPU: {e}", file=sys.stderr)
        return 2
    torch = allocator.torch
    stream = torch.cuda.current_stream(0)

    def alloc(size):
        return torch.cuda.caching_allocator_alloc(size, 0, stream)

    free = torch.cuda.caching_allocator_delete
    result = {"allocator": args.allocator, "device_name": torch.cuda.get_device_name(0),
              "torch_version": torch.__version__, "pairs": args.pairs, "sizes": {},
              "cuvmm_alloc_conf": os.environ.get("CUVMM_ALLOC_CONF", "")}
    for size in SIZES:
        free(alloc(size))  # the first pair may reach the driver; the timed ones find the block cached
        rates = [rate(alloc, free, size, args.pairs) for _ in range(args.repetitions)]
        result["sizes"][str(size)] = round(statistics.median(rates))

    def nothing(_):
        return 0

    result["python_loop_pairs_per_second"] = round(
        statistics.median(rate(nothing, nothing, 0, args.pairs) for _ in range(args.repetitions))
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
