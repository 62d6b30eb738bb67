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
By default the reference runs with a defined tie order in torch.Tensor.topk (equal values: lower index first) and
exact accumulation (every GEMM / einsum / F.linear summed in float64, rounded once to its fp32 / bf16 output), so that
its prefill and decode paths compute the same function (docs/numerics.md "The oracle"), and torch.rsqrt of bf16
(the per-head q norm), torch.sigmoid and F.softplus round once; --torch-topk, --native-accumulation and
--native-elementwise restore torch's own behaviour. --dump-intermediates FILE.npz records the outputs of every
Block / Attention / Compressor / Indexer / MoE / Gate call of both runs and prints where the two paths first differ.
Usage: deepseek_reference.py --model-py .devcarry/ref --out OUT [--device cuda] [--config-only]
         [--dump-intermediates FILE.npz] [--torch-topk] [--native-accumulation] [--native-elementwise]
"""
import argparse
import functools
import json
import os
import struct
import sys
import zipfile

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


def npy_bytes(values, shape, integer=False):
    """A .npy file (version 1.0) of little-endian float32 (or int32) values."""
    descr, code = ("<i4", "i") if integer else ("<f4", "f")
    header = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (descr, "".join(f"{s}, " for s in shape))
    header = header.ljust(((len(header) + 11) // 64 + 1) * 64 - 11) + "\n"
    return (b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() +
            struct.pack(f"<{len(values)}{code}", *values))


def write_npy(path, values, shape):
    with open(path, "wb") as f:
        f.write(npy_bytes(values, shape))


def install_canonical_torch(kernel_standin, exact_accumulation, stable_topk, exact_elementwise):
    """The reference's own choices left open, fixed so that prefill and decode compute the same function.
    stable_topk: torch.Tensor.topk (model.py Indexer.forward and Gate.forward) keeps equal values in index order,
    lower index first (torch's CPU topk uses std::nth_element, whose choice among ties depends on the row's length:
    the prefill row holds every compressed entry with -inf for the future ones, the decode row only the visible ones).
    exact_accumulation: kernel_standin.EXACT, and model.py's own F.linear (compressor wkv / wgate, gate, mHC fns, head,
    indexer weights_proj) and torch.einsum (wo_a, indexer scores) summed in float64 and rounded once to fp32, then to
    their output dtype: the value every fp32-accumulating GEMM approximates, independent of the row count.
    exact_elementwise: torch.rsqrt of a bf16 tensor (model.py Attention.forward, the per-head q norm) as
    bf16(1/sqrt(x)) with one rounding. torch's CPU kernel computes that in its vectorised body but
    bf16(1/bf16(sqrt(x))) in the scalar tail of each contiguous run (c10's sqrt(BFloat16) returns a BFloat16), so the
    result depended on where a row fell in the flattened tensor: a decode step (heads elements) is all tail, a prefill
    mostly body. One rounding is what the body and our head_rms_norm_bf16 compute. torch.sigmoid (hc_head) and
    F.softplus (Gate) likewise go through float64 (one rounding), not Sleef in the body and libm in the tail."""
    import torch
    kernel_standin.EXACT = exact_accumulation
    if exact_elementwise:
        rsqrt, sigmoid, softplus = torch.rsqrt, torch.sigmoid, torch.nn.functional.softplus
        reduced = (torch.bfloat16, torch.float16)
        torch.rsqrt = lambda x: rsqrt(x.float()).to(x.dtype) if x.dtype in reduced else rsqrt(x)
        torch.sigmoid = lambda x: sigmoid(x.double()).to(x.dtype)
        torch.nn.functional.softplus = \
            lambda x, beta=1.0, threshold=20.0: softplus(x.double(), beta, threshold).to(x.dtype)
    if stable_topk:
        torch.Tensor.topk = kernel_standin.stable_topk
    if exact_accumulation:
        functional = torch.nn.functional
        einsum = torch.einsum

        def exact_linear(input, weight, bias=None):
            y = torch.matmul(input.double(), weight.double().T)
            if bias is not None:
                y = y + bias.double()
            return y.float().to(torch.promote_types(input.dtype, weight.dtype))

        def exact_einsum(equation, *operands):
            dtype = functools.reduce(torch.promote_types, [o.dtype for o in operands])
            return einsum(equation, *[o.double() for o in operands]).float().to(dtype)

        functional.linear = exact_linear
        torch.einsum = exact_einsum


class Recorder:
    """Forward hooks on every Block / Attention / Compressor / Indexer / MoE / Gate: batch row 0 of each call's
    output, concatenated over the calls of one run along the first axis, so that both runs give one row per token
    (compressors: one row per emitted entry). Indexer rows are the chosen compressed entry numbers (offset removed,
    -1 padded to index_topk, ascending); Gate rows are the expert ids ascending, and their routing weights."""

    def __init__(self, model, ref):
        self.runs, self.order, self.ratio = {}, [], {}
        self.current = None
        kinds = (ref.Block, ref.Attention, ref.Compressor, ref.Indexer, ref.MoE, ref.Gate)
        for name, module in model.named_modules():
            if isinstance(module, kinds):
                module.register_forward_hook(self._hook(name, ref))
                if isinstance(module, ref.Compressor):
                    self.ratio[name] = module.compress_ratio

    def start(self, run):
        self.current = self.runs.setdefault(run, {})

    def _add(self, key, value):
        if key not in self.order:
            self.order.append(key)
        self.current.setdefault(key, []).append(value.detach().cpu().clone())

    def _hook(self, name, ref):
        import torch

        def hook(module, args, output):
            if self.current is None or output is None:  # a compressor call that emitted no entry returns None
                return
            if isinstance(module, ref.Indexer):
                offset, idx = args[3], output[0].long()
                idx = torch.where(idx >= 0, idx - offset, -1)
                pad = module.index_topk - idx.size(-1)
                idx = torch.cat([idx, idx.new_full((idx.size(0), pad), -1)], -1) if pad > 0 else idx
                self._add(name, idx.sort(-1).values.int())
            elif isinstance(module, ref.Gate):
                weights, indices = output
                order = indices.long().argsort(-1)
                self._add(name + ".experts", indices.long().gather(-1, order).int())
                self._add(name + ".weights", weights.gather(-1, order).float())
            else:
                self._add(name, output[0].float())
        return hook

    def stacked(self, run):
        import torch
        return {key: torch.cat(parts, 0) for key, parts in self.runs[run].items()}

    def write_npz(self, path):
        with zipfile.ZipFile(path, "w") as z:
            for run in self.runs:
                for key, t in self.stacked(run).items():
                    integer = not t.dtype.is_floating_point
                    z.writestr(f"{run}/{key}.npy", npy_bytes(t.flatten().tolist(), list(t.shape), integer))

    def compare(self, a_run, b_run):
        """Per hooked output: rows (tokens / entries) on which the runs differ, the largest relative L2 of a row, and
        the first (token, module) in execution order at which the two paths differ."""
        import torch
        a, b = self.stacked(a_run), self.stacked(b_run)
        lines, first = [], None
        for key in self.order:
            if key not in a or key not in b or a[key].shape != b[key].shape:
                lines.append(f"  {key:40s} shapes {tuple(a[key].shape) if key in a else None} vs "
                             f"{tuple(b[key].shape) if key in b else None}")
                continue
            x, y = a[key].float().flatten(1), b[key].float().flatten(1)
            diff = (x - y).norm(dim=1) / x.norm(dim=1).clamp(min=1e-30)
            rows = [i for i in range(x.size(0)) if not torch.equal(x[i], y[i])]
            lines.append(f"  {key:40s} rows {x.size(0):3d}  differing {len(rows):3d}  max rel L2 "
                         f"{diff.max().item():.3g}" + (f"  first row {rows[0]}" if rows else ""))
            for i in rows[:1]:
                token = (i + 1) * self.ratio[key] - 1 if key in self.ratio else i
                if first is None or token < first[0]:
                    first = (token, key)
        return lines, first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-py", required=True, help="folder holding the official inference/model.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="write config.json only (no torch needed)")
    ap.add_argument("--dump-intermediates", metavar="NPZ",
                    help="record every Block/Attention/Compressor/Indexer/MoE/Gate output of both runs into NPZ "
                         "and print where the prefill and decode paths first differ")
    ap.add_argument("--torch-topk", action="store_true", help="keep torch's topk tie order (unspecified)")
    ap.add_argument("--native-accumulation", action="store_true",
                    help="plain fp32 / bf16 torch GEMMs instead of exact (float64) accumulation")
    ap.add_argument("--native-elementwise", action="store_true",
                    help="torch's own rsqrt (bf16) / sigmoid / softplus, whose CPU result depends on the tensor length")
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
    install_canonical_torch(kernel_standin, not args.native_accumulation, not args.torch_topk,
                            not args.native_elementwise)

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
    recorder = Recorder(model, ref) if args.dump_intermediates else None
    if recorder:
        recorder.start("prefill")
    logits = model(ids.to(args.device), 0).float().cpu()
    write_npy(os.path.join(out, "logits.npy"), logits.flatten().tolist(), list(logits.shape))
    # Fresh state, then the reference's decode path (reference quirk: reset the compressor states, §7.2).
    for module in model.modules():
        if isinstance(module, ref.Compressor):
            module.kv_state.zero_()
            module.score_state.fill_(float("-inf"))
    k = t["decode_from"]
    if recorder:
        recorder.start("decode")
    model(ids[:, :k].to(args.device), 0)
    for pos in range(k, t["seq"]):
        step = model(ids[:, pos:pos + 1].to(args.device), pos).float().cpu()
    write_npy(os.path.join(out, "logits_decode.npy"), step.flatten().tolist(), list(step.shape))
    rel = ((step - logits).norm() / logits.norm()).item()
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump({"ids": ids.flatten().tolist(), "decode_from": k, "device": args.device,
                   "reference": "official inference/model.py + tools/reference/kernel_standin.py",
                   "torch_version": torch.__version__,
                   "accumulation": "native" if args.native_accumulation else "exact (float64, one rounding)",
                   "topk_ties": "torch" if args.torch_topk else "lower index first",
                   "elementwise": "native" if args.native_elementwise else "one rounding (bf16 rsqrt via fp32)",
                   "prefill_vs_decode_relative_l2": rel}, f, indent=1)
    print(f"wrote {out}: logits {list(logits.shape)}, prefill vs decode relative L2 {rel:.3g}, "
          f"checkpoint {os.path.getsize(os.path.join(out, 'model.safetensors'))} bytes")
    if recorder:
        recorder.write_npz(args.dump_intermediates)
        lines, first = recorder.compare("prefill", "decode")
        print(f"intermediates -> {args.dump_intermediates}; prefill(40) vs prefill({k}) + decode, per hooked output:")
        print("\n".join(lines))
        print("first difference: " + (f"token {first[0]}, {first[1]}" if first else "none (bit-identical)"))


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
