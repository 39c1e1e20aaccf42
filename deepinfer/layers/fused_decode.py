"""Whole decoder layers in one C call (`decode_layer.c`) for steps that only decode a few sequences.

Used by Llama-layout models whose projections all multiply from GGUF blocks, or from their
dense weights in deterministic mode (no biases, no q/k norm): for such a step the torch path
dispatches ~15 small ops per layer from Python, which costs more than the arithmetic. In
deterministic mode every step comes here, prefill tokens as decode rows. `FusedDecoder.run` replaces the
embedding, the rotary lookup and the layer loop with one C call (`decode_layers`); `final_hidden` adds the
final norm of the logits rows, whose logits and sampling stay in torch; `decode_steps` runs several greedy
steps in one call, the LM head and each row's argmax included (`num_scheduler_steps`); `spec_steps` runs
several steps of a few requests that also speculate, the n-gram lookups and each step's verification in C.
The layer descriptions hold raw pointers to the weights and KV caches, so they are built once for a given
cache list and rebuilt if it changes.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import torch

from deepinfer.layers import cpu_kernels
from deepinfer.layers.gguf_kernels import KIND_CODES, max_rows
from deepinfer.layers.linear import Linear


class _QWeight(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("qs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("mn", ctypes.c_void_p),
                ("n", ctypes.c_int), ("k", ctypes.c_int), ("dense", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _QWeight), ("o", _QWeight), ("gate_up", _QWeight), ("down", _QWeight),
                ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("inter", ctypes.c_int), ("block_size", ctypes.c_int),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


_KINDS = {**KIND_CODES, "dense": 2}  # decode_layer.c's qweight kinds


class _Call(NamedTuple):
    """decode_layers' leading arguments and the tensors their pointers name (held while the call runs)."""

    args: tuple
    x: torch.Tensor
    residual: torch.Tensor
    buffers: tuple[torch.Tensor, ...]


def _qweight(linear: Linear) -> _QWeight:
    w, twin = linear.quantized, linear.dense_twin
    return _QWeight(_KINDS[w.kind], w.qs.data_ptr(), w.d.data_ptr(), w.mn.data_ptr() if w.mn is not None else None,
                    w.n, w.k, twin.qs.data_ptr() if twin is not None else None)


class SpecSeq(NamedTuple):
    """One request of a speculating call (`FusedDecoder.spec_steps`): its tokens (the last one's KV not yet
    computed), block table, the most tokens the call may append, and its draft length per match length."""

    tokens: list[int]
    table: list[int]
    max_new: int
    k_by_match: tuple[int, ...]


class SpecCall(NamedTuple):
    """What a speculating call did: per request the tokens appended and per step it was in (match length,
    drafts, drafts kept); per step its rows and seconds."""

    tokens: list[list[int]]
    verdicts: list[list[tuple[int, int, int]]]
    steps: list[tuple[int, float]]


class FusedDecoder:
    """The C layer path of one model; `supported()` says whether the model qualifies at all."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.lib = cpu_kernels.load_library()
        self.max_rows = max_rows()
        self._caches_key: tuple[int, ...] | None = None
        self._layers: ctypes.Array[_Layer] | None = None
        # deterministic mode: every step arrives as decode rows (prefill tokens too), of any count
        self.row_invariant = False

    def supported(self) -> bool:
        m = self.model
        attn0 = m.layers[0].self_attn
        if self.lib is None or cpu_kernels.kernels_for(m.embed_tokens.weight) is None:
            return False
        # the C call reads the embedding and rotary tables by row and every norm's weight (each layer's two, the
        # model's final one): plain contiguous tensors of the model dtype
        tables = [m.embed_tokens.weight, m.rotary.cos, m.rotary.sin, m.norm.weight]
        tables += [n.weight for layer in m.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        if any(not t.is_contiguous() or t.dtype != m.embed_tokens.weight.dtype for t in tables):
            return False
        if attn0.head_dim % 16 or m.config.hidden_size % 8 or m.layers[0].mlp.intermediate % 8:
            return False
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if a.q_norm is not None or any(lin.quantized is None or lin.bias is not None for lin in linears):
                return False
        return True

    def accepts(self, input_ids: torch.Tensor, meta: Any) -> bool:
        """A step of at most max_rows new tokens on the C attention path (decodes, or prefill and
        draft tokens as rows; any number of rows in row-invariant mode)."""
        rows = input_ids.shape[0]
        return (not getattr(meta, "prefills", True) and getattr(meta, "decode_context_lens", None) is not None
                and meta.num_decodes == rows and (self.row_invariant or rows <= self.max_rows))

    def _build(self, caches: list[Any]) -> None:
        m = self.model
        cfg = m.config
        layers = []
        for layer, (k_cache, v_cache) in zip(m.layers, caches, strict=True):
            a, mlp = layer.self_attn, layer.mlp
            layers.append(_Layer(
                _qweight(a.qkv_proj), _qweight(a.o_proj), _qweight(mlp.gate_up_proj), _qweight(mlp.down_proj),
                layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                k_cache.data_ptr(), v_cache.data_ptr(), cfg.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim,
                mlp.intermediate, k_cache.shape[1], layer.input_layernorm.eps, a.head_dim ** -0.5))
        self._layers = (_Layer * len(layers))(*layers)  # one C array: decode_layers walks it
        self._caches_key = tuple(c[0].data_ptr() for c in caches)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], meta: Any
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding, rotary lookup and all layers for decode rows `input_ids` [M] at `positions` [M], in one
        C call; returns (last MLP output, residual) [M, hidden] each, like the layer loop."""
        x, residual, _ = self._call(input_ids, positions, caches, meta, None)
        return x, residual

    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], meta: Any,
                     rows: torch.Tensor) -> torch.Tensor:
        """As `run`, then the model's final RMSNorm of the rows `rows` (indices into the M rows) in the same C
        call: `model.norm(x[rows], residual[rows])[0]`, the same values (see `decode_layers`)."""
        return self._call(input_ids, positions, caches, meta, rows)[2]

    def decode_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], meta: Any,
                     head: Linear, num_steps: int, stop_ids: list[int]) -> torch.Tensor:
        """Greedy decoding of the rows `input_ids` for up to `num_steps` tokens in one C call (`decode_steps`):
        each step the layers, the model's final norm, the LM head `head` and each row's argmax, the same
        kernels on the same values as that many steps of `final_hidden`, `head` and the greedy sampler.
        Every row's blocks must hold its positions up to the last step's. Returns the tokens [steps, M],
        steps < num_steps when a row produced one of `stop_ids` at the last of them."""
        q = head.quantized
        if q is None or q.kind == "dense" or head.bias is not None:
            raise ValueError("decode_steps needs an LM head with GGUF blocks and no bias")
        m_rows = input_ids.shape[0]
        # the C call advances positions, context lengths and slots step by step: its own copies
        positions = positions.to(torch.int64).clone()
        lens, slots = meta.decode_context_lens.clone(), meta.slot_mapping.clone()
        embed = self.model.embed_tokens.weight
        hidden = embed.new_empty((m_rows, embed.shape[1]))
        logits = embed.new_empty((m_rows, q.n))
        tokens = torch.empty((num_steps, m_rows), dtype=torch.int64)
        stops = torch.tensor(stop_ids or [-1], dtype=torch.int64)
        rows = torch.empty(m_rows, dtype=torch.int64)
        call = self._args(input_ids, positions, caches, meta, slots, lens)
        m = self.model
        failed = ctypes.c_int(-1)
        rc = self.lib.decode_steps(*call.args, ctypes.byref(failed), m.norm.weight.data_ptr(), m.norm.eps, rows.data_ptr(),
                                   hidden.data_ptr(), ctypes.byref(_qweight(head)), logits.data_ptr(), num_steps,
                                   stops.data_ptr(), len(stop_ids), tokens.data_ptr())
        if rc == -4:
            raise IndexError(f"a row's block table ends before its position after {num_steps - 1} more steps")
        if rc < 0:
            raise RuntimeError(f"decode_layer rejected layer {failed.value} (code {rc})")
        return tokens[:rc]

    def spec_steps(self, seqs: list[SpecSeq], caches: list[Any], head: Linear, num_steps: int, min_n: int,
                   max_n: int, lookback: int, stop_ids: list[int]) -> SpecCall:
        """Greedy decoding of the requests `seqs` with prompt-lookup speculation, up to `num_steps` steps in one
        C call (`spec_decode_steps`): each step drafts `k_by_match[m]` tokens after an m-token n-gram match in
        a request's tokens (none without a match), verifies every request's last token and drafts as decode
        rows of one pass (at most `max_rows`: one per request, the rest shared among the drafts, longer matches
        first), keeps the drafts its argmaxes confirm and appends the next argmax: the same tokens as plain
        greedy steps. A request's last token's position is len(tokens) - 1; its `table` (block table) must
        hold positions up to len(tokens) - 2 + max_new. A request stops at `max_new` tokens or a `stop_ids`
        token (kept)."""
        q = head.quantized
        if q is None or q.kind == "dense" or head.bias is not None:
            raise ValueError("spec_steps needs an LM head with GGUF blocks and no bias")
        if (not 1 <= len(seqs) <= self.max_rows or any(len(sq.k_by_match) != max_n + 1 for sq in seqs) or min_n < 1
                or lookback < 1):
            raise ValueError("spec_steps needs 1..max_rows requests, each one draft length per match length 0..max_n, "
                             "and a lookback of at least one token")
        self._ensure_layers(caches)
        m = self.model
        embed, cos_table, sin_table = m.embed_tokens.weight, m.rotary.cos, m.rotary.sin
        rows, hidden_size, rot_dim = self.max_rows, embed.shape[1], cos_table.shape[1]
        x, residual, rope, work, scratch = self._buffers(rows)
        hidden, logits = embed.new_empty((rows, hidden_size)), embed.new_empty((rows, q.n))
        n_seqs = len(seqs)
        # the lookup reads only the last `lookback` tokens (the window slides over what the call appends),
        # so only those go to C: a long context is not copied whole every call
        tails = [sq.tokens[-lookback:] for sq in seqs]
        sizes = [len(tail) + sq.max_new for tail, sq in zip(tails, seqs, strict=True)]
        offsets = [0]
        for size in sizes[:-1]:
            offsets.append(offsets[-1] + size)
        hist, hist_off = torch.empty(sum(sizes), dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)
        for tail, off in zip(tails, offsets, strict=True):
            hist[off:off + len(tail)] = torch.tensor(tail, dtype=torch.int64)
        width = max(len(sq.table) for sq in seqs)
        tables = torch.zeros((n_seqs, width), dtype=torch.int64)
        for i, sq in enumerate(seqs):
            tables[i, :len(sq.table)] = torch.tensor(sq.table, dtype=torch.int64)
        n_blocks = torch.tensor([len(sq.table) for sq in seqs], dtype=torch.int64)
        n_hist = torch.tensor([len(tail) for tail in tails], dtype=torch.int64)
        positions = torch.tensor([len(sq.tokens) - 1 for sq in seqs], dtype=torch.int64)
        max_new = torch.tensor([sq.max_new for sq in seqs], dtype=torch.int32)
        ks = torch.tensor([list(sq.k_by_match) for sq in seqs], dtype=torch.int32)
        stops = torch.tensor(stop_ids or [-1], dtype=torch.int64)
        stats = torch.zeros((num_steps, n_seqs, 3), dtype=torch.int32)
        step_rows = torch.zeros(num_steps, dtype=torch.int32)
        seconds = torch.zeros(num_steps, dtype=torch.float64)
        appended = torch.zeros(n_seqs, dtype=torch.int32)
        failed = ctypes.c_int(-1)
        rc = self.lib.spec_decode_steps(
            self._layers, len(self._layers), embed.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(), rot_dim,
            rope.data_ptr(), rope.data_ptr() + rows * rot_dim * rope.element_size(), x.data_ptr(), residual.data_ptr(),
            work.data_ptr(), scratch.data_ptr(), cpu_kernels.dtype_code(x.dtype), ctypes.byref(failed),
            m.norm.weight.data_ptr(), m.norm.eps, hidden.data_ptr(), ctypes.byref(_qweight(head)), logits.data_ptr(),
            n_seqs, hist.data_ptr(), hist_off.data_ptr(), n_hist.data_ptr(), positions.data_ptr(), tables.data_ptr(),
            n_blocks.data_ptr(), width, num_steps, max_new.data_ptr(), ks.data_ptr(), min_n, max_n, lookback,
            stops.data_ptr(), len(stop_ids), stats.data_ptr(), step_rows.data_ptr(), seconds.data_ptr(),
            appended.data_ptr())
        if rc == -4:
            raise IndexError("a request's block table ends before a draft row's position")
        if rc == -5:
            raise ValueError("spec_decode_steps rejected its arguments")
        if rc < 0:
            raise RuntimeError(f"decode_layer rejected layer {failed.value} (code {rc})")
        new = [hist[off + len(tail):off + len(tail) + n].tolist()
               for tail, off, n in zip(tails, offsets, appended.tolist(), strict=True)]
        verdicts = [[(mt, k, kept) for mt, k, kept in stats[:rc, i].tolist() if k >= 0] for i in range(n_seqs)]
        return SpecCall(new, verdicts, list(zip(step_rows[:rc].tolist(), seconds[:rc].tolist(), strict=True)))

    def _ensure_layers(self, caches: list[Any]) -> None:
        if self._caches_key != tuple(c[0].data_ptr() for c in caches):
            self._build(caches)

    def _buffers(self, m_rows: int) -> tuple[torch.Tensor, ...]:
        """decode_layers' buffers for `m_rows` rows: x and residual [M, hidden], the rotary rows (cos then sin),
        the layer's work area and the float32 scratch, sized as decode_layer.c asks."""
        embed, layer = self.model.embed_tokens.weight, self._layers[0]
        hidden = embed.shape[1]
        q_size = layer.heads * layer.head_dim
        qkv = q_size + 2 * layer.kv_heads * layer.head_dim
        widest = max(hidden, layer.inter)
        return (embed.new_empty((m_rows, hidden)), embed.new_empty((m_rows, hidden)),
                embed.new_empty(2 * m_rows * self.model.rotary.cos.shape[1]),
                embed.new_empty(m_rows * (2 * hidden + qkv + 2 * q_size + 3 * layer.inter)),
                torch.empty(m_rows * (widest + widest // 32 + 1) + 16, dtype=torch.float32))

    def _args(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], meta: Any,
              slots: torch.Tensor, lens: torch.Tensor) -> _Call:
        """decode_layers' arguments up to `dtype`, with the buffers of an M-row step they point into."""
        self._ensure_layers(caches)
        if input_ids.dtype != torch.int64 or positions.dtype != torch.int64:  # read as int64_t rows in C
            input_ids, positions = input_ids.to(torch.int64), positions.to(torch.int64)
        input_ids, positions = input_ids.contiguous(), positions.contiguous()
        m = self.model
        embed, cos_table, sin_table = m.embed_tokens.weight, m.rotary.cos, m.rotary.sin
        m_rows = input_ids.shape[0]
        x, residual, rope, work, scratch = self._buffers(m_rows)
        rot_dim = cos_table.shape[1]
        tables = meta.decode_block_tables
        args = (self._layers, len(self._layers), input_ids.data_ptr(), embed.data_ptr(), positions.data_ptr(),
                cos_table.data_ptr(), sin_table.data_ptr(), rot_dim, rope.data_ptr(),
                rope.data_ptr() + m_rows * rot_dim * rope.element_size(), x.data_ptr(), residual.data_ptr(), m_rows,
                slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), work.data_ptr(),
                scratch.data_ptr(), cpu_kernels.dtype_code(x.dtype))
        return _Call(args, x, residual, (input_ids, positions, rope, work, scratch))

    def _call(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], meta: Any,
              rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        call = self._args(input_ids, positions, caches, meta, meta.slot_mapping, meta.decode_context_lens)
        m_rows = input_ids.shape[0]
        x, residual = call.x, call.residual
        out = None
        final = (None, 0.0, None, 0, None)  # decode_layers' final-norm arguments: none
        if rows is not None:
            rows = rows.to(torch.int64).contiguous()
            out = x.new_empty((rows.shape[0], x.shape[1]))
            final = (self.model.norm.weight.data_ptr(), self.model.norm.eps, rows.data_ptr(), rows.shape[0],
                     out.data_ptr())
        failed = ctypes.c_int(-1)
        rc = self.lib.decode_layers(*call.args, ctypes.byref(failed), *final)
        if rc == -3:
            raise IndexError(f"a row to normalize lies outside the step's {m_rows} rows")
        if rc != 0:
            raise RuntimeError(f"decode_layer rejected layer {failed.value} (code {rc})")
        return x, residual, out
