"""A pure-Python model of ops/cuda/top_k.cu's cluster path (docs/kernels/indexer_topk.md "Top-k"): CTA spans,
the 11/11/10-bit radix passes over the cluster's summed histograms with the early stop, and the closed-form
entry-order compaction. It checks the selection logic against the naive order (higher score first, then the
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


def lower_bound(span_keys, k, threads=1024, groups_per_thread=4):
    """The planned pre-filter (docs/kernels/indexer_topk.md "Plan"): each thread keeps the maxima of
    groups_per_thread groups of the keys it loads; the bound is the lower edge of the 11-bit bin where the count
    of the CTA's maxima, from the top, reaches k. At least k disjoint groups hold a key at or above it, so it is
    <= the row's k-th key; 1 (no filter) when fewer than k groups hold a valid key."""
    maxima = [0] * (threads * groups_per_thread)
    for position, key in enumerate(span_keys):
        load = position // 4  # thread t loads the uint4s t, t + 1024, ... (top_k.cu's load loop)
        group = (load % threads) * groups_per_thread + (load // threads) % groups_per_thread
        maxima[group] = max(maxima[group], key)
    histogram = [0] * 2048
    for m in maxima:
        if m:
            histogram[m >> 21] += 1
    count = 0
    for digit in range(2047, -1, -1):
        count += histogram[digit]
        if count >= k:
            return max(1, digit << 21)
    return 1


def cluster_top_k(scores, k, length=None, prefilter=False):
    columns = len(scores)
    length = columns if length is None else max(0, min(length, columns))
    cluster = max(1, min(MAX_CLUSTER, -(-columns // MIN_SPAN)))
    span = -(-columns // cluster) if columns else 0
    span = max(SPAN_QUANTUM, -(-span // SPAN_QUANTUM) * SPAN_QUANTUM)
    keys = [[ordered_key(scores[c * span + i]) if c * span + i < length else 0 for i in range(span)]
            for c in range(cluster)]
    # With the pre-filter, keys below the cluster's largest lower bound take no part (they are below the k-th).
    floor = max(lower_bound(span_keys, k) for span_keys in keys) if prefilter else 1
    keys = [[key if key >= floor else 0 for key in span_keys] for span_keys in keys]
    # The radix passes (resolve_digit): every CTA sees the same summed histogram.
    prefix, resolved, need = 0, 0, k
    for digit_bits in (11, 11, 10):
        histogram = [0] * 2048
        shift = 32 - resolved - digit_bits
        for span_keys in keys:
            for key in span_keys:
                if key != 0 and top_bits(key, resolved) == prefix:
                    histogram[(key >> shift) & ((1 << digit_bits) - 1)] += 1
        if sum(histogram) < need:  # at most k valid keys: take them all
            need = sum(histogram)
            break
        above = 0
        for digit in range(2047, -1, -1):
            if above < need <= above + histogram[digit]:
                break
            above += histogram[digit]
        need -= above
        prefix, resolved = (prefix << digit_bits) | digit, resolved + digit_bits
        if histogram[digit] == need or resolved == 32:
            break
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
        for prefilter in (False, True):
            got = cluster_top_k(scores, k, length, prefilter)
            assert got == want, (len(scores), k, length, prefilter, got[1], want[1])
    print(f"cluster top-k model: {len(cases)} cases equal the naive order, with and without the pre-filter")
    # What the pre-filter leaves to the radix passes on a 262,144-column N(0,1) row (8 spans of 32,768).
    row = [rng.gauss(0, 1) for _ in range(262144)]
    span_keys = [[ordered_key(v) for v in row[c * 32768:(c + 1) * 32768]] for c in range(8)]
    for k in (512, 1024):
        for groups in (1, 2, 4):
            floor = max(lower_bound(keys, k, groups_per_thread=groups) for keys in span_keys)
            kept = sum(key >= floor for keys in span_keys for key in keys)
            print(f"k {k}, {groups} maxima a thread: the pre-filter keeps {kept} of 262,144 keys "
                  f"({100 * kept / 262144:.2f} %)")


if __name__ == "__main__":
    main()
