"""GGUF block-quantized weights used as they are, for small-batch decode on x86 CPUs.

A step that decodes a few sequences is bound by reading weights from memory. Keeping the
GGUF file's Q4_1 / Q8_0 blocks (5-6x fewer bytes than float32) and multiplying them with
the AVX2 kernels in `gguf_gemm.c` makes those steps several times faster. Larger batches
are compute-bound and keep using the dense weights with the BLAS matmul. A mixture of experts' routed
experts (llama.cpp's stacked `ffn_*_exps` tensors, `read_quantized_experts`) work the same way per expert:
an expert with at most `max_rows()` tokens in a step multiplies its blocks (`layers/moe.py`).

The kernels take float32 or bfloat16 activations and multiply with the values the dense copy
holds in that dtype (bf16: the dequantized weights rounded to bf16), so which path a batch
size picks changes only the summation order. Each row's result depends on that row alone,
for any number of rows: `--deterministic` runs every batch size through these kernels (dense
weights too, as the `dense` kind). They are built by `cpu_kernels`; where that is impossible
(no gcc, no AVX2) everything runs on the dense weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deepinfer.fileio import write_atomic
from deepinfer.layers.cpu_kernels import dtype_code, load_library

QK = 32
# the C kernels' codes for the block kinds (gguf_gemm.c's gguf_amx_gemm, decode_layer.c's qweight)
KIND_CODES = {"q4_1": 0, "q8_0": 1}
logger = logging.getLogger(__name__)


@dataclass
class QuantizedWeight:
    """One [N, K] weight in GGUF blocks: `qs` packed quants, `d` scales, `mn` offsets (Q4_1 only);
    or, kind "dense", `qs` is the float32 / bfloat16 weight itself (no scales)."""

    kind: str  # "q4_1" | "q8_0" | "dense"
    qs: torch.Tensor
    d: torch.Tensor
    mn: torch.Tensor | None
    n: int
    k: int

    @classmethod
    def dense(cls, weight: torch.Tensor) -> QuantizedWeight:
        """A dense [N, K] CPU weight (float32 or bfloat16, K a multiple of 32) for the row-invariant kernel."""
        n, k = weight.shape
        if k % QK or dtype_code(weight.dtype) is None or weight.device.type != "cpu":
            raise ValueError(f"the row-invariant kernel needs a CPU float32/bfloat16 weight with K % {QK} == 0")
        return cls("dense", weight.detach().contiguous(), torch.empty(0), None, n, k)

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack along output rows (fused Q/K/V or gate/up projections)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or len({p.k for p in parts}) != 1:
            raise ValueError("cannot fuse weights of different quantization or width")
        return cls(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]),
                   None if parts[0].mn is None else torch.cat([p.mn for p in parts]), sum(p.n for p in parts),
                   parts[0].k)

    def permute_rows(self, order: np.ndarray) -> QuantizedWeight:
        idx = torch.from_numpy(order)
        return QuantizedWeight(self.kind, self.qs[idx].contiguous(), self.d[idx].contiguous(),
                               None if self.mn is None else self.mn[idx].contiguous(), self.n, self.k)

    @staticmethod
    def nbytes(kind: str, n: int, k: int) -> int:
        """The bytes `to_bytes` gives for an [n, k] weight of `kind` (q4_1 / q8_0)."""
        nb = n * (k // QK)
        return {"q4_1": n * k // 2 + 8 * nb, "q8_0": n * k + 4 * nb}[kind]

    def to_bytes(self) -> torch.Tensor:
        """The blocks as one flat uint8 tensor (quants, scales, offsets), e.g. to send to another rank."""
        if self.kind == "dense":
            raise ValueError("a dense weight has no blocks to serialise")
        parts = [self.qs.reshape(-1), self.d.reshape(-1).view(torch.uint8)]
        if self.mn is not None:
            parts.append(self.mn.reshape(-1).view(torch.uint8))
        return torch.cat(parts)

    @classmethod
    def from_bytes(cls, kind: str, n: int, k: int, buf: torch.Tensor) -> QuantizedWeight:
        """Inverse of `to_bytes` (copies out of `buf`)."""
        if buf.numel() != cls.nbytes(kind, n, k):
            raise ValueError(f"{buf.numel()} bytes for a {kind} {n}x{k} weight")
        nb = k // QK
        q = n * k // 2 if kind == "q4_1" else n * k
        qs = buf[:q].clone().view(n, q // n)
        d = buf[q:q + 4 * n * nb].clone().view(torch.float32).view(n, nb)
        mn = buf[q + 4 * n * nb:].clone().view(torch.float32).view(n, nb) if kind == "q4_1" else None
        return cls(kind, qs, d, mn, n, k)

    def dequantize(self) -> torch.Tensor:
        """Float32 [N, K] (used by tests to check the kernels and the layout)."""
        if self.kind == "dense":
            return self.qs.float()
        nb = self.k // QK
        if self.kind == "q4_1":
            q = self.qs.view(self.n, nb, 16)
            vals = torch.cat([q & 0x0F, q >> 4], dim=-1).float()
            return (vals * self.d.unsqueeze(-1) + self.mn.unsqueeze(-1)).view(self.n, self.k)
        return (self.qs.view(torch.int8).view(self.n, nb, QK).float() * self.d.unsqueeze(-1)).view(self.n, self.k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] float32 or bfloat16 -> [M, N] of x's dtype (one pass over the weights per
        max_rows() rows). A dense weight must have x's dtype."""
        lib = load_library()
        x = x.contiguous()
        m, code = x.shape[0], dtype_code(x.dtype)
        y = torch.empty((m, self.n), dtype=x.dtype)
        # bf16 rows are widened into the scratch first (float32 Q4_1 rows are permuted there);
        # Q4_1 also keeps per-block sums of x there
        widened = m * self.k if code == 1 or self.kind == "q4_1" else 0
        scratch = torch.empty(widened + (m * (self.k // QK) + 16 if self.kind == "q4_1" else 0) + 1, dtype=torch.float32)
        if self.kind == "dense":
            if self.qs.dtype != x.dtype:
                raise ValueError(f"dense weight is {self.qs.dtype}, activations {x.dtype}")
            lib.dense_gemm(x.data_ptr(), m, self.k, self.qs.data_ptr(), y.data_ptr(), self.n, scratch.data_ptr(), code)
        elif self.kind == "q4_1":
            lib.q4_1_gemm(x.data_ptr(), m, self.k, self.qs.data_ptr(), self.d.data_ptr(), self.mn.data_ptr(),
                          y.data_ptr(), self.n, scratch.data_ptr(), code)
        else:
            lib.q8_0_gemm(x.data_ptr(), m, self.k, self.qs.data_ptr(), self.d.data_ptr(), y.data_ptr(), self.n,
                          scratch.data_ptr(), code)
        return y


def max_rows() -> int:
    lib = load_library()
    return lib.max_rows() if lib is not None else 0


QuantizedTensors = tuple[dict[str, QuantizedWeight], dict[str, list[QuantizedWeight]]]
# bump when the blocks' layout in memory (and so in the cache file) changes
_CACHE_FORMAT = "deepinfer-gguf-blocks-v1"
_DIGEST_BYTES = 32


def read_quantized(gguf_path: Path, cache_file: Path | None = None) -> QuantizedTensors:
    """`read_quantized_tensors` and `read_quantized_experts` in one read of the file.

    Parsing a GGUF's metadata (gguf's reader walks every field, e.g. a 49k-token vocabulary and its
    merges) takes seconds: 2.8-3.7 s of a 13.7 s default-model load on a 2-core VM. With `cache_file` the
    blocks, as laid out here, are kept in that file after the first read (a BLAKE2b digest of the rest,
    then the tensors in safetensors format) and loaded from it later (~0.15 s, the digest checked). The
    caller keys its path by the GGUF's content (the runner uses the directory of the file's conversion,
    named by its digest). A cache that does not check out (torn, damaged, other format) is replaced; one
    that cannot be written only costs the next load the parse."""
    if cache_file is not None:
        cached = _load_cached(cache_file)
        if cached is not None:
            return cached
    tensors: dict[str, QuantizedWeight] = {}
    experts: dict[str, list[QuantizedWeight]] = {}
    for t in _quantized(gguf_path):
        if len(t.shape) == 2:
            tensors[t.name] = _blocks(t)[0]
        elif len(t.shape) == 3:
            experts[t.name] = _blocks(t)
    if cache_file is not None:
        _save_cached(cache_file, tensors, experts)
    return tensors, experts


def _save_cached(path: Path, tensors: dict[str, QuantizedWeight], experts: dict[str, list[QuantizedWeight]]) -> None:
    from safetensors.torch import save

    arrays: dict[str, torch.Tensor] = {}
    index: dict[str, dict] = {}
    for name, ws in [(n, [w]) for n, w in tensors.items()] + list(experts.items()):
        w = ws[0]
        index[name] = {"kind": w.kind, "n": w.n, "k": w.k, "experts": len(ws) if name in experts else 0}
        arrays[f"{name}.qs"] = torch.stack([x.qs for x in ws])
        arrays[f"{name}.d"] = torch.stack([x.d for x in ws])
        if w.mn is not None:
            arrays[f"{name}.mn"] = torch.stack([x.mn for x in ws])
    data = save(arrays, metadata={"format": _CACHE_FORMAT, "index": json.dumps(index)})
    try:
        write_atomic(path, [hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest(), data])
    except OSError as e:
        logger.warning("could not cache the GGUF blocks in %s (%s); the next load parses the file again", path, e)


def _load_cached(path: Path) -> QuantizedTensors | None:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("cannot read the GGUF block cache %s (%s)", path, e)
        return None
    # a digest of the whole payload: a flipped bit in a block would otherwise be a wrong weight, served
    data = memoryview(raw)[_DIGEST_BYTES:]
    if hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest() != raw[:_DIGEST_BYTES]:
        logger.warning("ignoring the GGUF block cache %s: its digest does not match (torn or damaged)", path)
        return None
    try:
        header_len = int.from_bytes(data[:8], "little")  # safetensors: u64 header size, then its JSON
        meta = json.loads(bytes(data[8:8 + header_len])).get("__metadata__", {})
        if meta.get("format") != _CACHE_FORMAT:
            return None
        index = json.loads(meta["index"])
        arrays = load(bytes(data))
        tensors: dict[str, QuantizedWeight] = {}
        experts: dict[str, list[QuantizedWeight]] = {}
        for name, info in index.items():
            qs, d, mn = arrays[f"{name}.qs"], arrays[f"{name}.d"], arrays.get(f"{name}.mn")
            ws = [QuantizedWeight(info["kind"], qs[i], d[i], None if mn is None else mn[i], info["n"], info["k"])
                  for i in range(qs.shape[0])]
            if info["experts"]:
                experts[name] = ws
            else:
                tensors[name] = ws[0]
        return tensors, experts
    except (SafetensorError, KeyError, ValueError, RuntimeError) as e:
        logger.warning("ignoring the unreadable GGUF block cache %s (%s)", path, e)
        return None


def read_quantized_tensors(gguf_path: Path) -> dict[str, QuantizedWeight]:
    """The 2-D Q4_1 and Q8_0 tensors of a GGUF file by GGUF name (other types are skipped; the 3-D expert
    stacks are `read_quantized_experts`')."""
    return read_quantized(gguf_path)[0]


def read_quantized_experts(gguf_path: Path) -> dict[str, list[QuantizedWeight]]:
    """The 3-D Q4_1 and Q8_0 tensors of a GGUF file (llama.cpp's stacked routed experts, e.g.
    `blk.N.ffn_gate_exps.weight`: GGUF dims (K, N, E), numpy [E, N, bytes]) as one [N, K] weight per
    expert, in expert order (other types are skipped)."""
    return read_quantized(gguf_path)[1]


def _quantized(gguf_path: Path) -> list:
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    return [t for t in reader.tensors if t.tensor_type.name.lower() in ("q4_1", "q8_0")]


def _blocks(t) -> list[QuantizedWeight]:
    """One GGUF tensor's blocks as [N, K] weights, one per entry of its third dim (GGUF lists dims
    innermost first; a 2-D tensor gives one)."""
    kind = t.tensor_type.name.lower()
    k, n = (int(v) for v in t.shape[:2])
    e = int(t.shape[2]) if len(t.shape) > 2 else 1
    nb = k // QK
    raw = np.asarray(t.data, dtype=np.uint8).reshape(e, n, nb, -1)
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16).astype(np.float32).reshape(e, n, nb))
    if kind == "q4_1":
        mn = torch.from_numpy(raw[..., 2:4].copy().view(np.float16).astype(np.float32).reshape(e, n, nb))
        qs = torch.from_numpy(raw[..., 4:20].copy().reshape(e, n, nb * 16))
    else:
        mn = None
        qs = torch.from_numpy(raw[..., 2:34].copy().reshape(e, n, k))
    # each expert's views are contiguous slices of the one copy of the file's blocks
    return [QuantizedWeight(kind, qs[i], d[i], None if mn is None else mn[i], n, k) for i in range(e)]


def llama_unpermute_order(rows: int, n_head: int) -> np.ndarray:
    """Row order undoing llama.cpp's Q/K permutation (rotary pairs interleaved) for HF's layout."""
    dim = rows // n_head // 2
    return np.arange(rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(rows)
