"""Model identity by content: copies of a model at different paths share the KV store, other weights never
do, and a file rewritten in place is a new identity even with its size and mtime put back. Real files,
a real store in tmp_path, the offline `LLM`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deepinfer.weights import default_model_path, resolve_model
from deepinfer.weights.identity import file_digest, hash_file
from deepinfer.weights.loader import identity_cache_dir
from tests.kvcache.test_kv_tiers import GREEDY, _llm, _prompt, _run
from tests.models.test_models_vs_hf import _assert_all_free


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Overwrite a file's bytes (same inode, same size) and put its mtime back, as a careless sync tool might."""
    st = path.stat()
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def test_digest_cache_hits_by_stat_and_rehashes_a_rewritten_file(tmp_path):
    cache = tmp_path / "cache"
    f = tmp_path / "weights.bin"
    f.write_bytes(b"a" * 4096)
    first = file_digest(f, cache)
    assert first == hash_file(f)
    [entry] = cache.glob("*.json")
    # the cache is what answers while the file's stat matches: a doctored entry is believed ...
    doctored = json.loads(entry.read_text())
    doctored["digest"] = "cached-not-hashed"
    entry.write_text(json.dumps(doctored))
    assert file_digest(f, cache) == "cached-not-hashed"
    # ... and a rewrite with the same size and mtime changes ctime (utime sets it), so the entry no longer
    # matches and the file is hashed again
    _rewrite_in_place(f, b"b" * 4096)
    second = file_digest(f, cache)
    assert second == hash_file(f) != first
    # the identity does not depend on the path: a copy elsewhere (new inode, new mtime) has the same digest
    g = tmp_path / "elsewhere" / "copy.bin"
    g.parent.mkdir()
    shutil.copyfile(f, g)
    assert file_digest(g, cache) == second
    # an unwritable cache dir only costs the hash
    assert file_digest(f, tmp_path / "weights.bin" / "not-a-dir") == second


def test_copies_at_other_paths_share_the_store_and_other_weights_never_do(tiny_models, tmp_path):
    src = tiny_models["llama"]
    a = _copy_model(src, tmp_path / "host-a" / "llama")
    b = _copy_model(src, tmp_path / "host-b" / "models" / "llama-copy")
    other = _copy_model(src, tmp_path / "other" / "llama")
    [weights] = other.glob("*.safetensors")
    tensors = load_file(str(weights))
    name = next(k for k in tensors if "layers.0.self_attn.k_proj" in k)
    tensors[name] = tensors[name] + 0.05 * torch.randn_like(tensors[name])  # same shapes, same config
    save_file(tensors, str(weights), metadata={"format": "pt"})

    ids = {p: resolve_model(p).kv_identity(torch.float32) for p in (a, b, other)}
    assert ids[a] == ids[b] != ids[other]
    assert resolve_model(a).kv_identity(torch.bfloat16) != ids[a]  # the compute dtype is part of it

    store, prompt = tmp_path / "store", _prompt(21, 80)
    with _llm(a, store) as llm:
        ref = _run(llm, prompt)
        assert ref.num_cached_tokens == 0
    with _llm(b, store) as llm:
        out = _run(llm, prompt)
        assert out.num_cached_tokens_by_tier["store"] == out.num_cached_tokens >= len(prompt) - 16
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        _assert_all_free(llm)
    with _llm(other, store) as llm:
        out = _run(llm, prompt)
        assert out.num_cached_tokens == 0
        assert llm.engine.stats()["kv_store_corrupt"] == 0  # not even found: its block hashes differ
        _assert_all_free(llm)


def test_hf_file_rewritten_in_place_is_a_new_identity(tiny_models, tmp_path):
    model = _copy_model(tiny_models["qwen2"], tmp_path / "qwen2")
    before = resolve_model(model).kv_identity(torch.float32)
    assert resolve_model(model).kv_identity(torch.float32) == before  # stable (and now from the digest cache)
    [weights] = model.glob("*.safetensors")
    tensors = load_file(str(weights))
    name = next(k for k in tensors if k.endswith("v_proj.bias"))
    tensors[name] = tensors[name] + 1.0
    tmp = tmp_path / "rewritten.safetensors"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    _rewrite_in_place(weights, tmp.read_bytes())
    assert resolve_model(model).kv_identity(torch.float32) != before


def test_gguf_copies_share_identity_and_conversion(tmp_path):
    gguf = default_model_path()
    copies = []
    for sub in ("one", "two/deeper"):
        (tmp_path / sub).mkdir(parents=True)
        copies.append(Path(shutil.copy2(gguf, tmp_path / sub / "renamed.Q4_1.gguf")))
    files = [resolve_model(None), *(resolve_model(c) for c in copies)]
    # the conversion is keyed by content too: no copy converts again, and all load the same weights
    assert len({f.directory for f in files}) == 1
    assert len({f.kv_identity(torch.float32) for f in files}) == 1
    # a GGUF rewritten in place (one byte of tensor data flipped, mtime put back) is another model
    data = bytearray(copies[0].read_bytes())
    data[-1000] ^= 0xFF
    _rewrite_in_place(copies[0], bytes(data))
    changed = file_digest(copies[0], identity_cache_dir())  # the real cache, which has an entry for the old bytes
    assert changed != files[1].source_digest
    assert changed == hash_file(copies[0])


def test_gguf_copy_gets_cached_tokens_from_the_store_of_the_original(tmp_path):
    gguf = default_model_path()
    copy = Path(shutil.copy2(gguf, tmp_path / "SmolLM2-copy.gguf"))
    store, prompt = tmp_path / "store", _prompt(22, 48)
    with _llm(gguf, store, kv_cache_memory="32MiB") as llm:
        ref = llm.generate([prompt], GREEDY)[0]
    with _llm(copy, store, kv_cache_memory="32MiB") as llm:
        out = llm.generate([prompt], GREEDY)[0]
        assert out.num_cached_tokens_by_tier["store"] == out.num_cached_tokens >= len(prompt) - 16
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        _assert_all_free(llm)
