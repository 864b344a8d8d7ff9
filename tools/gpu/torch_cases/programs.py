"""Cases 11 and 12: a ``transformers`` model training and generating, and sleep and wake."""

import os
import subprocess
import sys
import time

from . import (  # the framework, in __init__.py
    MIB,
    SLEEP_CYCLES,
    SkipCase,
    _max_diff,
    _warm_up,
    TOLERANCE,
    case,
    check,
)


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
