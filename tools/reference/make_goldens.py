#!/usr/bin/env python3
"""Write HF DeepSeek-V4 golden fixtures for the dsv4 C++ tests.

Usage:
    python3 tools/reference/make_goldens.py --out DIR [--cases a,b] [--device cuda|cpu]

For every case this builds a tiny DeepseekV4Config, constructs DeepseekV4ForCausalLM in float32,
overwrites every parameter / persistent buffer with random values, rounds them to bfloat16 (and
back), runs the model in float32 one-shot and chunked (through one DynamicCache), and writes
DIR/<case>/{config.json, model.safetensors (bf16 + int64 tid2eid), golden.json, logits.npy,
logits_chunked.npy}. Seeds whose indexer / router top-k boundaries come close to a tie are
skipped. Finally the saved directory is reloaded with from_pretrained and must reproduce the
logits. See tools/reference/README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dsv4_hf_common import (  # noqa: E402
    HF,
    TIE_REL_THRESHOLD,
    ClampProbe,
    RefError,
    TopkProbe,
    check_loading_info,
    fmt_g,
    force_experts_impl,
    load_hf_model,
    max_rel,
    nonpersistent_buffers,
    np,
    persistent_tensors,
    print_table,
    rel_l2,
    safetensors_summary,
    setup_torch,
    tensor_stats,
    torch,
)

VOCAB = 512
CHUNK_REL_L2_TOL = 1e-4  # one-shot vs chunked HF logits
RELOAD_MAX_REL_TOL = 1e-6  # golden logits vs logits of the reloaded directory
MAX_SAFETENSORS_BYTES = int(1.5 * 1024 * 1024)

CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
SWA = "sliding_attention"

# ---------------------------------------------------------------------------------------------
# Cases. "config" goes verbatim to DeepseekV4Config(**config); "expect" is what HF must have made
# of it (legacy kwargs folded in __post_init__); a mismatch fails the case before any forward.
# ---------------------------------------------------------------------------------------------

CASES = {
    "mixed_4_128": dict(
        description=(
            "4 layers SWA/CSA(4)/HCA(128)/CSA(4) from legacy compress_ratios; legacy num_hash_layers=1 and "
            "qk_rope_head_dim=16 (head_dim 64); YaRN(factor 16, orig 65536) on the compress rope via "
            "rope_scaling; window 16; indexer top-8 of up to 75 entries; HCA emits 2 entries over T=300."
        ),
        T=300,
        base_seed=1000,
        extra_pieces=[128],
        config=dict(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
            compress_ratios=[0, 4, 128, 4], num_hash_layers=1, qk_rope_head_dim=16,
            head_dim=64, num_attention_heads=4, q_lora_rank=32, o_groups=2, o_lora_rank=32,
            sliding_window=16, index_n_heads=4, index_head_dim=32, index_topk=8,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                          "beta_fast": 32, "beta_slow": 1},
        ),
        expect=dict(
            layer_types=[SWA, CSA, HCA, CSA],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            compress_rates={CSA: 4, HCA: 128},
            qk_rope_head_dim=16,
            partial_rotary_factor=0.25,
            rope_compress=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=65536,
                               beta_fast=32.0, beta_slow=1.0, attention_factor=1.0, rope_theta=160000.0),
            rope_main=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "rates_8_32_yarn": dict(
        description=(
            "5 layers SWA/CSA/HCA/CSA/HCA with legacy compress_rate_csa=8, compress_rate_hca=32; explicit "
            "mlp_layer_types (2 hash_moe, 3 moe); YaRN factor 4 with original_max_position_embeddings 64 "
            "given as flat rope_parameters; index_topk 4, window 8, hc_sinkhorn_iters 7, T=160."
        ),
        T=160,
        base_seed=2000,
        extra_pieces=[],
        config=dict(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=5,
            layer_types=[SWA, CSA, HCA, CSA, HCA],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
            compress_rate_csa=8, compress_rate_hca=32,
            head_dim=64, partial_rotary_factor=0.25, num_attention_heads=4, q_lora_rank=32,
            o_groups=2, o_lora_rank=32, sliding_window=8, index_n_heads=4, index_head_dim=32,
            index_topk=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            hc_sinkhorn_iters=7,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "beta_fast": 32, "beta_slow": 1},
        ),
        expect=dict(
            layer_types=[SWA, CSA, HCA, CSA, HCA],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
            compress_rates={CSA: 8, HCA: 32},
            qk_rope_head_dim=16,
            hc_sinkhorn_iters=7,
            rope_compress=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                               attention_factor=1.0, rope_theta=160000.0),
            rope_main=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "pro_style_defaults": dict(
        description=(
            "4 layers with HF's default layout (HCA, HCA, then HCA/CSA interleave -> HCA,HCA,HCA,CSA), "
            "compress_rates dict {CSA: 4, HCA: 16}, default num_hash_layers (3 hash_moe + 1 moe), no rope "
            "scaling (default rope on both types), 8 heads in 4 output groups, routed_scaling_factor 2.5, "
            "swiglu_limit 1.5 (clamp active), 8 index heads, index_topk 16, window 32, T=200."
        ),
        T=200,
        base_seed=3000,
        extra_pieces=[],
        require_clamp=True,
        config=dict(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
            compress_rates={CSA: 4, HCA: 16},
            head_dim=64, num_attention_heads=8, q_lora_rank=32, o_groups=4, o_lora_rank=32,
            sliding_window=32, index_n_heads=8, index_head_dim=32, index_topk=16,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            scoring_func="sqrtsoftplus", routed_scaling_factor=2.5, swiglu_limit=1.5,
        ),
        expect=dict(
            layer_types=[HCA, HCA, HCA, CSA],
            mlp_layer_types=["hash_moe", "hash_moe", "hash_moe", "moe"],
            compress_rates={CSA: 4, HCA: 16},
            qk_rope_head_dim=8,
            rope_compress=dict(rope_type="default", rope_theta=160000.0),
            rope_main=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "topk_boundary": dict(
        description=(
            "3 CSA(4) layers (legacy compress_ratios [4,4,4]), index_topk 3 so selection starts at position "
            "15, window 4, no hash layers (num_hash_layers 0), 6 experts top-3, hidden 96, head_dim 32 with "
            "legacy qk_rope_head_dim 8, T=96."
        ),
        T=96,
        base_seed=4000,
        extra_pieces=[],
        config=dict(
            vocab_size=VOCAB, hidden_size=96, num_hidden_layers=3,
            compress_ratios=[4, 4, 4], num_hash_layers=0,
            head_dim=32, qk_rope_head_dim=8, num_attention_heads=4, q_lora_rank=32,
            o_groups=2, o_lora_rank=32, sliding_window=4, index_n_heads=4, index_head_dim=16,
            index_topk=3, n_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
        ),
        expect=dict(
            layer_types=[CSA, CSA, CSA],
            mlp_layer_types=["moe", "moe", "moe"],
            compress_rates={CSA: 4, HCA: 128},
            qk_rope_head_dim=8,
            rope_compress=dict(rope_type="default", rope_theta=160000.0),
            rope_main=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
}


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def build_config(hf, kwargs):
    kw = copy.deepcopy(kwargs)
    try:
        return hf.Config(**kw)
    except TypeError as exc:
        if "rope_scaling" in kw and "rope_scaling" in str(exc):
            print(f"  note: DeepseekV4Config rejected rope_scaling ({exc}); passing it as rope_parameters")
            kw["rope_parameters"] = kw.pop("rope_scaling")
            try:
                return hf.Config(**kw)
            except Exception as exc2:  # noqa: BLE001
                raise RefError(f"DeepseekV4Config(**{kw}) failed: {exc2}") from exc2
        raise RefError(f"DeepseekV4Config(**{kw}) failed: {exc}") from exc
    except Exception as exc:  # noqa: BLE001
        raise RefError(f"DeepseekV4Config(**{kw}) failed: {type(exc).__name__}: {exc}") from exc


def _close(a, b):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def check_config(cfg, expect):
    errs = []
    for key, want in expect.items():
        if key in ("rope_compress", "rope_main"):
            label = "compress" if key == "rope_compress" else "main"
            rp = getattr(cfg, "rope_parameters", None) or {}
            sub = rp.get(label)
            if not isinstance(sub, dict):
                errs.append(f"rope_parameters[{label!r}] missing (rope_parameters={rp})")
                continue
            for k2, v2 in want.items():
                got = sub.get(k2)
                if not _close(got, v2):
                    errs.append(f"rope_parameters[{label!r}][{k2!r}] = {got!r}, expected {v2!r}")
            continue
        got = getattr(cfg, key, None)
        if isinstance(want, dict):
            got = dict(got) if got is not None else None
        elif isinstance(want, list):
            got = list(got) if got is not None else None
        if not _close(got, want):
            errs.append(f"config.{key} = {got!r}, expected {want!r}")
    if errs:
        raise RefError("HF built a different config than the case intends:\n  " + "\n  ".join(errs))


def config_fingerprint(cfg):
    """Fields that must survive config.json round trip."""
    rp = getattr(cfg, "rope_parameters", {}) or {}
    keys = ("rope_type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
            "beta_fast", "beta_slow", "attention_factor")
    fp = {k: getattr(cfg, k, None) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
        "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
        "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "scoring_func",
        "routed_scaling_factor", "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps",
        "partial_rotary_factor", "qk_rope_head_dim", "rope_theta", "compress_rope_theta", "tie_word_embeddings")}
    fp["layer_types"] = list(cfg.layer_types)
    fp["mlp_layer_types"] = list(cfg.mlp_layer_types)
    fp["compress_rates"] = dict(cfg.compress_rates)
    for label in ("main", "compress"):
        sub = rp.get(label, {}) or {}
        fp[f"rope_{label}"] = {k: sub.get(k) for k in keys if k in sub}
    return fp


# ---------------------------------------------------------------------------------------------
# Random weights
# ---------------------------------------------------------------------------------------------


def _rule_for(hf, module, attr, tensor):
    """(rule, arg) for one parameter / persistent buffer, matched on the owning module's class."""
    c = hf.cls
    if isinstance(module, c("DeepseekV4HashRouter")):
        if attr == "tid2eid":
            return ("perm", None)
        if attr == "weight":
            return ("fan_in", None)
    if isinstance(module, c("DeepseekV4TopKRouter")):
        if attr == "e_score_correction_bias":
            return ("normal", 0.1)
        if attr == "weight":
            return ("fan_in", None)
    if isinstance(module, c("DeepseekV4Experts")) and attr in ("gate_up_proj", "down_proj"):
        return ("fan_in", None)
    if isinstance(module, c("DeepseekV4Attention")) and attr == "sinks":
        return ("normal", 0.5)
    if isinstance(module, (c("DeepseekV4HCACompressor"), c("DeepseekV4CSACompressor"), c("DeepseekV4Indexer"))) \
            and attr == "position_bias":
        return ("normal", 0.5)
    if isinstance(module, c("DeepseekV4HyperConnection")):
        return {"fn": ("fan_in", None), "base": ("normal", 0.5), "scale": ("uniform", (0.5, 1.5))}.get(attr)
    if isinstance(module, c("DeepseekV4HyperHead")):
        return {"hc_fn": ("fan_in", None), "hc_base": ("normal", 0.5),
                "hc_scale": ("uniform", (0.5, 1.5))}.get(attr)
    if isinstance(module, c("DeepseekV4RMSNorm")) and attr == "weight":
        return ("one_plus", 0.1)
    if isinstance(module, torch.nn.Embedding) and attr == "weight":
        return ("normal", 1.0)
    if isinstance(module, torch.nn.Linear):
        if attr == "weight":
            return ("fan_in", None)
        if attr == "bias":
            return ("normal", 0.1)
    return None


def randomize_model(model, hf, seed):
    """Overwrite every parameter and persistent buffer; returns the report rows."""
    gen = torch.Generator().manual_seed(seed)
    report, unhandled, skipped = [], [], []
    before = {}
    for mod_name, mod in model.named_modules():
        entries = [(a, t, "param") for a, t in mod.named_parameters(recurse=False)]
        nonpers = getattr(mod, "_non_persistent_buffers_set", set())
        for a, t in mod.named_buffers(recurse=False):
            if a in nonpers:
                skipped.append(f"{mod_name}.{a}")
                continue
            entries.append((a, t, "buffer"))
        for attr, t, kind in entries:
            full = f"{mod_name}.{attr}" if mod_name else attr
            if t.device.type != "cpu":
                raise RefError(f"{full} is on {t.device}; randomize before moving the model")
            rule = _rule_for(hf, mod, attr, t)
            if rule is None:
                unhandled.append(f"{full} ({type(mod).__name__}.{attr}, {tuple(t.shape)}, {t.dtype})")
                continue
            before[full] = t.detach().clone()
            name, arg = rule
            shape = tuple(t.shape)
            if name == "perm":
                if t.dim() != 2 or t.dtype != torch.int64:
                    raise RefError(f"{full}: expected an int64 [vocab, top_k] table, got {t.dtype} {shape}")
                n_exp = int(getattr(mod, "num_experts"))
                k = shape[1]
                if k > n_exp:
                    raise RefError(f"{full}: top_k {k} > num_experts {n_exp}")
                val = torch.argsort(torch.rand(shape[0], n_exp, generator=gen), dim=1)[:, :k].to(torch.int64)
                desc = f"distinct rows of {k} from {n_exp}"
            else:
                if not t.is_floating_point():
                    raise RefError(f"{full}: rule {name} on non-float tensor {t.dtype}")
                if name == "fan_in":
                    fan_in = shape[-1]
                    std = 1.0 / math.sqrt(fan_in)
                    val = torch.randn(shape, generator=gen) * std
                    desc = f"normal std 1/sqrt({fan_in})"
                elif name == "normal":
                    val = torch.randn(shape, generator=gen) * arg
                    desc = f"normal std {arg}"
                elif name == "one_plus":
                    val = 1.0 + torch.randn(shape, generator=gen) * arg
                    desc = f"1 + {arg}*normal"
                elif name == "uniform":
                    lo, hi = arg
                    val = lo + (hi - lo) * torch.rand(shape, generator=gen)
                    desc = f"uniform [{lo}, {hi})"
                else:  # pragma: no cover
                    raise RefError(f"unknown rule {name}")
                val = val.to(t.dtype)
            with torch.no_grad():
                t.copy_(val)
            report.append((full, kind, shape, desc))
    if unhandled:
        raise RefError("no randomization rule for:\n  " + "\n  ".join(unhandled))
    bad_skip = [s for s in skipped if "inv_freq" not in s]
    if bad_skip:
        raise RefError(f"unexpected non-persistent buffers (not randomized, not saved): {bad_skip}")

    # Every parameter must be covered and changed.
    all_params = {n for n, _ in model.named_parameters()}
    covered = {r[0] for r in report}
    missing = sorted(all_params - covered)
    if missing:
        raise RefError(f"parameters not randomized: {missing}")
    unchanged = []
    named = {n: t for n, t, _ in persistent_tensors(model)}
    for full, t in named.items():
        if full in before and torch.equal(before[full], t.detach()) and t.numel() > 0:
            unchanged.append(full)
        if t.is_floating_point() and t.numel() > 1 and float(t.detach().double().std()) == 0.0:
            unchanged.append(full + " (constant)")
    if unchanged:
        raise RefError(f"randomization left these unchanged/constant: {unchanged}")
    return report, skipped


def pair_indexer_heads(model, hf):
    """Make the lightning indexer's query heads antipodal pairs: head 2i+1 = -head 2i (rows of
    q_b_proj). Index scores are sum_h w_h * relu(q_h . k_s); with independent heads an entry whose
    every head has q_h . k_s <= 0 scores exactly 0 (probability 2^-n_heads per entry: 1/16 with
    4 heads), and two such entries straddling the k-th place are an exact tie that makes the
    selected set implementation-defined (seen on every seed with 4 heads). With antipodal pairs one
    head of each pair is always active, so exact zeros (and zero ties) cannot occur, while w_h, q and
    the keys stay random. Returns the names changed."""
    Indexer = hf.cls("DeepseekV4Indexer")
    changed = []
    for name, mod in model.named_modules():
        if not isinstance(mod, Indexer):
            continue
        n_heads, head_dim = int(mod.num_heads), int(mod.head_dim)
        w = mod.q_b_proj.weight
        if n_heads % 2:
            raise RefError(f"{name}: index_n_heads={n_heads} is odd; antipodal head pairs need an even count")
        if w.shape[0] != n_heads * head_dim:
            raise RefError(f"{name}.q_b_proj.weight has {w.shape[0]} rows, expected {n_heads}*{head_dim}")
        with torch.no_grad():
            v = w.view(n_heads, head_dim, w.shape[1])
            v[1::2] = -v[0::2]
        changed.append(f"{name}.q_b_proj.weight")
    return changed


def round_to_bf16(model):
    """Round every float parameter / persistent buffer to bf16 and back (in place)."""
    n = 0
    with torch.no_grad():
        for _, t, _ in persistent_tensors(model):
            if t.is_floating_point():
                t.copy_(t.to(torch.bfloat16).to(t.dtype))
                n += 1
    return n


def bf16_bytes(model):
    total = 0
    for _, t, _ in persistent_tensors(model):
        total += t.numel() * (2 if t.is_floating_point() else t.element_size())
    return total


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def make_inputs(seed, T, vocab, window, extra_pieces, csa_rate, index_topk, has_csa):
    """Uniform ids in [0, vocab) and a deterministic random partition of T into chunks containing
    several 1-token chunks (at least two of them at positions where the indexer really selects), one
    chunk longer than the window, and the case's extra pieces."""
    rng = np.random.default_rng([int(seed), 0x5D54])
    ids = rng.integers(0, vocab, size=T).astype(np.int64).tolist()
    first_select = (index_topk + 1) * csa_rate - 1 if has_csa else 0
    for _ in range(1000):
        n_single = int(rng.integers(4, 8))
        hi = max(window + 1, min(T // 3, 4 * window))
        long_len = int(rng.integers(window + 1, hi + 1))
        rest = T - n_single - long_len - sum(extra_pieces)
        if rest < 0:
            raise RefError(f"T={T} too short for the chunk recipe")
        others = []
        while rest > 0:
            c = int(rng.integers(2, 6)) if rng.random() < 0.5 else int(rng.integers(6, 2 * window + 2))
            c = min(c, rest)
            others.append(c)
            rest -= c
        pieces = [long_len] + [1] * n_single + list(extra_pieces) + others
        chunks = [pieces[i] for i in rng.permutation(len(pieces))]
        starts = np.cumsum([0] + chunks[:-1])
        singles_selecting = sum(1 for s, c in zip(starts, chunks) if c == 1 and s >= first_select)
        if singles_selecting >= 2 and sum(chunks) == T:
            return ids, [int(c) for c in chunks]
    raise RefError("could not draw a chunk partition meeting the constraints")


# ---------------------------------------------------------------------------------------------
# Forward passes
# ---------------------------------------------------------------------------------------------


def forward_one_shot(model, ids_t, probe=None):
    if probe is not None:
        probe.offset = 0
    out = model(input_ids=ids_t[None], use_cache=True)
    logits = getattr(out, "logits", None)
    if logits is None or logits.dim() != 3 or logits.shape[1] != ids_t.numel():
        raise RefError(f"one-shot forward returned logits of shape {getattr(logits, 'shape', None)}")
    return logits[0].float()


def forward_chunked(hf, model, ids_t, chunks, probe=None):
    cache = hf.DynamicCache(config=model.config)
    outs, pos = [], 0
    for i, c in enumerate(chunks):
        if probe is not None:
            probe.offset = pos
        out = model(input_ids=ids_t[None, pos:pos + c], past_key_values=cache, use_cache=True)
        if out.past_key_values is not cache:
            raise RefError("HF returned a different cache object than the DynamicCache passed in")
        if i == 0:
            check_cache_layers(model.config, cache)
        pos += c
        seen = cache.get_seq_length()
        if int(seen) != pos:
            raise RefError(f"after chunk {i} cache.get_seq_length() = {seen}, expected {pos}: HF would derive "
                           "wrong position_ids for the next chunk")
        outs.append(out.logits[0].float())
    return torch.cat(outs, dim=0)


def check_cache_layers(cfg, cache):
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) != cfg.num_hidden_layers:
        raise RefError(f"DynamicCache(config=...) has {None if layers is None else len(layers)} layers, "
                       f"expected {cfg.num_hidden_layers}")
    for i, lt in enumerate(cfg.layer_types):
        layer = layers[i]
        if lt != SWA and not hasattr(layer, "store_compression_weights"):
            raise RefError(f"cache layer {i} ({lt}) is {type(layer).__name__}, not a DeepSeek-V4 compressor "
                           "cache: DynamicCache did not map the V4 layer types")
        if lt == CSA and not hasattr(layer, "update_overlap_state"):
            raise RefError(f"cache layer {i} (CSA) is {type(layer).__name__}, lacks update_overlap_state")


# ---------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------


def remove_fixture_files(d):
    for f in ("config.json", "model.safetensors", "model.safetensors.index.json", "generation_config.json",
              "golden.json", "logits.npy", "logits_chunked.npy"):
        p = os.path.join(d, f)
        if os.path.exists(p):
            os.remove(p)


def run_case(name, spec, args, hf, device):
    t0 = time.time()
    print("=" * 100)
    print(f"[{name}] {spec['description']}")
    cfg0 = build_config(hf, spec["config"])
    check_config(cfg0, spec["expect"])
    layer_types = list(cfg0.layer_types)
    has_csa = CSA in layer_types
    csa_rate = int(cfg0.compress_rates[CSA])
    print(f"[{name}] layer_types={layer_types}")
    print(f"[{name}] mlp_layer_types={list(cfg0.mlp_layer_types)} compress_rates={dict(cfg0.compress_rates)}")
    print(f"[{name}] rope_parameters={cfg0.rope_parameters}")
    print(f"[{name}] qk_rope_head_dim={cfg0.qk_rope_head_dim} sliding_window={cfg0.sliding_window} "
          f"index_topk={cfg0.index_topk} T={spec['T']}")

    T = spec["T"]
    chosen = None
    attempts = []
    for attempt in range(args.max_tries):
        seed = spec["base_seed"] + args.seed_offset + attempt
        cfg = build_config(hf, spec["config"])
        torch.manual_seed(seed)
        try:
            model = hf.Model(cfg)
        except Exception as exc:  # noqa: BLE001
            raise RefError(f"DeepseekV4ForCausalLM(config) failed: {type(exc).__name__}: {exc}") from exc
        model.eval()
        impl = force_experts_impl(model, args.experts_impl)
        report, skipped = randomize_model(model, hf, seed)
        paired = pair_indexer_heads(model, hf) if spec.get("antipodal_index_heads", True) else []
        n_rounded = round_to_bf16(model)
        if attempt == 0:
            print_table(["tensor", "kind", "shape", "rule"], [[r[0], r[1], list(r[2]), r[3]] for r in report],
                        title=f"[{name}] randomized {len(report)} tensors (left derived buffers alone: "
                              f"{len(skipped)} rotary inv_freq buffers):")
            if paired:
                print(f"[{name}] indexer q_b_proj heads set to antipodal pairs (head 2i+1 = -head 2i): {paired}")
            nbytes = bf16_bytes(model)
            print(f"[{name}] bf16 parameter bytes: {nbytes} ({nbytes / 1024 / 1024:.3f} MiB); "
                  f"rounded {n_rounded} float tensors to bf16; attn_implementation="
                  f"{getattr(model.config, '_attn_implementation', None)} experts_implementation={impl}")
            if nbytes > MAX_SAFETENSORS_BYTES:
                raise RefError(f"bf16 weights {nbytes} B exceed the fixture budget {MAX_SAFETENSORS_BYTES} B")
        model.to(device)
        ids, chunks = make_inputs(seed, T, cfg.vocab_size, cfg.sliding_window, spec.get("extra_pieces", []),
                                  csa_rate, cfg.index_topk, has_csa)
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)

        probe = TopkProbe(model, hf)
        clamp = ClampProbe(model, hf)
        try:
            logits = forward_one_shot(model, ids_t, probe)
            probs = probe.problems()
            if not probs:
                logits_chunked = forward_chunked(hf, model, ids_t, chunks, probe)
                probs = probe.problems()
        finally:
            probe.remove()
            clamp.remove()

        if has_csa and sum(s["rows_selecting"] for s in probe.indexer.values()) == 0:
            raise RefError(f"no CSA layer ever has more valid entries than index_topk={cfg.index_topk} "
                           f"(T={T}, rate={csa_rate}): the case does not exercise top-k selection")
        if has_csa and not probe.indexer:
            raise RefError("config has CSA layers but no DeepseekV4Indexer module was found")
        gi, gr = probe.min_gaps()
        attempts.append((seed, gi, gr, "; ".join(probs) if probs else "ok"))
        if probs:
            print(f"[{name}] seed {seed}: near tie, trying the next seed:\n    " + "\n    ".join(probs))
            del model
            continue
        chosen = dict(seed=seed, model=model, cfg=cfg, ids=ids, chunks=chunks, logits=logits,
                      logits_chunked=logits_chunked, probe=probe, clamp=clamp, tries=attempt + 1)
        break
    if chosen is None:
        raise RefError(f"no seed without near ties in {args.max_tries} tries: {attempts[-5:]}")

    seed, model, cfg = chosen["seed"], chosen["model"], chosen["cfg"]
    ids, chunks = chosen["ids"], chosen["chunks"]
    logits, logits_chunked, probe, clamp = (chosen["logits"], chosen["logits_chunked"], chosen["probe"],
                                            chosen["clamp"])
    print(f"[{name}] seed {seed} accepted after {chosen['tries']} tr{'y' if chosen['tries'] == 1 else 'ies'}; "
          f"chunks ({len(chunks)}) = {chunks}")
    print_table(TopkProbe.TABLE_HEADERS, probe.table_rows(), title=f"[{name}] top-k margins (both runs):")
    cl = clamp.summary()
    print(f"[{name}] SwiGLU clamp hits (limit {cfg.swiglu_limit}): routed gate {cl['routed']['gate_hits']} "
          f"up {cl['routed']['up_hits']} of {cl['routed']['elems']}; shared gate {cl['shared']['gate_hits']} "
          f"up {cl['shared']['up_hits']} of {cl['shared']['elems']}")
    if spec.get("require_clamp"):
        if cl["routed"]["gate_hits"] + cl["routed"]["up_hits"] == 0 or \
                cl["shared"]["gate_hits"] + cl["shared"]["up_hits"] == 0:
            raise RefError(f"case requires the SwiGLU clamp to be active, hits: {cl}")

    if not torch.isfinite(logits).all() or not torch.isfinite(logits_chunked).all():
        raise RefError("non-finite logits")
    lstd = float(logits.double().std())
    print(f"[{name}] logits: shape {tuple(logits.shape)} std {lstd:.4f} "
          f"min {float(logits.min()):.3f} max {float(logits.max()):.3f}")
    if lstd < 1e-2:
        raise RefError(f"logits are degenerate (std {lstd})")
    chunk_err = rel_l2(logits_chunked, logits)
    chunk_maxrel = max_rel(logits_chunked, logits)
    print(f"[{name}] one-shot vs chunked HF logits: rel L2 {chunk_err:.3e}, max rel {chunk_maxrel:.3e}")
    if chunk_err >= CHUNK_REL_L2_TOL:
        per_pos = ((logits_chunked - logits).double().norm(dim=-1) / logits.double().norm(dim=-1)).cpu()
        worst = torch.topk(per_pos, min(5, per_pos.numel()))
        raise RefError(f"one-shot vs chunked rel L2 {chunk_err:.3e} >= {CHUNK_REL_L2_TOL:g}; worst positions "
                       f"{worst.indices.tolist()} rel {[f'{v:.2e}' for v in worst.values.tolist()]}")

    # ---- save into a staging directory, then verify by reloading ---------------------------
    os.makedirs(args.out, exist_ok=True)
    final_dir = os.path.join(args.out, name)
    stage = os.path.join(args.out, f".{name}.partial")
    if os.path.exists(stage):
        shutil.rmtree(stage)
    os.makedirs(stage)
    m_bf16 = copy.deepcopy(model).to("cpu").to(torch.bfloat16)
    try:
        m_bf16.save_pretrained(stage, safe_serialization=True)
    except TypeError as exc:
        if "safe_serialization" not in str(exc):
            raise
        m_bf16.save_pretrained(stage)
    del m_bf16
    files, st = safetensors_summary(stage)
    if files != ["model.safetensors"]:
        raise RefError(f"save_pretrained wrote {files}, expected a single model.safetensors")
    dtypes = {}
    for key, (dt, _) in st.items():
        dtypes.setdefault(dt, []).append(key)
    print(f"[{name}] model.safetensors: {len(st)} tensors, dtypes "
          f"{ {k: len(v) for k, v in dtypes.items()} }")
    not_bf16 = [k for k, (dt, _) in st.items() if dt not in ("BF16", "bfloat16", "torch.bfloat16")
                and not k.endswith("tid2eid")]
    bad_tid = [k for k, (dt, _) in st.items() if k.endswith("tid2eid") and dt not in ("I64", "int64", "torch.int64")]
    if not_bf16:
        print(f"[{name}] WARNING: tensors not stored as bf16: {not_bf16}")
    if bad_tid:
        raise RefError(f"tid2eid not stored as int64: {[(k, st[k][0]) for k in bad_tid]}")
    with open(os.path.join(stage, "config.json")) as f:
        saved_cfg = json.load(f)
    print(f"[{name}] config.json dtype={saved_cfg.get('dtype', saved_cfg.get('torch_dtype'))} "
          f"transformers_version={saved_cfg.get('transformers_version')}")

    # config.json must load and mean the same thing.
    try:
        cfg_re = hf.Config.from_pretrained(stage)
    except Exception as exc:  # noqa: BLE001
        raise RefError(f"DeepseekV4Config.from_pretrained(saved dir) failed: {exc}") from exc
    fp0, fp1 = config_fingerprint(cfg), config_fingerprint(cfg_re)
    diff = {k: (fp0[k], fp1.get(k)) for k in fp0 if not _close(fp0[k], fp1.get(k))}
    if diff:
        raise RefError(f"config.json round trip changed: {diff}")

    model_re, info = load_hf_model(hf, stage, args.experts_impl)
    errs, notes = check_loading_info(info, "reload")
    for n in notes:
        print(f"[{name}] loading note: {n}")
    if errs:
        raise RefError("reloading the saved directory reported:\n  " + "\n  ".join(errs))
    sd0 = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    sd1 = {k: v.detach().cpu() for k, v in model_re.state_dict().items()}
    if set(sd0) != set(sd1):
        raise RefError(f"state_dict keys differ after reload: only original {sorted(set(sd0) - set(sd1))}, "
                       f"only reloaded {sorted(set(sd1) - set(sd0))}")
    neq = [k for k in sd0 if sd0[k].dtype != sd1[k].dtype or not torch.equal(sd0[k], sd1[k])]
    if neq:
        raise RefError(f"reloaded tensors differ from the ones the goldens came from: {neq[:10]}")
    bufs0 = dict(nonpersistent_buffers(model))
    bufs1 = dict(nonpersistent_buffers(model_re))
    bneq = [k for k in bufs0 if k not in bufs1 or not torch.equal(bufs0[k].cpu().float(), bufs1[k].cpu().float())]
    if bneq:
        raise RefError(f"derived rotary buffers differ after reload (config round trip?): {bneq[:10]}")
    model_re.to(device)
    ids_t = torch.tensor(ids, dtype=torch.long, device=device)
    logits_re = forward_one_shot(model_re, ids_t)
    reload_maxrel = max_rel(logits_re, logits)
    print(f"[{name}] reloaded dir vs golden logits: max rel {reload_maxrel:.3e}")
    if reload_maxrel >= RELOAD_MAX_REL_TOL:
        raise RefError(f"reloaded model reproduces the logits only to max rel {reload_maxrel:.3e} "
                       f">= {RELOAD_MAX_REL_TOL:g}")
    del model_re

    gi, gr = probe.min_gaps()
    golden = dict(
        case=name,
        seed=int(seed),
        ids=[int(i) for i in ids],
        chunks=[int(c) for c in chunks],
        description=spec["description"],
        transformers_version=hf.version,
        torch_version=torch.__version__,
        min_topk_gap=dict(indexer=gi, router=gr),
        T=len(ids),
        vocab_size=int(cfg.vocab_size),
        device=str(device),
        layer_types=list(cfg.layer_types),
        mlp_layer_types=list(cfg.mlp_layer_types),
        compress_rates=dict(cfg.compress_rates),
        checks=dict(
            tie_threshold=TIE_REL_THRESHOLD,
            seed_tries=chosen["tries"],
            indexer_q_heads=("antipodal pairs: q_b_proj rows of head 2i+1 = -(head 2i)"
                             if spec.get("antipodal_index_heads", True) else "independent"),
            oneshot_vs_chunked_rel_l2=chunk_err,
            oneshot_vs_chunked_max_rel=chunk_maxrel,
            reload_max_rel=reload_maxrel,
            topk=probe.summary(),
            swiglu_clamp=cl,
            experts_implementation=getattr(model.config, "_experts_implementation", None),
            logits_std=lstd,
        ),
    )
    with open(os.path.join(stage, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    np.save(os.path.join(stage, "logits.npy"), logits.cpu().numpy().astype(np.float32))
    np.save(os.path.join(stage, "logits_chunked.npy"), logits_chunked.cpu().numpy().astype(np.float32))

    # Move the verified staging dir into place.
    if os.path.isdir(final_dir):
        remove_fixture_files(final_dir)
        leftovers = os.listdir(final_dir)
        if leftovers:
            raise RefError(f"{final_dir} contains unexpected files {leftovers}; not overwriting it")
        os.rmdir(final_dir)
    os.replace(stage, final_dir)
    sizes = {f: os.path.getsize(os.path.join(final_dir, f)) for f in sorted(os.listdir(final_dir))}
    total = sum(sizes.values())
    st_bytes = sizes.get("model.safetensors", 0)
    print(f"[{name}] wrote {final_dir}: " + ", ".join(f"{k} {v}" for k, v in sizes.items()) +
          f"; total {total / 1024 / 1024:.3f} MiB")
    if st_bytes > MAX_SAFETENSORS_BYTES:
        raise RefError(f"model.safetensors is {st_bytes} B > {MAX_SAFETENSORS_BYTES} B")
    return dict(case=name, status="ok", seed=seed, tries=chosen["tries"], T=len(ids), chunks=len(chunks),
                weights=st_bytes, total=total, gap_i=gi, gap_r=gr, chunk_err=chunk_err, reload=reload_maxrel,
                clamp=cl["routed"]["gate_hits"] + cl["routed"]["up_hits"] + cl["shared"]["gate_hits"]
                + cl["shared"]["up_hits"], secs=time.time() - t0)


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory; one subdirectory per case")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list (default: all of {list(CASES)})")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="default: cuda if available, else cpu")
    ap.add_argument("--max-tries", type=int, default=50, help="seeds to try per case before giving up")
    ap.add_argument("--seed-offset", type=int, default=0, help="added to every case's base seed")
    ap.add_argument("--experts-impl", default="eager",
                    help="routed experts backend to pin (default eager; 'default' leaves HF's choice)")
    args = ap.parse_args(argv)

    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    try:
        device = setup_torch(args.device)
        hf = HF()
    except RefError as exc:
        print(f"FATAL: {exc}", file=sys.stderr)
        return 2
    print(f"transformers {hf.version} ({hf.modeling_file})")

    results = []
    with torch.no_grad():
        for name in names:
            try:
                results.append(run_case(name, CASES[name], args, hf, device))
            except RefError as exc:
                print(f"[{name}] FAILED: {exc}", flush=True)
                results.append(dict(case=name, status="FAILED", error=str(exc)))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                print(f"[{name}] FAILED with {type(exc).__name__}: {exc} (unexpected; HF API differs?)", flush=True)
                results.append(dict(case=name, status="FAILED", error=f"{type(exc).__name__}: {exc}"))

    print("=" * 100)
    rows = []
    for r in results:
        if r["status"] == "ok":
            rows.append([r["case"], "ok", r["seed"], r["tries"], r["T"], r["chunks"], f"{r['weights'] / 1024:.0f}K",
                         f"{r['total'] / 1024:.0f}K", fmt_g(r["gap_i"]), fmt_g(r["gap_r"]), fmt_g(r["chunk_err"]),
                         fmt_g(r["reload"]), r["clamp"], f"{r['secs']:.1f}"])
        else:
            rows.append([r["case"], "FAILED"] + ["-"] * 12)
    print_table(["case", "status", "seed", "tries", "T", "chunks", "weights", "dir", "min gap idx", "min gap router",
                 "1shot~chunk relL2", "reload maxrel", "clamp hits", "s"], rows, title="SUMMARY")
    failed = [r for r in results if r["status"] != "ok"]
    for r in failed:
        print(f"  {r['case']}: {r['error']}")
    print(f"{len(results) - len(failed)}/{len(results)} cases written to {os.path.abspath(args.out)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
