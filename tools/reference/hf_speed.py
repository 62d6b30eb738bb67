#!/usr/bin/env python3
"""HF transformers' DeepseekV4ForCausalLM speed on one model directory, the peer of `dsv4 bench latency`
(docs/PERF.md "Whole model on the H200"): bf16 on the GPU, greedy generate with HF's own cache.

    python3 tools/reference/hf_speed.py MODEL_DIR [--context 1024] [--steps 32] [--batches 1,8]
        [--prefill 4096,8192] [--json OUT.json]

Decode ms/step = (time of generate(new=1+steps) - time of generate(new=1)) / steps, so the prefill and the
first token cancel out; prefill tokens/s = prompt tokens / time of one forward without cache (the fastest of three). A prefill that
runs out of memory is reported as "OOM" (HF's eager attention materialises [heads, T, T] scores).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prefill", default="4096,8192")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    load_s, model = timed(lambda: AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).cuda().eval())
    vocab = model.config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    print(f"HF {type(model).__name__}: {params / 1e9:.2f}B params, loaded in {load_s:.1f} s")
    results = {"params": params, "decode_ms": {}, "prefill_tokens_per_s": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    # HF keeps the mHC mixes in fp32 and feeds their output to bf16 linears: autocast casts at those seams.
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        for batch in [int(b) for b in args.batches.split(",")]:
            ids = torch.randint(2, vocab, (batch, args.context), device="cuda", generator=gen)
            kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
            first_s, _ = timed(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs))
            total_s, _ = timed(lambda: model.generate(ids, max_new_tokens=1 + args.steps, min_new_tokens=1 + args.steps,
                                                      **kwargs))
            step_ms = (total_s - first_s) / args.steps * 1e3
            results["decode_ms"][batch] = step_ms
            print(f"decode batch {batch}, context {args.context}: {step_ms:.2f} ms/step")
        for tokens in [int(t) for t in args.prefill.split(",")]:
            ids = torch.randint(2, vocab, (1, tokens), device="cuda", generator=gen)
            try:
                model(ids[:, :256], use_cache=False)
                # Three timed runs (the first also warms the allocator at this size); the fastest is reported.
                runs = [timed(lambda: model(ids, use_cache=False, logits_to_keep=1))[0] for _ in range(3)]
                seconds = min(runs)
                results["prefill_tokens_per_s"][tokens] = tokens / seconds
                print(f"prefill {tokens} tokens: {seconds * 1e3:.1f} ms, {tokens / seconds:.0f} tokens/s "
                      f"(runs {', '.join(f'{r * 1e3:.1f}' for r in runs)} ms)")
            except torch.cuda.OutOfMemoryError:
                results["prefill_tokens_per_s"][tokens] = "OOM"
                print(f"prefill {tokens} tokens: OOM")
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
