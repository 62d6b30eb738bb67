"""A pure-Python model of ops/cuda/top_k.cu's cluster and sampled paths (docs/kernels/indexer_topk.md "Top-k"): CTA
spans, the sampled threshold with its fallback, the 11/11/10-bit radix passes over the cluster's summed histograms
with the early stop, and the closed-form entry-order compaction. It checks the selection logic against the naive order (higher score first, then the
lower entry; -inf/NaN never chosen; -0 == +0) on random rows with ties, masks and ragged lengths. Run it after
changing the algorithm, before spending device time:

    python3 tools/reference/top_k_cluster_model.py
"""
import math
import random
import struct

MAX_CLUSTER, MIN_SPAN, SPAN_QUANTUM = 8, 4096, 1024


def ordered_key(score):
    """top_k_keys.cuh: uint32 in float order, 0 = never chosen."""
    if not score > -math.inf:
        return 0
    if score == 0.0:
        score = 0.0
    bits = struct.unpack("<I", struct.pack("<f", score))[0]
    return (~bits) & 0xFFFFFFFF if bits & 0x80000000 else bits | 0x80000000


def top_bits(key, bits):
    return 0 if bits == 0 else key >> (32 - bits)


def radix_passes(key_lists, need, passes=3):
    """The radix passes (resolve_digit): every CTA sees the same summed histogram. Returns (prefix, resolved,
    need); resolved 0 with need = the valid count when fewer than `need` keys are valid."""
    prefix, resolved = 0, 0
    for digit_bits in (11, 11, 10)[:passes]:
        histogram = [0] * 2048
        shift = 32 - resolved - digit_bits
        for keys in key_lists:
            for key in keys:
                if key != 0 and top_bits(key, resolved) == prefix:
                    histogram[(key >> shift) & ((1 << digit_bits) - 1)] += 1
        if sum(histogram) < need:  # fewer valid keys than needed: take them all
            return prefix, resolved, sum(histogram)
        above = 0
        for digit in range(2047, -1, -1):
            if above < need <= above + histogram[digit]:
                break
            above += histogram[digit]
        need -= above
        prefix, resolved = (prefix << digit_bits) | digit, resolved + digit_bits
        if histogram[digit] == need or resolved == 32:
            break
    return prefix, resolved, need


def sampled_threshold(key_lists, k, stride=16, margin=2):
    """The sampled path's threshold (top_k.cu top_k_sampled_kernel): the 32-key lines 16j of every span, two
    radix passes over them for the (margin * k / stride)-th key, T = the lower edge of the 22-bit prefix found.
    Returns the floor the selection may use: T when at least k keys of the row reach it, else 1 (the fallback)."""
    sample = [[key for line in range(0, len(keys), 32 * stride) for key in keys[line:line + 32]] for keys in key_lists]
    prefix, resolved, _ = radix_passes(sample, max(1, margin * k // stride), passes=2)
    threshold = max(1, prefix << (32 - resolved)) if resolved else 1
    reached = sum(key >= threshold for keys in key_lists for key in keys)
    return threshold if reached >= k else 1


def cluster_top_k(scores, k, length=None, sampled=False):
    columns = len(scores)
    length = columns if length is None else max(0, min(length, columns))
    cluster = max(1, min(MAX_CLUSTER, -(-columns // MIN_SPAN)))
    span = -(-columns // cluster) if columns else 0
    span = max(SPAN_QUANTUM, -(-span // SPAN_QUANTUM) * SPAN_QUANTUM)
    keys = [[ordered_key(scores[c * span + i]) if c * span + i < length else 0 for i in range(span)]
            for c in range(cluster)]
    # The sampled path keeps only the keys at or above its threshold (the candidates; 1 after a fallback).
    floor = sampled_threshold(keys, k) if sampled else 1
    keys = [[key if key >= floor else 0 for key in span_keys] for span_keys in keys]
    prefix, resolved, need = radix_passes(keys, k)
    # Compaction: slot = "above" keys before + min(need, "equal" keys before).
    out = [-1] * k
    above_before = equal_before = 0
    for c, span_keys in enumerate(keys):
        for i, key in enumerate(span_keys):
            top = top_bits(key, resolved)
            is_above, is_equal = key != 0 and top > prefix, key != 0 and top == prefix
            if is_above or (is_equal and equal_before < need):
                out[above_before + min(need, equal_before)] = c * span + i
            above_before += is_above
            equal_before += is_equal
    return out, above_before + min(need, equal_before)


def naive_top_k(scores, k, length=None):
    length = len(scores) if length is None else max(0, min(length, len(scores)))
    ranked = sorted(((ordered_key(scores[i]), -i) for i in range(length) if ordered_key(scores[i]) != 0), reverse=True)
    chosen = sorted(-neg_index for _, neg_index in ranked[:k])
    return chosen + [-1] * (k - len(chosen)), len(chosen)


def random_scores(n, rng):
    """tests/ops/indexer_paged_fixture.h's mix: N(0,1), 20 % rounded to 1/8 (ties), some -inf, -0 and +0."""
    out = []
    for _ in range(n):
        value, kind = struct.unpack("<f", struct.pack("<f", rng.gauss(0, 1)))[0], rng.randrange(100)
        if kind < 20:
            value = round(value * 8) / 8
        value = {20: -math.inf, 21: -0.0, 22: 0.0}.get(kind, value)
        out.append(value)
    return out


def main():
    rng = random.Random(1)
    cases = []
    for n in (7, 2047, 16384 + 131, 40000):
        for k in (5, 512, 1024):
            cases.append((random_scores(n, rng), k, None))
            cases.append((random_scores(n, rng), k, n // 3 + 1))
    cases.append(([1.5] * 20000, 512, None))  # all tied
    cases.append(([1.5] * 20000, 512, 100))
    cases.append(([-math.inf] * 20000, 512, None))  # nothing valid
    sparse = random_scores(20000, rng)
    cases.append(([v if i % 50 == 7 else -math.inf for i, v in enumerate(sparse)], 512, None))  # fewer than k
    tied = random_scores(30000, rng)
    cases.append(([3.0 if i % 97 == 0 else v for i, v in enumerate(tied)], 1024, None))  # a tie across spans
    for scores, k, length in cases:
        want = naive_top_k(scores, k, length)
        for sampled in (False, True):
            got = cluster_top_k(scores, k, length, sampled)
            assert got == want, (len(scores), k, length, sampled, got[1], want[1])
    print(f"top-k model: {len(cases)} cases equal the naive order, all keys and sampled candidates")
    # How many candidates the sampled threshold keeps of a 262,144-column N(0,1) row (8 spans of 32,768).
    row = [rng.gauss(0, 1) for _ in range(262144)]
    span_keys = [[ordered_key(v) for v in row[c * 32768:(c + 1) * 32768]] for c in range(8)]
    for k in (512, 1024):
        floor = sampled_threshold(span_keys, k)
        kept = sum(key >= floor for keys in span_keys for key in keys)
        print(f"k {k}: the sampled threshold keeps {kept} of 262,144 keys ({100 * kept / 262144:.2f} %)")


if __name__ == "__main__":
    main()
