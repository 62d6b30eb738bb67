"""Pure-torch stand-in for the `kernel` module that DeepSeek's official inference/model.py imports (tilelang is
not installable on our GPU machine). Our own code, written from the tilelang kernels of the later official
inference/kernel.py (the revision whose act_quant(inplace=True) really rounds to e4m3: act_quant_kernel,
fp4_quant_kernel, fp8_gemm_kernel, fp4_gemm_kernel, sparse_attn_kernel, hc_split_sinkhorn_kernel) and from
fast_hadamard_transform (model.py rotate_activation falls back to `kernel.hadamard_transform`). Every docstring names
the kernel it reproduces.

Accumulation (docs/numerics.md "The oracle"): with EXACT = True (the default) every dot product / sum that a kernel
accumulates in fp32 is summed in float64 and rounded once to fp32 (fp32 and bf16 products are exact in float64), i.e.
each fp32 partial is the correctly rounded value of the exact sum. The kernels' own fp32 summation order is
unspecified (MMA tiles), so this is one admissible realisation of them, and the only one that does not depend on the
number of rows (prefill vs decode), the BLAS library or the device. EXACT = False uses plain fp32 torch matmuls
(the behaviour of the first version of this file, whose rows depend on the batch shape on the CPU).
"""
import torch

EXACT = True

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
# The kernels multiply by the fp32 constants 1/448 and 1/6 (fp8_max_inv, fp4_max_inv) rather than dividing.
_FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32).item()
_FP4_MAX_INV = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32).item()
ATTN_BLOCK = 64  # sparse_attn_kernel: indices are consumed 64 at a time (online softmax over blocks)


def _pow2_ceil(ratio: torch.Tensor) -> torch.Tensor:
    """fast_round_scale = fast_pow2(fast_log2_ceil(v)): 2^(exponent - 127 + (mantissa != 0)) from the fp32 bits."""
    bits = ratio.float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.ldexp(torch.ones_like(ratio, dtype=torch.float32), exponent.float())


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.float().unflatten(-1, (-1, block))


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 accumulation: exact sum rounded once to fp32 (EXACT) or a plain fp32 matmul."""
    if EXACT:
        return torch.matmul(a.double(), b.double()).float()
    return torch.matmul(a.float(), b.float())


def _exp(x: torch.Tensor) -> torch.Tensor:
    """fp32 exp; EXACT: evaluated in float64 and rounded (no dependence on torch's vector / scalar-tail split)."""
    return torch.exp(x.double()).float() if EXACT else torch.exp(x)


def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    """act_quant / act_quant_kernel. Per row and per `block_size` channels (fp32 math on the bf16 input):
    amax = max(|x|, 1e-4); s = amax * fp32(1/448), rounded up to a power of two through the exponent bits when
    scale_fmt is set (model.py passes "ue8m0" whenever scale_dtype is fp8, i.e. always for the released checkpoints);
    y = e4m3_RNE(clamp(x / s, ±448)). Not inplace: returns (y as float8_e4m3fn, s stored as scale_dtype — e8m0 holds
    the power of two exactly). inplace (later revision, model.py:377 and :511): x <- x.dtype(fp32(e4m3(..)) * s),
    the FP8 simulation of the window KV / main compressor entries, on the view it is given (rope channels untouched)."""
    xb = _blocks(x, block_size)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = amax * _FP8_MAX_INV
    if scale_fmt is not None:
        scale = _pow2_ceil(scale)
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if inplace:
        x.copy_((q.float() * scale).flatten(-2).to(x.dtype))
        return x
    return q.flatten(-2), scale.squeeze(-1).to(scale_dtype)


def _e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto {0, 0.5, 1, 1.5, 2, 3, 4, 6} (and negatives), saturating at 6 (tilelang's
    T.Cast(FP4, fp32)). The grid spacing is 0.5 below 2, 1 in [2, 4), 2 from 4; within each range the grid index has
    the parity of the e2m1 code, so half-to-even on the index is RNE. Comparisons only: exact, no log2."""
    magnitude = v.abs()
    spacing = lambda value: torch.full_like(magnitude, value)
    quantum = torch.where(magnitude < 2.0, spacing(0.5), torch.where(magnitude < 4.0, spacing(1.0), spacing(2.0)))
    rounded = torch.round(magnitude / quantum) * quantum  # torch.round is half-to-even
    return torch.copysign(rounded.clamp(max=FP4_MAX), v)


def fp4_act_quant(x: torch.Tensor, block_size: int = 32, inplace=False):
    """fp4_act_quant / fp4_quant_kernel: per `block_size` channels amax = max(|x|, 6·2^-126),
    s = pow2_ceil(amax * fp32(1/6)) (always e8m0), v = e2m1_RNE(clamp(x / s, ±6)). inplace (model.py:375, :421):
    x <- x.dtype(v * s). Not inplace (unused by model.py): (packed float4_e2m1fn_x2, low nibble = even element;
    e8m0 scales)."""
    xb = _blocks(x, block_size)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=FP4_MAX * 2.0 ** -126)
    scale = _pow2_ceil(amax * _FP4_MAX_INV)
    value = _e2m1_round((xb / scale).clamp(-FP4_MAX, FP4_MAX))
    if inplace:
        x.copy_((value * scale).flatten(-2).to(x.dtype))
        return x
    table = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=x.device)
    v = value.flatten(-2)
    code = (v.abs().unsqueeze(-1) == table).float().argmax(-1) + 8 * (v < 0).long()
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.float4_e2m1fn_x2), scale.squeeze(-1).to(torch.float8_e8m0fnu)


def fp8_gemm(a, a_s, b, b_s, scale_dtype=None):
    """fp8_gemm / fp8_gemm_kernel: C[M, N] = Σ over 128-wide K blocks k of (A_fp8[:, k] · B_fp8[:, k]^T)
    * (s_a[:, k] * s_b[n // 128, k]): one fp32 partial per block (the MMA into C_local), scaled and added in block
    order into the fp32 C_local_accum, stored in the default dtype (bf16 in model.py)."""
    K, N = a.size(-1), b.size(0)
    av, w = a.float(), b.float()  # e4m3 -> fp32 is exact
    sa = a_s.float()
    sb = b_s.float().repeat_interleave(128, 0)[:N]  # [N, ceil(K/128)]
    acc = torch.zeros(*a.shape[:-1], N, dtype=torch.float32, device=a.device)
    for k in range(sa.size(-1)):
        cols = slice(k * 128, min(K, (k + 1) * 128))
        acc = acc + _matmul(av[..., cols], w[:, cols].T) * (sa[..., k:k + 1] * sb[:, k])
    return acc.to(torch.get_default_dtype())


def fp4_gemm(a, a_s, b, b_s, scale_dtype=None):
    """fp4_gemm / fp4_gemm_kernel: b [N, K/2] packed e2m1 (low nibble = even k), b_s [N, K/32] e8m0. Per 32-wide K
    block k: fp32 partial of A_fp8 · fp8(B_fp4) (e2m1 values are exact in e4m3), * s_a[:, k // 4] * s_b[:, k], added
    in block order into fp32, stored in the default dtype."""
    raw = b.view(torch.uint8)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=raw.device)
    w = torch.stack([table[(raw & 0xF).long()], table[(raw >> 4).long()]], dim=-1).flatten(-2)  # [N, K]
    K, N = w.shape[1], w.shape[0]
    av, sa, sb = a.float(), a_s.float(), b_s.float()
    acc = torch.zeros(*a.shape[:-1], N, dtype=torch.float32, device=a.device)
    for k in range(K // 32):
        cols = slice(k * 32, (k + 1) * 32)
        acc = acc + _matmul(av[..., cols], w[:, cols].T) * sa[..., k // 4:k // 4 + 1] * sb[:, k]
    return acc.to(torch.get_default_dtype())


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    """sparse_attn / sparse_attn_kernel. q [b,s,h,d] bf16, kv [b,n,d] bf16 (K = V), topk_idxs [b,s,k] int32, sink [h]
    fp32. The row's indices are consumed in order, 64 at a time; an index of -1 contributes a zero K/V row and a
    logit of -inf (padding past k likewise). Per block: logits = (q · K) * scale in fp32; running max
    m' = max(m, block max); rescale r = exp(m - m'); p = exp(logit - m') in fp32; l = l * r + Σ p (fp32 p);
    acc = acc * r + bf16(p) · V (fp32). Finally l += exp(sink - m), out = bf16(acc / l). With at most 64 indices this
    is one softmax with the global max; with more, p is rounded to bf16 relative to the running max."""
    b, s, h, d = q.shape
    idx = topk_idxs.long()
    qf = q.float()
    m = torch.full((b, s, h), float("-inf"), dtype=torch.float32, device=q.device)
    l = torch.zeros((b, s, h), dtype=torch.float32, device=q.device)
    acc = torch.zeros((b, s, h, d), dtype=torch.float32, device=q.device)
    rows = torch.arange(b, device=q.device).view(b, 1, 1)
    for start in range(0, idx.size(-1), ATTN_BLOCK):
        block = idx[..., start:start + ATTN_BLOCK]  # [b,s,B]
        valid = block != -1
        kvb = kv[rows, block.clamp(min=0)].float() * valid.unsqueeze(-1)  # [b,s,B,d], zero rows for -1
        logits = _matmul(qf, kvb.transpose(-1, -2))  # [b,s,h,B]
        logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf")) * softmax_scale
        m_new = torch.maximum(m, logits.amax(-1))
        rescale = torch.where(m_new == float("-inf"), torch.zeros_like(m), _exp(m - m_new))
        p = _exp(logits - m_new.unsqueeze(-1)).masked_fill(~valid.unsqueeze(2), 0.0)  # (NaN-free if m' = -inf)
        block_sum = p.double().sum(-1).float() if EXACT else p.sum(-1)
        l = l * rescale + block_sum
        acc = acc * rescale.unsqueeze(-1) + _matmul(p.to(torch.bfloat16).float(), kvb)
        m = m_new
    l = l + _exp(attn_sink.float().view(1, 1, h) - m)
    return (acc / l.unsqueeze(-1)).to(torch.bfloat16)


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """hc_split_sinkhorn / hc_split_sinkhorn_kernel (§5.1), per token: pre = sigmoid(m[:hc]·s0 + b) + eps,
    post = 2·sigmoid(m[hc:2hc]·s1 + b), comb = m[2hc:]·s2 + b as hc×hc (row-major) -> exp(c - row max) / row sum
    + eps -> column-normalise (/(col sum + eps)) -> (iters - 1) × (row-normalise, column-normalise), all with +eps
    in the denominators. fp32 outputs; EXACT evaluates the chain in float64 (one rounding per output)."""
    hc = hc_mult
    work = (lambda t: t.double()) if EXACT else (lambda t: t.float())
    m, sc, base = work(mixes), work(hc_scale), work(hc_base)
    pre = torch.sigmoid(m[..., :hc] * sc[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * sc[1] + base[hc:2 * hc])
    comb = (m[..., 2 * hc:] * sc[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(-1, keepdim=True))
    comb = comb / comb.sum(-1, keepdim=True) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre.float(), post.float(), comb.float()


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """fast_hadamard_transform.hadamard_transform (model.py rotate_activation, :247): x @ H_n (Sylvester order, no
    bit reversal) in fp32, times fp32(scale), output in x's dtype (bf16). The fp32 transform is exact for bf16
    inputs in practice (±x sums), so EXACT only fixes its rounding."""
    n = x.size(-1)
    i = torch.arange(n, device=x.device)
    bits = torch.bitwise_and(i.unsqueeze(1), i.unsqueeze(0))
    parity = torch.zeros_like(bits)
    while bool((bits > 0).any()):
        parity ^= bits & 1
        bits = bits >> 1
    h = 1.0 - 2.0 * parity.float()
    return (_matmul(x, h) * torch.tensor(scale, dtype=torch.float32).item()).to(x.dtype)


def stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """torch.Tensor.topk with a defined tie order: equal values keep the lower index first (a stable sort), the rule
    of our top_k_indices (src/ops/cpu/indexer.h). torch's CPU topk runs std::nth_element, which leaves the choice
    among equal values to the row's length and layout (docs/numerics.md "Oracle result"); the indexer's bf16 scores
    tie often (ReLU zeros). Installed over torch.Tensor.topk by deepseek_reference.py."""
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))
