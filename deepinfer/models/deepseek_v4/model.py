"""DeepSeek-V4 (`DeepseekV4ForCausalLM`): the decoder stack, its KV layer groups and weight loading.

Every layer is attention (attention.py: sliding-only, CSA or HCA by `layer_types`) then an MoE
(moe.py: hash or top-k routed by `mlp_layer_types`), each wrapped in a hyper-connection (hyper.py)
over `hc_mult` residual streams; a hyper head collapses the streams before the final norm.

KV layer groups (`kv_groups`, see kvcache/spec.py): the window's K=V of every layer
(`SlidingWindow`); per compression ratio present, the compressor rows of the still-open groups
(`CompressorWindow`, overlapping for CSA) and the compressed entries (`Compressed`). The runner
builds one `AttentionBatch` per group and `prepare_kv` turns them into the step's shared metadata.

Weights load from the checkpoint's names (`layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`,
`hc_head_fn`, ...; transformers' `save_pretrained` writes these, with a `model.` prefix on some).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from deepinfer.kvcache.spec import Compressed, CompressorWindow, KVGroup, KVSpec, SlidingWindow
from deepinfer.layers.attention import AttentionBatch
from deepinfer.layers.linear import Linear
from deepinfer.models.deepseek_v4.attention import V4Attention
from deepinfer.models.deepseek_v4.compressor import Rope, rms_norm
from deepinfer.models.deepseek_v4.hyper import HyperConnection, HyperHead
from deepinfer.models.deepseek_v4.kv import build_step_meta
from deepinfer.models.deepseek_v4.moe import MoE

_ROPE_LABELS = ("main", "compress")


def _rope(cfg, label: str, dtype: torch.dtype) -> Rope:
    params = cfg.rope_parameters[label]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = int(cfg.head_dim * params.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return Rope(inv, 1.0, dtype)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), layer_type=label)
    return Rope(inv, float(scaling), dtype)


class V4Layer(nn.Module):
    def __init__(self, cfg, layer_type: str, mlp_type: str) -> None:
        super().__init__()
        hc = (cfg.hc_mult, cfg.hidden_size)
        self.attn = V4Attention(cfg, layer_type)
        self.ffn = MoE(cfg, mlp_type == "hash_moe")
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.ffn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.hc_attn = HyperConnection(*hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.hc_ffn = HyperConnection(*hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, step_rope, ropes, cache: dict, meta
                ) -> torch.Tensor:
        post, comb, x = self.hc_attn(streams)
        out = self.attn(rms_norm(x, self.attn_norm, self.eps), step_rope, ropes, cache, meta)
        streams = HyperConnection.merge(streams, out, post, comb)
        post, comb, x = self.hc_ffn(streams)
        out = self.ffn(rms_norm(x, self.ffn_norm, self.eps), input_ids)
        return HyperConnection.merge(streams, out, post, comb)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, cfg, backend: Any, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        types = list(cfg.layer_types)
        rates = cfg.compress_rates
        csa, hca = rates.get("compressed_sparse_attention"), rates.get("heavily_compressed_attention")
        if "compressed_sparse_attention" in types and "heavily_compressed_attention" in types and csa == hca:
            raise ValueError(f"CSA and HCA share compression ratio {csa}: their KV groups would collide")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4Layer(cfg, t, m) for t, m in zip(types, cfg.mlp_layer_types, strict=True))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.hc_mult = cfg.hc_mult
        self.ropes = {label: _rope(cfg, label, dtype) for label in _ROPE_LABELS}
        self.kv_groups = self._groups(types)
        self.kv_specs: list[KVSpec] = [g.spec for g in self.kv_groups]
        # the MTP layer (mtp.py) drafts from the last residual streams of the step's rows: kept when asked
        self.keep_streams = False
        self.step_streams: torch.Tensor | None = None

    # ------------------------------------------------------------------ KV groups and caches

    def _groups(self, types: list[str]) -> list[KVGroup]:
        groups = [KVGroup(tuple(range(len(types))), SlidingWindow(int(self.config.sliding_window)))]
        for kind in ("compressed_sparse_attention", "heavily_compressed_attention"):
            layers = tuple(i for i, t in enumerate(types) if t == kind)
            if layers:
                m = int(self.config.compress_rates[kind])
                groups.append(KVGroup(layers, CompressorWindow(m, kind == "compressed_sparse_attention")))
                groups.append(KVGroup(layers, Compressed(m)))
        return groups

    def _group_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> list[int]:
        """Bytes one block of each group takes, summed over the group's layers."""
        elem = torch.tensor([], dtype=dtype).element_size()
        out = []
        for g in self.kv_groups:
            total = 0
            for i in g.layers:
                attn = self.layers[i].attn
                if isinstance(g.spec, SlidingWindow):
                    total += block_size * attn.head_dim
                elif isinstance(g.spec, CompressorWindow):
                    total += block_size * attn.row_width
                else:
                    idx = attn.indexer.head_dim if attn.indexer is not None else 0
                    total += g.spec.entries_per_block(block_size) * (attn.head_dim + idx)
            out.append(total * elem)
        return out

    def kv_group_blocks(self, budget: int, block_size: int, dtype: torch.dtype, max_num_seqs: int,
                        max_num_batched_tokens: int) -> tuple[list[int], int]:
        """Blocks per group from `budget` bytes, and the tokens one sequence can then hold. Window-like
        groups need at most their window (+1 block) per running sequence plus one step's new tokens and
        get twice that (the rest keeps cached windows), scaled down to half the budget at most (but never
        below one sequence's need); the compressed groups share what is left so that each covers the
        same number of tokens."""
        per_block = self._group_bytes_per_block(block_size, dtype)
        counts = [0] * len(self.kv_groups)
        step_blocks = -(-max_num_batched_tokens // block_size)
        windows = [i for i, g in enumerate(self.kv_groups) if isinstance(g.spec, SlidingWindow | CompressorWindow)]
        want = {i: 2 * (max_num_seqs * (-(-self.kv_groups[i].spec.window // block_size) + 1) + step_blocks)
                for i in windows}
        scale = min(1.0, budget / 2 / max(1, sum(want[i] * per_block[i] for i in windows)))
        left = budget
        for i in windows:
            least = -(-self.kv_groups[i].spec.window // block_size) + 1 + step_blocks
            counts[i] = max(least, int(want[i] * scale))
            left -= counts[i] * per_block[i]
        compressed = [i for i, g in enumerate(self.kv_groups) if isinstance(g.spec, Compressed)]
        if not compressed:
            return counts, 1 << 40  # nothing grows with the sequence
        for i in compressed:
            self.kv_groups[i].spec.check(block_size)
        # tokens covered: n tokens take n / tokens_per_block blocks of each compressed group
        bytes_per_token = sum(per_block[i] / self.kv_groups[i].spec.tokens_per_block(block_size) for i in compressed)
        tokens = max(0, left) / bytes_per_token
        for i in compressed:
            counts[i] = max(2, int(tokens // self.kv_groups[i].spec.tokens_per_block(block_size)))
        capacity = min(counts[i] * self.kv_groups[i].spec.tokens_per_block(block_size) for i in compressed)
        return counts, capacity

    def allocate_kv_caches(self, group_blocks: list[int], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> list[dict[str, torch.Tensor]]:
        caches: list[dict[str, torch.Tensor]] = [{} for _ in self.layers]
        for g, n in zip(self.kv_groups, group_blocks, strict=True):
            for i in g.layers:
                attn = self.layers[i].attn
                if isinstance(g.spec, SlidingWindow):
                    caches[i]["window"] = torch.zeros(n, block_size, attn.head_dim, dtype=dtype, device=device)
                elif isinstance(g.spec, CompressorWindow):
                    caches[i]["rows"] = torch.zeros(n, block_size, attn.row_width, dtype=dtype, device=device)
                else:
                    epb = g.spec.entries_per_block(block_size)
                    caches[i]["comp"] = torch.zeros(n, epb, attn.head_dim, dtype=dtype, device=device)
                    if attn.indexer is not None:
                        caches[i]["icomp"] = torch.zeros(n, epb, attn.indexer.head_dim, dtype=dtype, device=device)
        return caches

    def group_tensors(self, caches: list[dict[str, torch.Tensor]], group: int) -> list[torch.Tensor]:
        """The cache tensors of KV group `group`'s layers (block index first), in tier payload order: per
        layer the compressed entries, then CSA's indexer keys (`kvcache/blocks.py`)."""
        g = self.kv_groups[group]
        names = {SlidingWindow: ("window",), CompressorWindow: ("rows",), Compressed: ("comp", "icomp")}[type(g.spec)]
        return [caches[i][n] for i in g.layers for n in names if n in caches[i]]

    def prepare_kv(self, batches: list[AttentionBatch]) -> list[Any]:
        """The step's metadata (one object every layer shares), once per group as the runner expects."""
        meta = build_step_meta(self.kv_specs, batches, self.lm_head.weight.device)
        return [meta] * len(batches)

    # ------------------------------------------------------------------ forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], metas: list[Any],
                logits_indices: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(self.hidden_states(input_ids, positions, caches, metas, logits_indices))

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], metas: list[Any],
                      logits_indices: torch.Tensor) -> torch.Tensor:
        meta = metas[0]
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        step_rope = {label: rope(positions) for label, rope in self.ropes.items()}
        for layer, cache in zip(self.layers, caches, strict=True):
            streams = layer(streams, input_ids, step_rope, self.ropes, cache, meta)
        if self.keep_streams:
            self.step_streams = streams
        streams = streams[logits_indices]
        return rms_norm(self.hc_head(streams), self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def full_logits(self, input_ids: torch.Tensor, block_size: int = 16) -> torch.Tensor:
        """Logits [S, vocab] of one sequence computed in one step over fresh caches (tests, tools)."""
        s = int(input_ids.numel())
        dtype, dev = self.lm_head.weight.dtype, self.lm_head.weight.device
        counts = [g.spec.num_blocks(s, block_size) + 1 for g in self.kv_groups]
        caches = self.allocate_kv_caches(counts, block_size, dtype, dev)
        batches = [AttentionBatch([s], [s], [list(range(n))], int(s == 1), torch.zeros(0, dtype=torch.long),
                                  block_size) for n in counts]
        pos = torch.arange(s, device=dev)
        return self(input_ids.to(dev), pos, caches, self.prepare_kv(batches), pos)

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in; raises on an unknown or missing tensor (MTP layers are skipped)."""
        params = dict(self.named_parameters())
        persistent = set(self.state_dict())  # not the experts' `slot_of` (derived, not in checkpoints)
        params.update((n, b) for n, b in self.named_buffers() if n in persistent)
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            target = _our_name(ckpt_name)
            if target is None:
                continue
            name, part = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching parameter")
            dst = params[name]
            if part is not None:  # one expert's slice of a stacked expert parameter
                expert, proj = part
                dst = self.get_submodule(name.removesuffix(".w13").removesuffix(".w2")).expert_weight(expert, proj)
                if dst is None:  # held by another expert-parallel rank
                    loaded.add(f"{name}#{part}")
                    continue
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(tensor)
            loaded.add(name if part is None else f"{name}#{part}")
        missing = [n for n in params if n not in loaded and not any(k.startswith(n + "#") for k in loaded)]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        experts = self.config.n_routed_experts
        for name in params:
            if name.endswith(".ffn.experts.w13") or name.endswith(".ffn.experts.w2"):
                n = sum(1 for k in loaded if k.startswith(name + "#"))
                want = 2 * experts if name.endswith("w13") else experts
                if n != want:
                    raise ValueError(f"{name}: {n} of {want} expert tensors in the checkpoint")


_LEAF = {"hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale",
         "embed.weight": "embed_tokens.weight", "head.weight": "lm_head.weight", "norm.weight": "norm"}
_BARE = (".q_norm.weight", ".norm.weight", ".wo_a.weight", "attn_norm.weight", "ffn_norm.weight")


def _our_name(ckpt: str) -> tuple[str, tuple | None] | None:
    """Checkpoint tensor name -> (our parameter, expert slice or None); None to skip the tensor."""
    name = ckpt.removeprefix("model.")
    if name.startswith("mtp.") or "rotary_emb" in name:
        return None
    name = _LEAF.get(name, name)
    for which in ("attn", "ffn"):
        for leaf in ("fn", "base", "scale"):
            name = name.replace(f".hc_{which}_{leaf}", f".hc_{which}.{leaf}")
    if ".ffn.experts." in name:  # layers.N.ffn.experts.E.w1.weight
        head, rest = name.split(".ffn.experts.")
        expert, w, _ = rest.split(".")
        if w == "w2":
            return f"{head}.ffn.experts.w2", (int(expert), "down")
        return f"{head}.ffn.experts.w13", (int(expert), "gate" if w == "w1" else "up")
    name = name.replace(".ffn.gate.weight", ".ffn.gate_weight").replace(".ffn.gate.bias", ".ffn.gate_bias")
    name = name.replace(".ffn.gate.tid2eid", ".ffn.tid2eid").replace(".ffn.shared_experts.", ".ffn.shared.")
    if name.endswith(_BARE):
        name = name.removesuffix(".weight")
    return name, None
