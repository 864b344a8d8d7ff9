#!/usr/bin/env python3
"""What a stream synchronization costs the host with work queued (issue 21, step 3), through PyTorch.

    python3 tools/gpu/sync_cost.py

Queues 0, 1, 10 and 100 bf16 8192x8192 matrix products on the current stream between two timing events,
then synchronizes the stream, seven times each; prints the medians of the time to queue them, the time the
synchronization blocked, the GPU time between the events, and how far the synchronization's wait exceeds the
work still queued when it began (GPU time minus queueing time).
"""

import statistics
import time

import torch


def main():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = a @ a
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    for n in (0, 1, 10, 100):
        rows = []
        for _ in range(7):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(n):
                b = a @ a
            end.record()
            t1 = time.perf_counter()
            stream.synchronize()
            t2 = time.perf_counter()
            rows.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, start.elapsed_time(end)))
        queued, waited, gpu = (statistics.median(row[i] for row in rows) for i in range(3))
        print(f"matmuls {n}: queueing {queued:.3f} ms, stream synchronize {waited:.3f} ms, GPU time {gpu:.3f} ms, "
              f"sync minus (GPU - queueing) {waited - (gpu - queued):.3f} ms")
    del b
    print(torch.cuda.get_device_name(0))


if __name__ == "__main__":
    main()
