"""Shared helpers for the HF DeepSeek-V4 reference scripts (make_goldens.py, check_hf_load.py).

Everything here talks to `transformers.models.deepseek_v4` (transformers 5.17). Whenever HF's API
does not look the way these scripts expect, a RefError with a readable message is raised instead
of letting a stray AttributeError escape from deep inside a hook.
"""

from __future__ import annotations

import math
import os
import sys

try:
    import numpy as np
    import torch
except ImportError as exc:  # pragma: no cover - depends on the machine
    sys.stderr.write(
        f"FATAL: this script needs torch and numpy ({exc}). Run it on the GPU machine "
        "(torch 2.11, transformers 5.17, safetensors 0.8).\n"
    )
    sys.exit(2)

EXPECTED_TRANSFORMERS = "5.17"

# Relative top-k margin below which a selection is called a near tie.
TIE_REL_THRESHOLD = 1e-4


class RefError(RuntimeError):
    """A check failed or HF's API is not what we expect. The message says which."""


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


class HF:
    """Namespace holding the imported HF classes (so a missing one is reported once, clearly)."""

    MODULE_CLASSES = (
        "DeepseekV4RMSNorm",
        "DeepseekV4RotaryEmbedding",
        "DeepseekV4Attention",
        "DeepseekV4HCACompressor",
        "DeepseekV4CSACompressor",
        "DeepseekV4Indexer",
        "DeepseekV4IndexerScorer",
        "DeepseekV4HyperConnection",
        "DeepseekV4HyperHead",
        "DeepseekV4MLP",
        "DeepseekV4Experts",
        "DeepseekV4TopKRouter",
        "DeepseekV4HashRouter",
    )

    def __init__(self):
        try:
            import transformers
        except ImportError as exc:
            raise RefError(f"cannot import transformers: {exc}") from exc
        self.transformers = transformers
        self.version = transformers.__version__
        try:
            from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
        except ImportError as exc:
            raise RefError(
                f"transformers {self.version} has no DeepseekV4Config/DeepseekV4ForCausalLM ({exc}); "
                f"these scripts were written against transformers {EXPECTED_TRANSFORMERS}"
            ) from exc
        try:
            from transformers.cache_utils import DynamicCache
        except ImportError as exc:
            raise RefError(f"cannot import transformers.cache_utils.DynamicCache: {exc}") from exc
        try:
            import transformers.models.deepseek_v4.modeling_deepseek_v4 as mdl
        except ImportError as exc:
            raise RefError(f"cannot import transformers.models.deepseek_v4.modeling_deepseek_v4: {exc}") from exc
        missing = [n for n in self.MODULE_CLASSES if not hasattr(mdl, n)]
        if missing:
            raise RefError(
                f"transformers {self.version}: modeling_deepseek_v4 lacks {missing}; the hooks in these "
                f"scripts were written against transformers {EXPECTED_TRANSFORMERS}"
            )
        self.Config = DeepseekV4Config
        self.Model = DeepseekV4ForCausalLM
        self.DynamicCache = DynamicCache
        self.mdl = mdl
        self.modeling_file = getattr(mdl, "__file__", "?")
        if not self.version.startswith(EXPECTED_TRANSFORMERS):
            print(
                f"WARNING: transformers {self.version} != expected {EXPECTED_TRANSFORMERS}.x; "
                "results may not match the C++ goldens' assumptions",
                flush=True,
            )

    def cls(self, name):
        return getattr(self.mdl, name)


def setup_torch(device_arg):
    """Disable TF32 everywhere and pick the device (cuda if available unless told otherwise)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        torch.set_float32_matmul_precision("highest")
    except Exception as exc:  # noqa: BLE001 - informational only
        print(f"WARNING: torch.set_float32_matmul_precision('highest') failed: {exc}")
    if device_arg is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device_arg == "cuda":
        if not torch.cuda.is_available():
            raise RefError("--device cuda was requested but torch.cuda.is_available() is False")
        device = "cuda"
    elif device_arg == "cpu":
        device = "cpu"
    else:
        raise RefError(f"unknown device {device_arg!r}")
    try:
        tf32_mm = torch.backends.cuda.matmul.allow_tf32
        tf32_cudnn = torch.backends.cudnn.allow_tf32
    except Exception as exc:  # noqa: BLE001
        tf32_mm = tf32_cudnn = f"<unreadable: {exc}>"
    if tf32_mm is True or tf32_cudnn is True:
        raise RefError(f"TF32 is still enabled (matmul={tf32_mm}, cudnn={tf32_cudnn})")
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}  device={device} ({name})  allow_tf32: matmul={tf32_mm} cudnn={tf32_cudnn}  "
        f"float32_matmul_precision={torch.get_float32_matmul_precision()}",
        flush=True,
    )
    return torch.device(device)


def force_experts_impl(model, impl):
    """Pin the routed-experts backend (default 'eager': the plain fp32 per-expert loop).

    transformers 5.x defaults MoE experts to 'grouped_mm'; the eager loop is the unambiguous
    fp32 reference. Returns the implementation recorded on the config afterwards.
    """
    if impl in (None, "", "default"):
        return getattr(model.config, "_experts_implementation", None)
    setter = getattr(model, "set_experts_implementation", None)
    if callable(setter):
        try:
            setter(impl)
        except Exception as exc:  # noqa: BLE001
            raise RefError(f"model.set_experts_implementation({impl!r}) failed: {exc}") from exc
    else:
        model.config._experts_implementation = impl
    got = getattr(model.config, "_experts_implementation", None)
    if got != impl:
        raise RefError(f"could not set experts implementation to {impl!r} (config says {got!r})")
    return got


# --------------------------------------------------------------------------------------------
# Numerics
# --------------------------------------------------------------------------------------------


def rel_l2(test, ref):
    """||test - ref|| / ||ref|| accumulated in float64 over all entries."""
    t = torch.as_tensor(test).double().cpu()
    r = torch.as_tensor(ref).double().cpu()
    if t.shape != r.shape:
        raise RefError(f"shape mismatch in rel_l2: {tuple(t.shape)} vs {tuple(r.shape)}")
    den = float(r.norm())
    return float((t - r).norm()) / max(den, 1e-300)


def max_rel(test, ref):
    """max|test - ref| / max|ref| in float64."""
    t = torch.as_tensor(test).double().cpu()
    r = torch.as_tensor(ref).double().cpu()
    if t.shape != r.shape:
        raise RefError(f"shape mismatch in max_rel: {tuple(t.shape)} vs {tuple(r.shape)}")
    return float((t - r).abs().max()) / max(float(r.abs().max()), 1e-300)


def fmt_g(x, nd=3):
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    return f"{x:.{nd}e}"


def print_table(headers, rows, title=None):
    rows = [[("-" if c is None else str(c)) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    if title:
        print(title)
    line = "  ".join(h.ljust(widths[i]) for i, h in enumerate(headers))
    print(line)
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)))
    sys.stdout.flush()


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def check_loading_info(info, label):
    """Return (errors, notes) for the dict from from_pretrained(..., output_loading_info=True)."""
    if not isinstance(info, dict):
        raise RefError(f"{label}: output_loading_info did not return a dict (got {type(info).__name__})")
    errors, notes = [], []
    must_be_empty = ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
    for key in must_be_empty:
        if key not in info:
            notes.append(f"loading info has no '{key}' entry (HF API changed?)")
    for key, val in info.items():
        items = list(val) if isinstance(val, (list, tuple, set)) else ([val] if val else [])
        if not items:
            continue
        if key == "missing_keys":
            benign = [k for k in items if "inv_freq" in str(k)]
            real = [k for k in items if "inv_freq" not in str(k)]
            if benign:
                notes.append(f"benign missing keys (derived rotary buffers): {sorted(map(str, benign))}")
            if real:
                errors.append(f"missing_keys ({len(real)}): {sorted(map(str, real))}")
        elif key in must_be_empty:
            errors.append(f"{key} ({len(items)}): {[str(x) for x in items]}")
        else:
            notes.append(f"other loading info '{key}': {[str(x) for x in items]}")
    return errors, notes


def load_hf_model(hf, model_dir, experts_impl):
    """from_pretrained in float32 with loading info. Returns (model, info)."""
    try:
        out = hf.Model.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    except Exception as exc:  # noqa: BLE001
        raise RefError(f"DeepseekV4ForCausalLM.from_pretrained({model_dir!r}, dtype=float32) raised: "
                       f"{type(exc).__name__}: {exc}") from exc
    if not (isinstance(out, tuple) and len(out) == 2):
        raise RefError("from_pretrained(..., output_loading_info=True) did not return (model, info)")
    model, info = out
    model.eval()
    force_experts_impl(model, experts_impl)
    return model, info


def safetensors_summary(model_dir):
    """{name: (dtype_str, shape)} over every *.safetensors file in model_dir."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise RefError(f"cannot import safetensors: {exc}") from exc
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise RefError(f"no *.safetensors file in {model_dir}")
    out = {}
    for fname in files:
        with safe_open(os.path.join(model_dir, fname), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                out[key] = (str(sl.get_dtype()), tuple(sl.get_shape()))
    return files, out


# --------------------------------------------------------------------------------------------
# Top-k margin probes (indexer + learned router) and SwiGLU clamp probes
# --------------------------------------------------------------------------------------------


class TopkProbe:
    """Forward hooks measuring how far the indexer / router top-k boundaries are from a tie.

    Indexer: hook on every DeepseekV4IndexerScorer (its output are the raw index scores
    [B, S, T_entries] before HF masks them). Query at absolute position p sees entry j iff
    j < (p + 1) // compress_rate; p = self.offset + s (set self.offset to the position of the
    first token of each forward call). For rows with more valid entries than
    k = min(index_topk, T_entries): gap = k-th - (k+1)-th largest valid score, relative to
    max(|k-th|, 1e-6). A hook on the parent DeepseekV4Indexer then checks that HF's selected set
    equals ours on every row whose gap is clear (proves the hook reads what HF selects from).

    Router: hook on every DeepseekV4TopKRouter; scores = score_fn(logits) + e_score_correction_bias,
    gap between the top_k-th and (top_k+1)-th, relative to max(|top_k-th|, 1e-6); HF's chosen
    indices are checked against ours likewise.
    """

    def __init__(self, model, hf):
        self.offset = 0
        self.handles = []
        self.indexer = {}  # layer name -> stats
        self.router = {}
        self._pending = {}
        Indexer = hf.cls("DeepseekV4Indexer")
        Scorer = hf.cls("DeepseekV4IndexerScorer")
        Router = hf.cls("DeepseekV4TopKRouter")
        for name, mod in model.named_modules():
            if isinstance(mod, Indexer):
                scorer = getattr(mod, "scorer", None)
                if not isinstance(scorer, Scorer):
                    raise RefError(f"{name}: DeepseekV4Indexer has no DeepseekV4IndexerScorer at .scorer")
                for attr in ("compress_rate", "index_topk"):
                    if not hasattr(mod, attr):
                        raise RefError(f"{name}: DeepseekV4Indexer lacks .{attr}")
                self.indexer[name] = dict(rate=int(mod.compress_rate), topk=int(mod.index_topk), calls=0,
                                          rows=0, rows_selecting=0, max_entries=0, min_rel=math.inf,
                                          min_at=None, exact_ties=0, checked_rows=0)
                self.handles.append(scorer.register_forward_hook(self._scorer_hook(name)))
                self.handles.append(mod.register_forward_hook(self._indexer_hook(name)))
            elif isinstance(mod, Router):
                for attr in ("top_k", "score_fn", "e_score_correction_bias"):
                    if not hasattr(mod, attr):
                        raise RefError(f"{name}: DeepseekV4TopKRouter lacks .{attr}")
                self.router[name] = dict(top_k=int(mod.top_k), calls=0, rows=0, min_rel=math.inf,
                                         min_at=None, checked_rows=0)
                self.handles.append(mod.register_forward_hook(self._router_hook(name)))

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    # -- indexer ------------------------------------------------------------------------------
    def _scorer_hook(self, name):
        def hook(module, inputs, output):
            st = self.indexer[name]
            if not torch.is_tensor(output) or output.dim() != 3:
                raise RefError(f"{name}.scorer output is not a [B, S, T] tensor "
                               f"(got {type(output).__name__} {getattr(output, 'shape', None)})")
            scores = output.detach()
            bsz, seq, n_ent = scores.shape
            st["calls"] += 1
            st["rows"] += bsz * seq
            st["max_entries"] = max(st["max_entries"], n_ent)
            self._pending[name] = None
            k = min(st["topk"], n_ent)
            if n_ent <= k or k == 0:
                return
            pos = self.offset + torch.arange(seq, device=scores.device)
            n_valid = torch.clamp((pos + 1) // st["rate"], max=n_ent)  # [S]
            sel = n_valid > k
            n_sel = int(sel.sum())
            if n_sel == 0:
                return
            st["rows_selecting"] += n_sel * bsz
            s = scores.double()
            invalid = torch.arange(n_ent, device=s.device)[None, :] >= n_valid[:, None]  # [S, T]
            s = s.masked_fill(invalid[None], float("-inf"))
            vals, idx = s.topk(k + 1, dim=-1)  # [B, S, k+1]
            kth, nxt = vals[..., k - 1], vals[..., k]
            gap = kth - nxt
            rel = gap / kth.abs().clamp_min(1e-6)
            rel = torch.where(sel[None, :], rel, torch.full_like(rel, math.inf))
            st["exact_ties"] += int(((gap == 0) & sel[None, :]).sum())
            m = float(rel.min())
            if m < st["min_rel"]:
                flat = int(rel.argmin())
                b, srow = divmod(flat, seq)
                st["min_rel"] = m
                st["min_at"] = dict(pos=int(self.offset + srow), batch=b, kth=float(kth[b, srow]),
                                    next=float(nxt[b, srow]), n_valid=int(n_valid[srow]), k=k)
            self._pending[name] = (sel, idx[..., :k], rel)

        return hook

    def _indexer_hook(self, name):
        def hook(module, inputs, output):
            pend = self._pending.pop(name, None)
            if pend is None:
                return
            if not torch.is_tensor(output) or output.dim() != 3:
                raise RefError(f"{name}: DeepseekV4Indexer output is not [B, S, k] indices")
            sel, ours, rel = pend
            if output.shape[:2] != ours.shape[:2] or output.shape[-1] != ours.shape[-1]:
                raise RefError(f"{name}: HF indexer returned {tuple(output.shape)} indices, probe expected "
                               f"{tuple(ours.shape)}; HF's top-k semantics changed")
            clear = sel[None, :] & (rel >= TIE_REL_THRESHOLD)
            hf_sorted = output.sort(dim=-1).values
            ours_sorted = ours.sort(dim=-1).values
            same = (hf_sorted == ours_sorted).all(dim=-1)
            bad = clear & ~same
            self.indexer[name]["checked_rows"] += int(clear.sum())
            if bool(bad.any()):
                b, s = [int(v) for v in bad.nonzero()[0]]
                raise RefError(f"{name}: HF's indexer selection differs from the probe's at position "
                               f"{self.offset + s} (HF {hf_sorted[b, s].tolist()} vs probe "
                               f"{ours_sorted[b, s].tolist()}) although the margin is clear: the probe's "
                               "understanding of the indexer masking is wrong")

        return hook

    # -- router -------------------------------------------------------------------------------
    def _router_hook(self, name):
        def hook(module, inputs, output):
            st = self.router[name]
            if not (isinstance(output, tuple) and len(output) == 3):
                raise RefError(f"{name}: DeepseekV4TopKRouter output is not (logits, weights, indices)")
            logits, _, hf_idx = output
            k = st["top_k"]
            n_exp = logits.shape[-1]
            st["calls"] += 1
            st["rows"] += logits.shape[0]
            if n_exp <= k:
                return
            scores = module.score_fn(logits.detach()) + module.e_score_correction_bias
            vals, idx = scores.double().topk(k + 1, dim=-1)
            kth, nxt = vals[:, k - 1], vals[:, k]
            rel = (kth - nxt) / kth.abs().clamp_min(1e-6)
            m = float(rel.min())
            if m < st["min_rel"]:
                r = int(rel.argmin())
                st["min_rel"] = m
                st["min_at"] = dict(row=r, pos=int(self.offset + r), kth=float(kth[r]), next=float(nxt[r]))
            clear = rel >= TIE_REL_THRESHOLD
            same = (hf_idx.sort(dim=-1).values == idx[:, :k].sort(dim=-1).values).all(dim=-1)
            st["checked_rows"] += int(clear.sum())
            if bool((clear & ~same).any()):
                r = int((clear & ~same).nonzero()[0, 0])
                raise RefError(f"{name}: HF router picked {sorted(hf_idx[r].tolist())}, probe "
                               f"{sorted(idx[r, :k].tolist())} at row {r}: the probe's score formula is wrong")

        return hook

    # -- results ------------------------------------------------------------------------------
    def min_gaps(self):
        ind = min((s["min_rel"] for s in self.indexer.values()), default=math.inf)
        rou = min((s["min_rel"] for s in self.router.values()), default=math.inf)
        return (None if math.isinf(ind) else ind), (None if math.isinf(rou) else rou)

    def problems(self, threshold=TIE_REL_THRESHOLD):
        out = []
        for name, s in self.indexer.items():
            if s["exact_ties"]:
                out.append(f"indexer {name}: {s['exact_ties']} exact tie(s) at the top-k boundary")
            if s["min_rel"] < threshold:
                out.append(f"indexer {name}: min relative gap {s['min_rel']:.3e} < {threshold:g} at {s['min_at']}")
        for name, s in self.router.items():
            if s["min_rel"] < threshold:
                out.append(f"router {name}: min relative gap {s['min_rel']:.3e} < {threshold:g} at {s['min_at']}")
        return out

    def table_rows(self):
        rows = []
        for name, s in self.indexer.items():
            rows.append([name, "indexer", f"m={s['rate']} k={s['topk']}", s["calls"], s["rows"],
                         s["rows_selecting"], s["max_entries"], fmt_g(None if math.isinf(s["min_rel"]) else s["min_rel"]),
                         s["checked_rows"]])
        for name, s in self.router.items():
            rows.append([name, "router", f"top_k={s['top_k']}", s["calls"], s["rows"], s["rows"], "-",
                         fmt_g(None if math.isinf(s["min_rel"]) else s["min_rel"]), s["checked_rows"]])
        return rows

    TABLE_HEADERS = ["module", "kind", "param", "calls", "rows", "rows w/ real top-k", "max entries",
                     "min rel gap", "rows HF==probe"]

    def summary(self):
        def clean(d):
            return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}

        return dict(indexer={k: clean(v) for k, v in self.indexer.items()},
                    router={k: clean(v) for k, v in self.router.items()})


class ClampProbe:
    """Counts SwiGLU clamp hits: routed experts (wrapping DeepseekV4Experts._apply_gate, which every
    experts backend calls on the packed gate_up) and the shared expert (hooks on gate_proj/up_proj).
    gate is clamped from above only, up on both sides (|up| > limit)."""

    def __init__(self, model, hf):
        self.handles = []
        self.wrapped = []
        self.routed = dict(gate_hits=0, up_hits=0, elems=0, calls=0)
        self.shared = dict(gate_hits=0, up_hits=0, elems=0, calls=0)
        Experts = hf.cls("DeepseekV4Experts")
        MLP = hf.cls("DeepseekV4MLP")
        for name, mod in model.named_modules():
            if isinstance(mod, Experts):
                if not hasattr(mod, "_apply_gate") or not hasattr(mod, "limit"):
                    raise RefError(f"{name}: DeepseekV4Experts lacks _apply_gate/limit")
                orig = mod._apply_gate
                limit = float(mod.limit)

                def wrapped(gate_up, _orig=orig, _limit=limit):
                    gate, up = gate_up.chunk(2, dim=-1)
                    self.routed["gate_hits"] += int((gate > _limit).sum())
                    self.routed["up_hits"] += int((up.abs() > _limit).sum())
                    self.routed["elems"] += gate.numel()
                    self.routed["calls"] += 1
                    return _orig(gate_up)

                mod._apply_gate = wrapped
                self.wrapped.append(mod)
            elif isinstance(mod, MLP):
                limit = float(mod.limit)

                def g_hook(m, i, o, _limit=limit):
                    self.shared["gate_hits"] += int((o > _limit).sum())
                    self.shared["elems"] += o.numel()
                    self.shared["calls"] += 1

                def u_hook(m, i, o, _limit=limit):
                    self.shared["up_hits"] += int((o.abs() > _limit).sum())

                self.handles.append(mod.gate_proj.register_forward_hook(g_hook))
                self.handles.append(mod.up_proj.register_forward_hook(u_hook))

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []
        for mod in self.wrapped:
            if "_apply_gate" in mod.__dict__:
                del mod.__dict__["_apply_gate"]
        self.wrapped = []

    def summary(self):
        return dict(routed=dict(self.routed), shared=dict(self.shared))


# --------------------------------------------------------------------------------------------
# Tensor tables
# --------------------------------------------------------------------------------------------


def tensor_stats(t):
    t = t.detach().cpu()
    if t.is_floating_point():
        td = t.double()
        std = float(td.std()) if t.numel() > 1 else 0.0
        return dict(std=std, mean=float(td.mean()), min=float(td.min()), max=float(td.max()))
    return dict(std=None, mean=None, min=int(t.min()), max=int(t.max()))


def persistent_tensors(model):
    """[(full_name, tensor, kind)] for parameters and persistent buffers (what state_dict holds)."""
    out = []
    for mod_name, mod in model.named_modules():
        for attr, p in mod.named_parameters(recurse=False):
            out.append((f"{mod_name}.{attr}" if mod_name else attr, p, "param"))
        for attr, b in mod.named_buffers(recurse=False):
            if attr in getattr(mod, "_non_persistent_buffers_set", set()):
                continue
            out.append((f"{mod_name}.{attr}" if mod_name else attr, b, "buffer"))
    return out


def nonpersistent_buffers(model):
    out = []
    for mod_name, mod in model.named_modules():
        for attr, b in mod.named_buffers(recurse=False):
            if attr in getattr(mod, "_non_persistent_buffers_set", set()):
                out.append((f"{mod_name}.{attr}" if mod_name else attr, b))
    return out
