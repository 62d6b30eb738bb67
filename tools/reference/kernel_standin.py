"""Pure-torch stand-in for the `kernel` module that DeepSeek's official inference/model.py imports (tilelang is
not installable on our GPU machine). Written from the semantics in shared docs/research/model_spec.md §3.2, §3.3,
§3.5, §5.1, §6.5 — our own code, not DeepSeek's. Every quantizer really rounds onto the e4m3 / e2m1 grid
(round-to-nearest-even, power-of-two UE8M0 scales); every GEMM dequantizes exactly and accumulates in fp32.
"""
import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _pow2_ceil(ratio: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(ratio)) from the fp32 exponent bits: exponent - 127 + (mantissa != 0)."""
    bits = ratio.float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.ldexp(torch.ones_like(ratio, dtype=torch.float32), exponent.float())


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.float().unflatten(-1, (-1, block))


def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    """Per-`block_size` e4m3 quantization with scale 2^ceil(log2(max(amax, 1e-4) / 448)).
    inplace=True: x <- dequantized value (the FP8 simulation of the KV cache, §3.3); else (q fp8, scales)."""
    xb = _blocks(x, block_size)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = _pow2_ceil(amax / FP8_MAX)
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if inplace:
        x.copy_((q.float() * scale).flatten(-2).to(x.dtype))
        return x
    return q.flatten(-2), scale.squeeze(-1).to(scale_dtype)


def _e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto {0, 0.5, 1, 1.5, 2, 3, 4, 6} (and negatives), saturating at 6."""
    magnitude = v.abs()
    exponent = torch.floor(torch.log2(magnitude.clamp(min=1.0)))
    quantum = torch.where(magnitude < 1.0, torch.full_like(v, 0.5), torch.exp2(exponent - 1))
    rounded = torch.round(magnitude / quantum) * quantum  # torch.round is half-to-even
    return torch.copysign(rounded.clamp(max=FP4_MAX), v)


def fp4_act_quant(x: torch.Tensor, block_size: int = 32, inplace=True):
    """FP4 simulation (§3.3): per-32 scale 2^ceil(log2(max(amax, 6*2^-126) / 6)), e2m1 RNE, dequantized in place."""
    xb = _blocks(x, block_size)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=FP4_MAX * 2.0 ** -126)
    scale = _pow2_ceil(amax / FP4_MAX)
    value = _e2m1_round((xb / scale).clamp(-FP4_MAX, FP4_MAX)) * scale
    x.copy_(value.flatten(-2).to(x.dtype))
    return x


def _dequant_act(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    block = q.size(-1) // s.size(-1)
    return (_blocks(q, block) * s.float().unsqueeze(-1)).flatten(-2)


def fp8_gemm(a, a_s, b, b_s, scale_dtype=None):
    """bf16 (a_fp8 * a_s) @ (b_fp8 * b_s)^T, b_s per 128x128 block; fp32 accumulation."""
    w = b.float()
    s = b_s.float().repeat_interleave(128, 0)[: w.size(0)].repeat_interleave(128, 1)[:, : w.size(1)]
    return (_dequant_act(a, a_s) @ (w * s).T).to(torch.bfloat16)


def fp4_gemm(a, a_s, b, b_s, scale_dtype=None):
    """b: [out, in/2] packed e2m1 (low nibble = even element), b_s: [out, in/32]."""
    raw = b.view(torch.uint8)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=raw.device)
    low, high = table[(raw & 0xF).long()], table[(raw >> 4).long()]
    w = torch.stack([low, high], dim=-1).flatten(-2)
    w = w * b_s.float().repeat_interleave(32, 1)
    return (_dequant_act(a, a_s) @ w.T).to(torch.bfloat16)


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    """q [b,s,h,d] bf16, kv [b,n,d] bf16 (K = V), topk_idxs [b,s,k] (-1 = none), sink [h] fp32.
    fp32 logits, exp(s - max) rounded to bf16 for P.V, fp32 denominator with exp(sink - max), bf16 out (§6.5)."""
    b, s, h, d = q.shape
    idx = topk_idxs.long()
    valid = idx >= 0
    gathered = torch.gather(kv.float().unsqueeze(1).expand(b, s, -1, d), 2,
                            idx.clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, d))  # [b,s,k,d]
    logits = torch.einsum("bshd,bskd->bshk", q.float(), gathered) * softmax_scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    m = logits.amax(-1, keepdim=True)
    p = torch.exp(logits - m)
    denominator = p.sum(-1, keepdim=True) + torch.exp(attn_sink.float().view(1, 1, h, 1) - m)
    o = torch.einsum("bshk,bskd->bshd", p.to(torch.bfloat16).float(), gathered) / denominator
    return o.to(torch.bfloat16)


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """§5.1: pre = sigmoid(.)+eps, post = 2 sigmoid(.), comb = Sinkhorn(softmax rows + eps), fp32."""
    hc = hc_mult
    pre = torch.sigmoid(mixes[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * hc_scale[2] + hc_base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x @ H_n * scale, H_n the Sylvester Walsh-Hadamard matrix (natural order), fp32 math, x's dtype out (§3.5)."""
    n = x.size(-1)
    i = torch.arange(n, device=x.device)
    bits = torch.bitwise_and(i.unsqueeze(1), i.unsqueeze(0))
    parity = torch.zeros_like(bits)
    while bool((bits > 0).any()):
        parity ^= bits & 1
        bits = bits >> 1
    h = 1.0 - 2.0 * parity.float()
    return ((x.float() @ h) * scale).to(x.dtype)
