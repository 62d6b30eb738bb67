#!/usr/bin/env python3
"""Run tools/reference/deepseek_reference.py under an old torch without float8 / float4 dtypes (Debian's
python3-torch 1.13 on the dev machines; docs/numerics.md "The oracle"). The GPU machine's torch 2.11 needs none of
this: run deepseek_reference.py there directly.

What the shim supplies (test-only, installed before the script imports torch's users):
  torch.float8_e4m3fn    -> float64 holding e4m3 values: Tensor.to(float64) from another dtype rounds onto the e4m3
                            grid (RNE, subnormal step 2^-9, saturating at ±448; the stand-in clamps first anyway).
                            .double() is untouched, so the exact-accumulation GEMMs are unaffected.
  torch.float8_e8m0fnu   -> float32 (every value is a power of two)
  torch.float4_e2m1fn_x2 -> uint8 (the packed nibbles)
  torch.set_default_device (missing before 2.0) -> no-op (CPU only); Parameter() of an integer tensor without grad;
  Tensor.gather with an int32 index (model.py's Gate) -> int64.
Afterwards every model.safetensors under --out is rewritten with real F8_E4M3 / F8_E8M0 bytes (the shim's tensors
were float64 / float32 under those labels), so the set is byte-for-byte what torch 2.11 writes.

Usage: /usr/bin/python3 tools/reference/reference_torch113.py <deepseek_reference.py arguments>
"""
import json
import math
import os
import runpy
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def install_shim():
    import torch
    if hasattr(torch, "float8_e4m3fn"):
        sys.exit("this torch has float8 dtypes: run deepseek_reference.py directly")
    torch.float8_e4m3fn = torch.float64
    torch.float8_e8m0fnu = torch.float32
    torch.float4_e2m1fn_x2 = torch.uint8
    if not hasattr(torch, "set_default_device"):
        torch.set_default_device = lambda device: None

    def e4m3(x):
        _, e = torch.frexp(x)
        e = (e - 1).clamp(min=-6)  # the binade of |x|; below 2^-6 the subnormal step 2^-9
        quantum = torch.ldexp(torch.ones_like(x), (e - 3).double())
        return (torch.round(x / quantum) * quantum).clamp(-448, 448)  # torch.round: half to even

    to = torch.Tensor.to

    def to_e4m3(self, *args, **kwargs):
        dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
        out = to(self, *args, **kwargs)
        if dtype is torch.float64 and self.dtype != torch.float64:
            out = e4m3(out)
        return out

    torch.Tensor.to = to_e4m3
    parameter_new = torch.nn.Parameter.__new__

    def new_parameter(cls, data=None, requires_grad=True):
        if data is not None and not (data.is_floating_point() or data.is_complex()):
            requires_grad = False
        return parameter_new(cls, data, requires_grad)

    torch.nn.Parameter.__new__ = new_parameter
    gather = torch.Tensor.gather
    torch.Tensor.gather = lambda self, dim, index, **kw: gather(self, dim, index.long(), **kw)


def e4m3_byte(v):
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a == 0:
        return sign
    e = math.floor(math.log2(a))
    if e < -6:  # subnormal: m · 2^-9
        m = round(a / 2 ** -9)
        assert m * 2 ** -9 == a and m < 8, v
        return sign | m
    m = round((a / 2 ** e - 1) * 8)
    assert (1 + m / 8) * 2 ** e == a and 0 <= m < 8, v
    return sign | ((e + 7) << 3) | m


def rewrite_safetensors(path):
    """F8_E4M3 tensors stored as float64 -> one e4m3 byte each; F8_E8M0 stored as float32 -> the exponent byte."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header, base = json.loads(blob[8:8 + n]), 8 + n
    out_header, chunks, offset = {}, [], 0
    for name in sorted(k for k in header if k != "__metadata__"):
        h = header[name]
        lo, hi = h["data_offsets"]
        raw = blob[base + lo:base + hi]
        count = math.prod(h["shape"])
        if h["dtype"] == "F8_E4M3" and len(raw) == 8 * count:
            raw = bytes(e4m3_byte(v) for v in struct.unpack(f"<{count}d", raw))
        elif h["dtype"] == "F8_E8M0" and len(raw) == 4 * count:
            raw = bytes((bits >> 23) & 0xFF for bits in struct.unpack(f"<{count}I", raw))
        out_header[name] = {"dtype": h["dtype"], "shape": h["shape"], "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(out_header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in chunks:
            f.write(raw)


def main():
    install_shim()
    args = sys.argv[1:]
    out = args[args.index("--out") + 1] if "--out" in args else None
    sys.path.insert(0, HERE)
    sys.argv = [os.path.join(HERE, "deepseek_reference.py")] + args
    runpy.run_path(sys.argv[0], run_name="__main__")
    if out:
        for root, _, files in os.walk(out):
            if "model.safetensors" in files:
                path = os.path.join(root, "model.safetensors")
                rewrite_safetensors(path)
                print(f"rewrote {path} with F8 bytes ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
