"""GGUF blocks multiplied on AMX tiles (`gguf_amx_gemm`, `gguf_amx_gemm_silu` in layers/gguf_gemm.c) against the
AMX panels of the dense bf16 copy (`panel_gemm_bf16`, `panel_gemm_bf16_silu`), the kernel a bf16 batch of more
than 8 rows takes on an AMX CPU otherwise.

For each projection of the default model (SmolLM2-135M: qkv, o, the fused gate/up with SiLU*mul, down, and the
LM head) and each row count, both kernels run on every layer's weights in turn (from memory, as in a decode step),
interleaved call by call, `--repeats` times; prints the median ms per call of each, the ratio (panels / blocks:
> 1 means the blocks are faster) and whether the outputs were bit-identical (they must be: a tile product adds the
same k pairs in the same order whichever operand holds the weights). Needs a CPU with AMX::

    PYTHONPATH=. python3 benchmarks/amx_blocks.py --rows 16 64 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from deepinfer.layers.cpu_kernels import load_library
    from deepinfer.layers.gguf_kernels import KIND_CODES, QuantizedWeight, read_quantized_tensors
    from deepinfer.layers.linear import pack_panels
    from deepinfer.weights import resolve_model

    lib = load_library()
    if lib is None or not hasattr(lib, "gguf_amx_gemm") or not lib.amx_tiles_granted():
        sys.exit("needs the CPU kernels built for a CPU with AMX (and Linux granting the tiles)")
    gguf = resolve_model(None).source
    if gguf.suffix != ".gguf":
        sys.exit(f"the default model is not a GGUF file here ({gguf})")
    tensors = read_quantized_tensors(gguf)
    layers = sum(1 for name in tensors if name.endswith(".attn_output.weight"))
    parts = {"qkv": ["attn_q", "attn_k", "attn_v"], "o": ["attn_output"], "gate_up": ["ffn_gate", "ffn_up"],
             "down": ["ffn_down"]}
    weights = {name: [QuantizedWeight.concat([tensors[f"blk.{i}.{p}.weight"] for p in ps]) for i in range(layers)]
               for name, ps in parts.items()}
    weights["lm_head"] = [tensors["token_embd.weight"]]
    print(f"{'rows':>5} {'product':8} {'blocks ms':>10} {'panels ms':>10} {'panels/blocks':>14}  bits")
    for name, ws in weights.items():
        panels = [pack_panels(w.dequantize().to(torch.bfloat16)) for w in ws]
        silu = name == "gate_up"
        for m in args.rows:
            x = (torch.randn(m, ws[0].k, generator=torch.Generator().manual_seed(m)) * 0.5).to(torch.bfloat16)
            n_out = ws[0].n // 2 if silu else ws[0].n
            ya, yb = torch.empty(m, n_out, dtype=torch.bfloat16), torch.empty(m, n_out, dtype=torch.bfloat16)
            ta, tb, same = [], [], True
            for _ in range(args.repeats):
                for w, p in zip(ws, panels, strict=True):
                    mn = w.mn.data_ptr() if w.mn is not None else None
                    t0 = time.perf_counter()
                    if silu:
                        ok = lib.gguf_amx_gemm_silu(x.data_ptr(), m, w.k, KIND_CODES[w.kind], w.qs.data_ptr(),
                                                    w.d.data_ptr(), mn, ya.data_ptr(), n_out)
                    else:
                        ok = lib.gguf_amx_gemm(x.data_ptr(), m, w.k, KIND_CODES[w.kind], w.qs.data_ptr(), w.d.data_ptr(), mn,
                                               ya.data_ptr(), n_out)
                    t1 = time.perf_counter()
                    if silu:
                        lib.panel_gemm_bf16_silu(x.data_ptr(), m, w.k, p.data_ptr(), yb.data_ptr(), n_out)
                    else:
                        lib.panel_gemm_bf16(x.data_ptr(), m, w.k, p.data_ptr(), None, yb.data_ptr(), n_out, 0)
                    t2 = time.perf_counter()
                    if not ok:
                        sys.exit(f"gguf_amx_gemm declined {name} at {m} rows (it takes at most 512)")
                    ta.append(t1 - t0)
                    tb.append(t2 - t1)
                    same &= torch.equal(ya.view(torch.int16), yb.view(torch.int16))
            a, b = statistics.median(ta), statistics.median(tb)
            print(f"{m:5d} {name:8} {a * 1e3:10.3f} {b * 1e3:10.3f} {b / a:13.2f}x  {'same' if same else 'DIFFER'}",
                  flush=True)


if __name__ == "__main__":
    main()
