#!/usr/bin/env python3
"""DeepSeek's own inference code as a numerical oracle for `dsv4 --numerics deepseek` (docs/numerics.md).

Loads the official `inference/model.py` from --model-py (a folder; not committed: copy it from the official
repository, model_spec.md §0, into the git-ignored .devcarry/ref/), satisfies its `kernel` import with our
pure-torch tools/reference/kernel_standin.py, builds a tiny random checkpoint the way the released ones are stored
(FP8 e4m3 linears with 128x128 UE8M0 scales, MXFP4 routed experts with 1x32 UE8M0 scales, wo_a bf16 as convert.py
writes it, bf16 norms/embeddings/compressor, fp32 mHC/sinks/ape/router bias, int32 hash table), runs the reference
forward and writes one golden set per directory:
  config.json (HF form, read by our loader), model.safetensors (official tensor names), golden.json (ids),
  logits.npy (float32 [1, vocab]: last-position logits of one prefill), logits_decode.npy (prefill of the first
  `decode_from` tokens, then one token per step: the reference's decode path, last step's logits).
Usage: deepseek_reference.py --model-py .devcarry/ref --out OUT [--device cuda] [--config-only]
"""
import argparse
import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# The tiny configuration: every layer kind (CSA with a hash-routed MoE, HCA with a small ratio standing in for
# 128, SWA), hc 4, real FP8 / FP4 block shapes (dims multiples of 128 so every activation block is full).
TINY = dict(vocab=256, dim=128, layers=3, ratios=[4, 8, 0], hash_layers=1, heads=2, head_dim=128, rope_dim=64,
            q_lora=128, o_groups=2, o_lora=64, window=8, experts=4, top_k=2, inter=128, index_heads=2,
            index_head_dim=128, index_topk=3, route_scale=1.5, swiglu_limit=10.0, rope_theta=10000.0,
            compress_rope_theta=160000.0, original_seq_len=16, rope_factor=4.0, seq=40, decode_from=24)


def hf_config(t):
    """The same model as an HF config.json for our loader (model_config.h): ratio 0/4/128 picks the layer type,
    compress_rate_hca the HCA rate."""
    hca = [r for r in t["ratios"] if r not in (0, 4)]
    return {
        "model_type": "deepseek_v4", "vocab_size": t["vocab"], "hidden_size": t["dim"],
        "num_hidden_layers": t["layers"], "num_attention_heads": t["heads"], "head_dim": t["head_dim"],
        "qk_rope_head_dim": t["rope_dim"], "q_lora_rank": t["q_lora"], "o_groups": t["o_groups"],
        "o_lora_rank": t["o_lora"], "sliding_window": t["window"],
        "compress_ratios": [128 if r not in (0, 4) else r for r in t["ratios"]],
        "compress_rate_csa": 4, "compress_rate_hca": hca[0] if hca else 128,
        "num_hash_layers": t["hash_layers"], "n_routed_experts": t["experts"], "num_experts_per_tok": t["top_k"],
        "moe_intermediate_size": t["inter"], "index_n_heads": t["index_heads"], "index_head_dim": t["index_head_dim"],
        "index_topk": t["index_topk"], "routed_scaling_factor": t["route_scale"], "swiglu_limit": t["swiglu_limit"],
        "rope_theta": t["rope_theta"], "compress_rope_theta": t["compress_rope_theta"],
        "rope_scaling": {"type": "yarn", "factor": t["rope_factor"],
                         "original_max_position_embeddings": t["original_seq_len"], "beta_fast": 32, "beta_slow": 1},
        "scoring_func": "sqrtsoftplus", "hc_mult": 4, "hc_sinkhorn_iters": 20, "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 0,
    }


def write_npy(path, values, shape):
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (%s), }" % "".join(f"{s}, " for s in shape)
    header = header.ljust(((len(header) + 11) // 64 + 1) * 64 - 11) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack(f"<{len(values)}f", *values))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-py", required=True, help="folder holding the official inference/model.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="write config.json only (no torch needed)")
    args = ap.parse_args()
    t = TINY
    out = os.path.join(args.out, "tiny_fp8_fp4")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(t), f, indent=2)
    if args.config_only:
        return

    import torch
    import kernel_standin
    sys.modules["kernel"] = kernel_standin  # model.py does `from kernel import ...`
    sys.path.insert(0, os.path.abspath(args.model_py))
    import model as ref

    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device(args.device)
    margs = ref.ModelArgs(
        max_batch_size=1, max_seq_len=64, dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4", scale_dtype="fp8",
        vocab_size=t["vocab"], dim=t["dim"], moe_inter_dim=t["inter"], n_layers=t["layers"],
        n_hash_layers=t["hash_layers"], n_mtp_layers=0, n_heads=t["heads"], n_routed_experts=t["experts"],
        n_shared_experts=1, n_activated_experts=t["top_k"], score_func="sqrtsoftplus", route_scale=t["route_scale"],
        swiglu_limit=t["swiglu_limit"], q_lora_rank=t["q_lora"], head_dim=t["head_dim"], rope_head_dim=t["rope_dim"],
        o_groups=t["o_groups"], o_lora_rank=t["o_lora"], window_size=t["window"], compress_ratios=tuple(t["ratios"]),
        compress_rope_theta=t["compress_rope_theta"], original_seq_len=t["original_seq_len"],
        rope_theta=t["rope_theta"], rope_factor=t["rope_factor"], index_n_heads=t["index_heads"],
        index_head_dim=t["index_head_dim"], index_topk=t["index_topk"], hc_mult=4, hc_sinkhorn_iters=20)
    model = ref.Transformer(margs)

    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float32, device="cpu")
    fp4_table = torch.tensor(kernel_standin.FP4_VALUES[:8], device="cpu")

    def fp8_weight(shape):
        w = randn(*shape) / shape[1] ** 0.5
        blocks = w.unflatten(1, (-1, 128)).unflatten(0, (-1, 128))  # [ob,128,ib,128]
        amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-4)
        scale = kernel_standin._pow2_ceil(amax / 448.0)  # [ob, ib]
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)

    def fp4_weight(shape):
        w = randn(*shape) / shape[1] ** 0.5
        amax = w.unflatten(1, (-1, 32)).abs().amax(-1).clamp(min=6 * 2.0 ** -126)
        scale = kernel_standin._pow2_ceil(amax / 6.0)  # [out, in/32]
        v = kernel_standin._e2m1_round((w / scale.repeat_interleave(32, 1)).clamp(-6, 6))
        code = (v.abs().unsqueeze(-1) == fp4_table).float().argmax(-1) + 8 * (v < 0).long()
        packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
        return packed, scale.to(torch.float8_e8m0fnu)

    tensors = {}  # official name -> (safetensors dtype, cpu tensor)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith(".scale") and name[:-6] + ".weight" in params and p.dtype == torch.float8_e8m0fnu:
            continue  # produced with its weight
        shape = tuple(p.shape)
        if p.dtype == torch.float8_e4m3fn:
            q, s = fp8_weight(shape)
            tensors[name] = ("F8_E4M3", q)
            tensors[name[:-7] + ".scale"] = ("F8_E8M0", s)
        elif p.dtype == torch.float4_e2m1fn_x2:
            q, s = fp4_weight((shape[0], shape[1] * 2))
            tensors[name] = ("I8", q)
            tensors[name[:-7] + ".scale"] = ("F8_E8M0", s)
        elif name.endswith("tid2eid"):
            rows = [torch.randperm(t["experts"], generator=gen, device="cpu")[: t["top_k"]] for _ in range(shape[0])]
            tensors[name] = ("I32", torch.stack(rows).to(torch.int32))
        elif "hc_" in name and name.endswith("_scale"):
            tensors[name] = ("F32", 0.5 + torch.rand(*shape, generator=gen, dtype=torch.float32, device="cpu"))
        elif "hc_" in name and name.endswith("_base"):
            tensors[name] = ("F32", 0.5 * randn(*shape))
        elif "hc_" in name and name.endswith("_fn"):
            tensors[name] = ("F32", randn(*shape) / shape[1] ** 0.5)
        elif name.endswith("attn_sink") or name.endswith(".ape"):
            tensors[name] = ("F32", 0.5 * randn(*shape))
        elif name.endswith("gate.bias"):
            tensors[name] = ("F32", 0.1 * randn(*shape))
        elif "norm" in name:
            tensors[name] = ("BF16", (1.0 + 0.1 * randn(*shape)).to(torch.bfloat16))
        elif name == "embed.weight":
            tensors[name] = ("BF16", randn(*shape).to(torch.bfloat16))
        else:  # bf16-stored linears: head, wo_a, gate, weights_proj, compressor wkv / wgate
            tensors[name] = ("BF16", (randn(*shape) / shape[1] ** 0.5).to(torch.bfloat16))
    with torch.no_grad():
        for name, p in params.items():
            dtype, value = tensors[name]
            if p.dtype == torch.float4_e2m1fn_x2:
                p.data = value.to(args.device).view(torch.float4_e2m1fn_x2)
            else:
                p.data = value.to(args.device).to(p.dtype)
            assert tuple(p.shape) == tuple(params[name].shape)

    # safetensors, written by hand (the format is a JSON header and raw little-endian bytes).
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, value = tensors[name]
        raw = value.contiguous().view(torch.uint8).flatten().cpu()
        data = bytes(raw.tolist())
        header[name] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for data in blobs:
            f.write(data)

    ids = torch.randint(0, t["vocab"], (1, t["seq"]), generator=gen, device="cpu")
    logits = model(ids.to(args.device), 0).float().cpu()
    write_npy(os.path.join(out, "logits.npy"), logits.flatten().tolist(), list(logits.shape))
    # Fresh state, then the reference's decode path (reference quirk: reset the compressor states, §7.2).
    for module in model.modules():
        if isinstance(module, ref.Compressor):
            module.kv_state.zero_()
            module.score_state.fill_(float("-inf"))
    k = t["decode_from"]
    model(ids[:, :k].to(args.device), 0)
    for pos in range(k, t["seq"]):
        step = model(ids[:, pos:pos + 1].to(args.device), pos).float().cpu()
    write_npy(os.path.join(out, "logits_decode.npy"), step.flatten().tolist(), list(step.shape))
    rel = ((step - logits).norm() / logits.norm()).item()
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump({"ids": ids.flatten().tolist(), "decode_from": k, "device": args.device,
                   "reference": "official inference/model.py + tools/reference/kernel_standin.py",
                   "prefill_vs_decode_relative_l2": rel}, f, indent=1)
    print(f"wrote {out}: logits {list(logits.shape)}, prefill vs decode relative L2 {rel:.3g}, "
          f"checkpoint {os.path.getsize(os.path.join(out, 'model.safetensors'))} bytes")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
