#!/usr/bin/env python3
"""Check that a model directory (e.g. written by `dsv4 init-random`) loads cleanly in HF
transformers' DeepseekV4ForCausalLM, holds real random values, and (optionally) that our logits
match HF's.

Usage:
    python3 tools/reference/check_hf_load.py MODEL_DIR [--ids 1,2,3 | --ids @ids.txt]
        [--logits OURS.npy] [--device cuda|cpu] [--tol 1e-4] [--save-logits HF.npy]

Steps (each failure makes the exit status non-zero):
  1. list the safetensors tensors and their dtypes;
  2. DeepseekV4ForCausalLM.from_pretrained(MODEL_DIR, dtype=float32, output_loading_info=True):
     missing / unexpected / mismatched keys or error messages fail the check;
  3. table of every parameter / persistent buffer (shape, dtype, std, mean, min, max); the tensors
     that HF initialises to constants (sinks, position_bias, e_score_correction_bias, mHC base)
     must not be all-zero or all-one; every tid2eid row must hold distinct expert ids;
  4. fp32 forward on the ids (default: 64 ids drawn with torch.Generator().manual_seed(0)),
     reporting the indexer / router top-k margins; with --logits, rel L2 ||ours-hf||/||hf|| over
     all positions must be <= --tol (1e-4: both sides compute in fp32 from the same weights).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dsv4_hf_common import (  # noqa: E402
    HF,
    TIE_REL_THRESHOLD,
    RefError,
    TopkProbe,
    check_loading_info,
    fmt_g,
    load_hf_model,
    max_rel,
    np,
    persistent_tensors,
    print_table,
    rel_l2,
    safetensors_summary,
    setup_torch,
    tensor_stats,
    torch,
)

# Tensors HF initialises to zeros/ones which we promise to fill with random values.
PROMISED_RANDOM_SUFFIXES = (
    ".sinks",
    ".position_bias",
    ".e_score_correction_bias",
    "attn_hc.base",
    "ffn_hc.base",
    "hc_head.hc_base",
)


def parse_ids(spec, vocab, n_random, seed):
    if spec is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (n_random,), generator=gen, dtype=torch.long).tolist(), \
            f"{n_random} random ids (torch.Generator().manual_seed({seed}), randint(0, {vocab}))"
    text = spec
    src = "--ids"
    if spec.startswith("@"):
        with open(spec[1:]) as f:
            text = f.read()
        src = spec[1:]
    parts = [p for p in text.replace("\n", ",").replace(" ", ",").split(",") if p.strip()]
    try:
        ids = [int(p) for p in parts]
    except ValueError as exc:
        raise RefError(f"cannot parse ids from {src}: {exc}") from exc
    if not ids:
        raise RefError(f"no ids in {src}")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise RefError(f"ids out of range [0, {vocab}): {bad[:10]}")
    return ids, f"{len(ids)} ids from {src}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--ids", default=None, help="comma-separated token ids, or @FILE (commas/whitespace)")
    ap.add_argument("--n-random-ids", type=int, default=64, help="number of random ids when --ids is absent")
    ap.add_argument("--ids-seed", type=int, default=0, help="seed of the random ids when --ids is absent")
    ap.add_argument("--logits", default=None, help="our logits, .npy float32 [T, vocab] (dsv4 forward --dump-logits)")
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative L2 error vs HF (default 1e-4)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    ap.add_argument("--save-logits", default=None, help="write HF's fp32 logits [T, vocab] to this .npy")
    ap.add_argument("--experts-impl", default="eager",
                    help="routed experts backend to pin (default eager; 'default' leaves HF's choice)")
    ap.add_argument("--quiet-table", action="store_true", help="do not print the per-tensor table")
    args = ap.parse_args(argv)

    failures, warnings = [], []
    summary = []

    def fail(msg):
        failures.append(msg)
        print(f"FAIL: {msg}", flush=True)

    def warn(msg):
        warnings.append(msg)
        print(f"WARNING: {msg}", flush=True)

    try:
        device = setup_torch(args.device)
        hf = HF()
        print(f"transformers {hf.version} ({hf.modeling_file})")
        if not os.path.isdir(args.model_dir):
            raise RefError(f"{args.model_dir} is not a directory")
        if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
            raise RefError(f"{args.model_dir} has no config.json")

        # ---- 1. files ---------------------------------------------------------------------
        files, st = safetensors_summary(args.model_dir)
        by_dtype = {}
        for key, (dt, _) in st.items():
            by_dtype[dt] = by_dtype.get(dt, 0) + 1
        print(f"[files] {files}: {len(st)} tensors, dtypes {by_dtype}")
        if len(files) > 1 and not os.path.isfile(os.path.join(args.model_dir, "model.safetensors.index.json")):
            warn("several .safetensors files but no model.safetensors.index.json")
        mtp = sorted(k for k in st if k.startswith("mtp.") or ".mtp." in k)
        if mtp:
            print(f"[files] {len(mtp)} MTP tensors present; HF ignores them by design "
                  f"(_keys_to_ignore_on_load_unexpected), e.g. {mtp[:3]}")
        summary.append(["safetensors", f"{len(st)} tensors {by_dtype}", "ok"])

        # ---- 2. config + load ---------------------------------------------------------------
        try:
            cfg = hf.Config.from_pretrained(args.model_dir)
        except Exception as exc:  # noqa: BLE001
            raise RefError(f"DeepseekV4Config.from_pretrained failed: {type(exc).__name__}: {exc}") from exc
        print(f"[config] layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} heads={cfg.num_attention_heads} "
              f"head_dim={cfg.head_dim} qk_rope_head_dim={getattr(cfg, 'qk_rope_head_dim', None)} "
              f"vocab={cfg.vocab_size} window={cfg.sliding_window}")
        print(f"[config] layer_types={list(cfg.layer_types)}")
        print(f"[config] mlp_layer_types={list(cfg.mlp_layer_types)} compress_rates={dict(cfg.compress_rates)}")
        print(f"[config] rope_parameters={cfg.rope_parameters}")
        print(f"[config] experts {cfg.n_routed_experts} top-{cfg.num_experts_per_tok} scoring={cfg.scoring_func} "
              f"routed_scaling_factor={cfg.routed_scaling_factor} swiglu_limit={cfg.swiglu_limit} "
              f"index_topk={cfg.index_topk} hc_mult={cfg.hc_mult} sinkhorn_iters={cfg.hc_sinkhorn_iters}")

        model, info = load_hf_model(hf, args.model_dir, args.experts_impl)
        errs, notes = check_loading_info(info, "load")
        for n in notes:
            print(f"[load] note: {n}")
        for e in errs:
            fail(f"from_pretrained: {e}")
        summary.append(["from_pretrained", f"{len(errs)} problem(s), {len(notes)} note(s)",
                        "ok" if not errs else "FAIL"])
        print(f"[load] attn_implementation={getattr(model.config, '_attn_implementation', None)} "
              f"experts_implementation={getattr(model.config, '_experts_implementation', None)}")

        # ---- 3. tensor table + value checks -------------------------------------------------
        rows, n_bad_values = [], 0
        tensors = persistent_tensors(model)
        for name, t, kind in tensors:
            s = tensor_stats(t)
            rows.append([name, kind, list(t.shape), str(t.dtype).replace("torch.", ""), fmt_g(s["std"]),
                         fmt_g(s["mean"]) if s["mean"] is not None else "-",
                         f"{s['min']:.4g}" if isinstance(s["min"], float) else s["min"],
                         f"{s['max']:.4g}" if isinstance(s["max"], float) else s["max"]])
            if t.is_floating_point():
                if not torch.isfinite(t).all():
                    fail(f"{name} has non-finite values")
                    n_bad_values += 1
                    continue
                all_zero = bool((t == 0).all())
                all_one = bool((t == 1).all())
                if name.endswith(PROMISED_RANDOM_SUFFIXES):
                    if all_zero or all_one:
                        fail(f"{name} is all {'zeros' if all_zero else 'ones'} (HF's init value; we promise random)")
                        n_bad_values += 1
                elif all_zero:
                    warn(f"{name} is all zeros")
                elif t.numel() > 1 and s["std"] == 0.0:
                    warn(f"{name} is constant ({s['min']})")
        if not args.quiet_table:
            print_table(["tensor", "kind", "shape", "dtype", "std", "mean", "min", "max"], rows,
                        title=f"[tensors] {len(rows)} parameters / persistent buffers:")
        summary.append(["tensor values", f"{len(rows)} tensors, {n_bad_values} bad", "ok" if not n_bad_values else "FAIL"])

        HashRouter = hf.cls("DeepseekV4HashRouter")
        n_tables, n_bad_tables = 0, 0
        for mod_name, mod in model.named_modules():
            if not isinstance(mod, HashRouter):
                continue
            n_tables += 1
            tab = getattr(mod, "tid2eid", None)
            label = f"{mod_name}.tid2eid"
            if tab is None:
                fail(f"{label} missing")
                n_bad_tables += 1
                continue
            tab = tab.detach().cpu()
            problems = []
            if tab.dtype != torch.int64:
                problems.append(f"dtype {tab.dtype} (HF casts with .long(); our writer should store int64)")
            if tuple(tab.shape) != (cfg.vocab_size, cfg.num_experts_per_tok):
                problems.append(f"shape {tuple(tab.shape)} != ({cfg.vocab_size}, {cfg.num_experts_per_tok})")
            tl = tab.long()
            if int(tl.min()) < 0 or int(tl.max()) >= cfg.n_routed_experts:
                problems.append(f"values outside [0, {cfg.n_routed_experts}): min {int(tl.min())} max {int(tl.max())}")
            srt = tl.sort(dim=1).values
            dup_rows = (srt[:, 1:] == srt[:, :-1]).any(dim=1).nonzero().flatten().tolist()
            if dup_rows:
                problems.append(f"{len(dup_rows)} rows with repeated experts, e.g. token {dup_rows[0]}: "
                                f"{tl[dup_rows[0]].tolist()}")
            if problems:
                n_bad_tables += 1
                for p in problems:
                    if p.startswith("dtype"):
                        warn(f"{label}: {p}")
                    else:
                        fail(f"{label}: {p}")
            else:
                print(f"[tid2eid] {label}: {tuple(tab.shape)} {tab.dtype}, all rows distinct, "
                      f"expert usage {torch.bincount(tl.flatten(), minlength=cfg.n_routed_experts).tolist()}")
        summary.append(["tid2eid", f"{n_tables} table(s), {n_bad_tables} with problems",
                        "ok" if not n_bad_tables else "CHECK"])

        # ---- 4. forward -------------------------------------------------------------------------
        ids, ids_src = parse_ids(args.ids, cfg.vocab_size, args.n_random_ids, args.ids_seed)
        print(f"[forward] {ids_src}")
        print(f"[forward] ids={','.join(map(str, ids))}")
        model.to(device)
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)
        probe = TopkProbe(model, hf)
        with torch.no_grad():
            try:
                out = model(input_ids=ids_t[None], use_cache=True)
            finally:
                probe.remove()
        logits = out.logits[0].float().cpu()
        if tuple(logits.shape) != (len(ids), cfg.vocab_size):
            raise RefError(f"HF logits have shape {tuple(logits.shape)}, expected ({len(ids)}, {cfg.vocab_size})")
        finite = bool(torch.isfinite(logits).all())
        print(f"[forward] HF logits {tuple(logits.shape)} std {float(logits.double().std()):.4f} finite={finite}")
        if not finite:
            fail("HF logits are not finite")
        print_table(TopkProbe.TABLE_HEADERS, probe.table_rows(), title="[forward] top-k margins:")
        near = probe.problems()
        for p in near:
            warn(f"near tie: {p} -- a mismatch vs our logits may then be implementation-defined, not a bug")
        gi, gr = probe.min_gaps()
        summary.append(["top-k margins", f"indexer {fmt_g(gi)} router {fmt_g(gr)} (threshold {TIE_REL_THRESHOLD:g})",
                        "ok" if not near else "WARN"])
        if args.save_logits:
            np.save(args.save_logits, logits.numpy().astype(np.float32))
            print(f"[forward] wrote HF logits to {args.save_logits}")

        if args.logits:
            ours = np.load(args.logits)
            if ours.dtype != np.float32:
                warn(f"{args.logits} has dtype {ours.dtype}, expected float32 (compared after conversion)")
            ours_t = torch.from_numpy(np.ascontiguousarray(ours)).double()
            if tuple(ours_t.shape) != tuple(logits.shape):
                raise RefError(f"{args.logits} has shape {tuple(ours_t.shape)}, HF logits {tuple(logits.shape)} "
                               "(same ids? all positions?)")
            if not torch.isfinite(ours_t).all():
                fail(f"{args.logits} contains non-finite values")
            err = rel_l2(ours_t, logits)
            mrel = max_rel(ours_t, logits)
            diff = (ours_t - logits.double())
            per_pos = diff.norm(dim=-1) / logits.double().norm(dim=-1).clamp_min(1e-300)
            worst = torch.topk(per_pos, min(5, per_pos.numel()))
            argmax_agree = float((ours_t.argmax(-1) == logits.argmax(-1)).double().mean())
            print(f"[compare] rel L2 {err:.3e} (tol {args.tol:g}), max |diff| {float(diff.abs().max()):.3e}, "
                  f"max rel {mrel:.3e}, argmax agreement {argmax_agree * 100:.1f}%")
            print(f"[compare] worst positions {worst.indices.tolist()} rel L2 "
                  f"{[f'{v:.2e}' for v in worst.values.tolist()]}")
            ok = err <= args.tol
            if not ok:
                fail(f"rel L2 {err:.3e} > {args.tol:g}")
            summary.append(["logits vs ours", f"rel L2 {err:.3e} (tol {args.tol:g})", "ok" if ok else "FAIL"])
        else:
            summary.append(["logits vs ours", "not checked (no --logits)", "-"])
    except RefError as exc:
        fail(str(exc))
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        fail(f"unexpected {type(exc).__name__}: {exc} (HF API differs from what this script expects?)")

    print("=" * 100)
    print_table(["check", "detail", "status"], summary, title="SUMMARY")
    for w in warnings:
        print(f"  warning: {w}")
    for f in failures:
        print(f"  FAIL: {f}")
    print("RESULT:", "FAIL" if failures else "PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
