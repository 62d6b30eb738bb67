"""A pure-Python model of ops/cuda/top_k.cu's cluster path (docs/kernels/indexer_topk.md "Top-k"): CTA spans,
the 11/11/10-bit radix passes over the cluster's summed histograms with the early stop, and the closed-form
entry-order compaction. It checks the selection logic against the naive order (higher score first, then the
lower entry; -inf/NaN never chosen; -0 == +0) on random rows with ties, masks and ragged lengths. Run it after
changing the algorithm, before spending device time:

    python3 tools/reference/top_k_cluster_model.py
"""
import struct, random, math
class NP:
    inf = math.inf
np=NP()
def okey(f):
    if not (f > -np.inf): return 0
    if f == 0.0: f = 0.0
    b = struct.unpack('<I', struct.pack('<f', f))[0]
    return (~b) & 0xffffffff if b & 0x80000000 else b | 0x80000000
def top_bits(k, bits): return 0 if bits == 0 else k >> (32-bits)
def sim(scores, k, length=None, cluster_max=8):
    N = len(scores)
    if length is None: length = N
    length = max(0, min(length, N))
    C = max(1, min(cluster_max, -(-N//4096)))
    span = -(-N//C) if N else 0
    span = max(1024, -(-span//1024)*1024)
    keys = [[okey(float(scores[c*span+i])) if c*span+i < length else 0 for i in range(span)] for c in range(C)]
    prefix, resolved, need = 0, 0, k
    for pas in range(3):
        bits = 11 if pas < 2 else 10
        hist = [0]*2048
        shift = 32 - resolved - bits
        for c in range(C):
            for key in keys[c]:
                if key != 0 and top_bits(key, resolved) == prefix:
                    hist[(key >> shift) & ((1<<bits)-1)] += 1
        total = sum(hist)
        if total < need:
            need = total; done = True
            break
        above = 0; fb = None
        for b in range(2047, -1, -1):
            if above < need and above + hist[b] >= need:
                fb = b; fa = above; fc = hist[b]; break
            above += hist[b]
        need -= fa; prefix = (prefix << bits) | fb; resolved += bits
        if fc == need or resolved == 32: break
    out = [-1]*k
    ra = re = 0
    for c in range(C):
        for i, key in enumerate(keys[c]):
            t = top_bits(key, resolved)
            a = key != 0 and t > prefix; e = key != 0 and t == prefix
            if a or (e and re < need):
                out[ra + min(need, re)] = c*span + i
            ra += a; re += e
    n = ra + min(need, re)
    return out, n
def naive(scores, k, length=None):
    N=len(scores); length = N if length is None else max(0,min(length,N))
    items = [(okey(float(scores[i])), -i) for i in range(length) if okey(float(scores[i])) != 0]
    items.sort(reverse=True)
    ch = sorted(-x[1] for x in items[:k])
    return ch + [-1]*(k-len(ch)), len(ch)
random.seed(1)
def f32(v): return struct.unpack('<f', struct.pack('<f', v))[0]
def rs(n):
    x=[]
    for _ in range(n):
        v=f32(random.gauss(0,1)); kd=random.randrange(100)
        if kd<20: v=round(v*8)/8
        if kd==20: v=-math.inf
        if kd==21: v=-0.0
        if kd==22: v=0.0
        x.append(v)
    return x
cases = []
for n in [7, 2047, 16384+131, 40000]:
    for k in [5, 512, 1024]:
        cases.append((rs(n), k, None)); cases.append((rs(n), k, n//3+1))
x = [1.5]*20000; cases.append((x, 512, None)); cases.append((x, 512, 100))
x = [-math.inf]*20000; cases.append((x, 512, None))
x = rs(20000); x = [v if i%50==7 else -math.inf for i,v in enumerate(x)]; cases.append((x, 512, None))
x = rs(30000); x = [3.0 if i%97==0 else v for i,v in enumerate(x)]; cases.append((x, 1024, None))
for s, k, L in cases:
    a = sim(s, k, L); b = naive(s, k, L)
    assert a == b, (len(s), k, L, a[1], b[1])
print("ok", len(cases))
