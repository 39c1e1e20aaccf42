"""Dense decoder-only transformer in the Llama layout; Qwen2 and Qwen3 are configured variants.

The model consumes a flattened batch (all new tokens of all sequences of one
step, [T]) with their positions, and returns logits only for the rows the
sampler needs. Q/K/V and gate/up projections are fused into one matmul each;
`load_weights` maps HF checkpoint names onto the fused parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from deepinfer.kvcache.spec import FullAttention, KVSpec, SlidingWindow, group_layers
from deepinfer.layers.activation import silu_and_mul
from deepinfer.layers.attention import AttentionBackend
from deepinfer.layers.batched_decode import BatchedDecoder
from deepinfer.layers.fused_decode import FusedDecoder
from deepinfer.layers.gguf_kernels import QuantizedWeight, llama_unpermute_order
from deepinfer.layers.linear import Linear
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RotaryEmbedding, apply_rotary_qk

if TYPE_CHECKING:
    from deepinfer.lora.layers import LoRALayers


class DecoderAttention(nn.Module):
    """`norm_cls`: the per-head Q/K norm when `qk_norm` (Gemma's adds 1 to its weight); `scale` multiplies
    q.k in the backend (None: head_dim ** -0.5)."""

    def __init__(self, cfg, backend: AttentionBackend, bias: bool, qk_norm: bool, norm_cls: type = RMSNorm,
                 scale: float | None = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = norm_cls(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = norm_cls(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.scale = scale
        self.backend = backend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, meta: Any) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_qk(q, k, cos, sin)
        out = self.backend.forward(q, k, v, cache, meta, scale=self.scale)
        return self.o_proj(out.view(t, self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, cfg, bias: bool = False) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {act!r}")
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """`mlp`: the feed-forward block, any module mapping [T, hidden] -> [T, hidden] (dense `GatedMLP`, or a
    mixture of experts)."""

    def __init__(self, cfg, backend: AttentionBackend, attn_bias: bool, qk_norm: bool, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, backend, attn_bias, qk_norm)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, cache, meta
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input before its norm, or the previous layer's output still to be
        added to `residual` (None at the first layer). Returns (output, residual), output not yet added."""
        if residual is None:
            residual = x  # the embedding output; fused norms update it in place from here on
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


def layer_kv_specs(cfg, max_positions: int) -> list[KVSpec]:
    """Each layer's KV spec from an HF config: `layer_types` ("sliding_attention" layers keep a window of
    `sliding_window` tokens), or Mistral's `sliding_window` on every layer when there are no layer types.
    A window no shorter than `max_positions` never slides: such layers are full attention."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if window is not None and window >= max_positions:
        window = None
    types = list(getattr(cfg, "layer_types", None) or [])
    if not types:
        types = ["sliding_attention" if window else "full_attention"] * n
    if len(types) != n:
        raise ValueError(f"config has {len(types)} layer_types for {n} layers")
    specs: list[KVSpec] = []
    for t in types:
        if t == "full_attention":
            specs.append(FullAttention())
        elif t == "sliding_attention":
            specs.append(SlidingWindow(int(window)) if window else FullAttention())
        else:
            raise ValueError(f"unsupported layer type {t!r} (sliding_window={window})")
    return specs


class LlamaForCausalLM(nn.Module):
    """Llama / SmolLM / Mistral (full attention). Subclasses flip `attn_bias` and `qk_norm`."""

    attn_bias_default = False
    qk_norm = False

    def __init__(self, cfg, backend: AttentionBackend, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        attn_bias = getattr(cfg, "attention_bias", self.attn_bias_default)
        mlp_bias = getattr(cfg, "mlp_bias", False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, attn_bias, self.qk_norm, self.make_mlp(cfg, i, mlp_bias))
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        self.rotary = RotaryEmbedding(cfg, max_positions, dtype)
        self.fused: FusedDecoder | None = None
        self.batched: BatchedDecoder | None = None
        self.lora: LoRALayers | None = None  # LoRA adapters, when the engine serves them (deepinfer/lora)
        self._set_kv_groups(cfg, max_positions)

    def make_mlp(self, cfg, layer: int, bias: bool) -> nn.Module:
        """Layer `layer`'s feed-forward block (subclasses with mixture-of-experts layers override this)."""
        return GatedMLP(cfg, bias)

    def _set_kv_groups(self, cfg, max_positions: int) -> None:
        self.kv_groups = group_layers(layer_kv_specs(cfg, max_positions))
        # layer index -> its group's index: `forward` hands each layer its group's attention metadata
        self.layer_group = [0] * cfg.num_hidden_layers
        for gi, group in enumerate(self.kv_groups):
            for i in group.layers:
                self.layer_group[i] = gi

    def enable_fused_decode(self) -> bool:
        """Run small all-decode steps through whole-layer C calls (see layers/fused_decode.py) when
        every projection has GGUF blocks attached; returns whether it is on."""
        fused = FusedDecoder(self)
        self.fused = fused if fused.supported() and len(self.kv_groups) == 1 \
            and isinstance(self.kv_groups[0].spec, FullAttention) else None
        return self.fused is not None

    def enable_batched_decode(self) -> bool:
        """Run the kernel-row steps the whole-layer path does not take with C calls between the matmuls
        (see layers/batched_decode.py) when every layer qualifies; call after the weights are final
        (loaded, cast, packed). Returns whether it is on."""
        batched = BatchedDecoder(self)
        self.batched = batched if all(isinstance(layer.mlp, GatedMLP) for layer in self.layers) \
            and len(self.kv_groups) == 1 and isinstance(self.kv_groups[0].spec, FullAttention) \
            and batched.supported() else None
        return self.batched is not None

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].self_attn.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], metas: list[Any],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; `metas`: the attention metadata of each KV group (`kv_groups`);
        returns float32 logits [len(logits_indices), vocab]."""
        return self.compute_logits(self.hidden_states(input_ids, positions, caches, metas, logits_indices))

    def plain_logits(self) -> bool:
        """Whether `compute_logits` is the LM head's product alone (a subclass that changes it, e.g. soft-caps
        the logits, says no), so a C path may take the head's product for the logits."""
        return type(self).compute_logits is LlamaForCausalLM.compute_logits

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Final hidden states [rows, hidden] -> float32 logits [rows, vocab]; `float32=False`: in the head's
        dtype (the sampler widens them only where it needs to; greedy rows take their argmax as they are)."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], metas: list[Any],
                      logits_indices: torch.Tensor,
                      input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The forward up to the LM head: the final (normed) hidden states of the rows `logits_indices`
        [len(logits_indices), hidden] (`compute_logits` turns them into logits, in row chunks if need be).
        `input_embeds` (rows, vectors): those rows' input embeddings instead of their tokens' (an image's
        encoded tiles in place of its placeholder tokens)."""
        # a step with LoRA rows skips the whole-layer C path (it reads the base weights alone); the batched path
        # calls each projection's `forward`, which adds the adapters
        plain = self.lora is None or not self.lora.active
        if plain and input_embeds is None and self.fused is not None and self.fused.accepts(input_ids, metas[0]):
            return self.fused.final_hidden(input_ids, positions, caches, metas[0], logits_indices)
        x = self.embed_tokens(input_ids)
        if input_embeds is not None:
            x[input_embeds[0]] = input_embeds[1].to(x.dtype)
        cos, sin = self.rotary.lookup(positions)
        if self.batched is not None and self.batched.accepts(x, metas[0]):
            x, residual = self.batched.run(x, cos, sin, caches, metas[0])
        else:
            residual = None
            for layer, cache, gi in zip(self.layers, caches, self.layer_group, strict=True):
                x, residual = layer(x, residual, cos, sin, cache, metas[gi])
        x, residual = x[logits_indices], residual[logits_indices]
        return self.norm(x, residual)[0]

    # ------------------------------------------------------------------ weights

    _FUSED = {  # HF name suffix -> (our parameter, shard index)
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into this model; raises if a parameter is missing or unexpected."""
        params = dict(self.named_parameters(remove_duplicate=False))
        if self.tie_word_embeddings:
            del params["lm_head.weight"]
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding serves as the output projection
            for suffix, (fused, shard) in self._FUSED.items():
                part = f".{suffix}."
                if part in name:
                    name = name.replace(part, f".{fused}.")
                    param = params[name]
                    offset, size = self._shard_range(fused, param.shape[0], shard)
                    with torch.no_grad():
                        param.narrow(0, offset, size).copy_(tensor)
                    loaded.add(f"{name}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter")
                if params[name].shape != tensor.shape:
                    raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != "
                                     f"model shape {tuple(params[name].shape)}")
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
        expected = set()
        elsewhere = self._params_loaded_elsewhere()
        for name in params:
            if name in elsewhere:
                continue
            if ".qkv_proj." in name:
                expected |= {f"{name}#{i}" for i in range(3)}
            elif ".gate_up_proj." in name:
                expected |= {f"{name}#{i}" for i in range(2)}
            else:
                expected.add(name)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _params_loaded_elsewhere(self) -> set[str]:
        """Parameters `load_weights` does not fill nor check (a subclass loads and checks them itself)."""
        return set()

    def attach_gguf(self, tensors: dict[str, QuantizedWeight],
                    experts: dict[str, list[QuantizedWeight]] | None = None) -> int:
        """Attach a GGUF file's quantized blocks to the matching projections; returns how many. `experts`
        (`read_quantized_experts`: stacked routed-expert blocks) is for the mixture-of-experts subclasses."""
        attn = self.layers[0].self_attn
        permuted = getattr(self.config, "model_type", "") in ("llama", "mistral")  # llama.cpp's Q/K row order

        def get(name: str, heads: int | None = None) -> QuantizedWeight | None:
            w = tensors.get(name)
            if w is not None and heads and permuted:
                w = w.permute_rows(llama_unpermute_order(w.n, heads))
            return w

        targets: list[tuple[Linear, list[QuantizedWeight | None]]] = []
        for i, layer in enumerate(self.layers):
            b = f"blk.{i}."
            targets += [
                (layer.self_attn.qkv_proj, [get(b + "attn_q.weight", attn.num_heads),
                                            get(b + "attn_k.weight", attn.num_kv_heads), get(b + "attn_v.weight")]),
                (layer.self_attn.o_proj, [get(b + "attn_output.weight")]),
            ]
            if isinstance(layer.mlp, GatedMLP):  # a mixture of experts multiplies its dense weights
                targets += [
                    (layer.mlp.gate_up_proj, [get(b + "ffn_gate.weight"), get(b + "ffn_up.weight")]),
                    (layer.mlp.down_proj, [get(b + "ffn_down.weight")]),
                ]
        head = "token_embd.weight" if self.tie_word_embeddings else "output.weight"
        targets.append((self.lm_head, [get(head)]))
        attached = 0
        for module, parts in targets:
            if any(p is None for p in parts) or len({p.kind for p in parts}) != 1:
                continue
            module.attach(parts[0] if len(parts) == 1 else QuantizedWeight.concat(parts))
            attached += 1
        return attached

    def _shard_range(self, fused: str, rows: int, shard: int) -> tuple[int, int]:
        """(first row, rows) of shard `shard` of a fused parameter of `rows` rows."""
        attn = self.layers[0].self_attn
        # gate_up: two halves (a model's dense layers need not be layer 0's size)
        sizes = [attn.q_size, attn.kv_size, attn.kv_size] if fused.endswith("qkv_proj") else [rows // 2] * 2
        return sum(sizes[:shard]), sizes[shard]

    def lora_target(self, name: str) -> tuple[Linear, int, int] | None:
        """The projection a LoRA adapter's module `name` adapts (the checkpoint's module naming, e.g.
        `model.layers.3.self_attn.q_proj`): (our Linear, its first output feature, output features), a shard of
        a fused projection for Q/K/V and gate/up; None where `name` is no decoder-layer projection of this model."""
        name = getattr(self, "text_weight_name", lambda n: n)(name + ".weight").removesuffix(".weight")
        name = name.removeprefix("model.")
        shard = None
        for suffix, (fused, index) in self._FUSED.items():
            if name.endswith("." + suffix):
                name, shard = name[:-len(suffix)] + fused, index
                break
        if not name.startswith("layers."):
            return None
        try:
            module = self.get_submodule(name)
        except AttributeError:
            return None
        if not isinstance(module, Linear):
            return None
        if shard is None:
            return module, 0, module.out_features
        return module, *self._shard_range(name.rpartition(".")[2], module.out_features, shard)
