#!/usr/bin/env python3
"""How often HF transformers' own bf16 DeepseekV4ForCausalLM picks the fp32 model's greedy token, on one model
directory: the yardstick for issue 8's "top-1 agreement ≥ 99 % over 1k greedy steps" (docs/PERF.md "Greedy
top-1"). Both models hold the same weights (write them as bf16, `dsv4 init-random --dtype bf16`, so that the fp32
model is the same model), both are fed the fp32 model's greedy tokens (teacher forcing, as
tests/model/cuda/deepseek_v4_cuda_test.cpp's expect_greedy_top1 does), and every step recomputes the whole
sequence without a cache.

    python3 tools/reference/hf_bf16_agreement.py MODEL_DIR [--requests 4] [--prompt 32] [--steps 250]
"""
from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=250)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    exact = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).cuda().eval()
    bf16 = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).cuda().eval()
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(2, exact.config.vocab_size, (args.requests, args.prompt), device="cuda", generator=gen)
    agreed = compared = 0
    with torch.inference_mode():
        for _ in range(args.steps):
            expected = exact(ids).logits[:, -1].float()
            # HF keeps the mHC mixes in fp32 and feeds their output to bf16 linears: autocast casts at those seams
            # (as tools/reference/hf_speed.py runs it).
            with torch.autocast("cuda", dtype=torch.bfloat16):
                actual = bf16(ids).logits[:, -1].float()
            nxt = expected.argmax(-1)
            agreed += int((actual.argmax(-1) == nxt).sum())
            compared += args.requests
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    print(f"HF bf16 vs HF fp32, greedy top-1: {agreed} of {compared} steps agreed ({100.0 * agreed / compared:.2f} %)")


if __name__ == "__main__":
    main()
