"""A small `transformers` training script that knows nothing of cuvmm: the GPU step `wheel` (tools/gpu/run.sh)
runs it unchanged under ``python -m cuvmm_torch`` from the installed wheel, and under PyTorch's own allocator
for reference.

A LlamaForCausalLM built from a config (nothing downloaded) trains with AdamW on random tokens, in batches of
varying sequence length, on the device of its rank (``LOCAL_RANK`` under torchrun, else the current one). At
the end it prints one JSON line (also written to ``--report FILE``) with what PyTorch says of its memory: the
allocator backend (``torch.cuda.memory.get_allocator_backend()``), figures of ``torch.cuda.memory_stats()``,
and the segments of ``torch.cuda.memory._snapshot()`` (how many, and how many expandable: cuvmm's are).

    python tools/gpu/train_transformers.py [--steps 20] [--report FILE]
    python -m cuvmm_torch tools/gpu/train_transformers.py [--steps 20] [--report FILE]
"""

import argparse
import json
import math
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

STATS = ["allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
         "reserved_bytes.all.peak", "active_bytes.all.peak", "segment.all.current", "num_alloc_retries", "num_ooms",
         "num_device_alloc", "num_device_free"]
LENGTHS = [128, 384, 256, 512, 192, 448]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--report", help="also write the JSON line to this file")
    args = parser.parse_args()

    rank = os.environ.get("LOCAL_RANK")
    index = int(rank) % torch.cuda.device_count() if rank is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    losses, began = [], time.perf_counter()
    for step in range(args.steps):
        length = LENGTHS[step % len(LENGTHS)]
        ids = torch.randint(3, config.vocab_size, (args.batch, length), device=device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 5))
        print(f"step {step}: sequence length {length}, loss {losses[-1]:.4f}", flush=True)
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    segments = [s for s in torch.cuda.memory._snapshot()["segments"] if s["device"] == index]
    report = {
        "backend": torch.cuda.memory.get_allocator_backend(),
        "rank": rank,
        "device": index,
        "torch": torch.__version__,
        "steps": args.steps,
        "seconds": round(time.perf_counter() - began, 3),
        "losses": losses,
        "losses_finite": all(math.isfinite(v) for v in losses),
        "memory_stats": {key: stats.get(key) for key in STATS},
        "max_memory_reserved": torch.cuda.max_memory_reserved(device),
        "segments": len(segments),
        "expandable_segments": sum(1 for s in segments if s.get("is_expandable")),
    }
    line = json.dumps(report)
    print(line, flush=True)
    if args.report:
        with open(args.report, "w") as file:
            file.write(line + "\n")


if __name__ == "__main__":
    main()
