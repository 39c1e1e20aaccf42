"""LoRA adapters against peft (the reference): greedy tokens of a batch that mixes the base model and several
adapters equal peft's model of each, on tiny random models of the Llama family, float32; with chunked prefill,
prefix hits, preemption and speculative decoding; and the adapters' KV never shared with the base model's."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.lora import LoRARequest
from tests.conftest import hf_greedy
from tests.lora.adapters import ALL_PROJECTIONS, peft_model, write_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]


def _prompts(seed: int, lengths: list[int], vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _assert_all_free(llm: LLM) -> None:
    pool = llm.engine.core.kv.pool
    assert pool.num_free == pool.num_blocks
    assert not llm.engine.core.kv.block_tables


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """Per arch: two adapters (all seven projections at rank 8; attention only at rank 4 with rsLoRA)."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for arch in ARCHS:
        out[arch] = {
            "all": write_adapter(tiny_models[arch], root / arch / "all", ALL_PROJECTIONS, rank=8, alpha=16, seed=1),
            "attn": write_adapter(tiny_models[arch], root / arch / "attn", ["q_proj", "k_proj", "v_proj", "o_proj"],
                                  rank=4, alpha=8, seed=2, rslora=True),
        }
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_equals_peft(arch, tiny_models, hf_models, adapters):
    paths = adapters[arch]
    prompts = _prompts(11, [5, 17, 40, 9, 33, 1])
    which = [None, "all", "attn", "all", None, "attn"]
    llm = LLM(str(tiny_models[arch]), dtype="float32", kv_cache_memory="64MiB", enable_lora=True,
              lora_modules={"all": str(paths["all"])}, max_loras=2)
    requests = [None if w is None else LoRARequest(w, 0, str(paths[w])) for w in which]
    outs = llm.generate(prompts, GREEDY, lora_request=requests)
    refs = {None: hf_models[arch], **{w: peft_model(tiny_models[arch], paths[w]) for w in ("all", "attn")}}
    for p, w, o in zip(prompts, which, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(refs[w], p, 12), (arch, w)
    # the adapters change what the model says (else the comparison above would not see them)
    assert hf_greedy(refs["all"], prompts[1], 12) != hf_greedy(refs[None], prompts[1], 12)
    _assert_all_free(llm)


def test_chunked_prefill_prefix_hits_and_preemption(tiny_models, hf_models, adapters):
    """Chunks of 16 tokens, a prompt shared by the base model and an adapter (no KV shared between them, but
    within each), a KV pool small enough to preempt: every output still equals peft's."""
    arch = "llama"
    paths = adapters[arch]
    ref = peft_model(tiny_models[arch], paths["all"])
    shared = _prompts(12, [48])[0]
    prompts = [shared + t for t in _prompts(13, [3, 7, 20, 11])]
    probe = LLM(str(tiny_models[arch]), dtype="float32", kv_cache_memory="64MiB")
    per_block = probe.engine.core.runner.kv_bytes_per_block
    del probe
    llm = LLM(str(tiny_models[arch]), dtype="float32", kv_cache_memory=10 * per_block, enable_lora=True,
              lora_modules={"all": str(paths["all"])}, max_num_batched_tokens=16, max_loras=1)
    base_first = llm.generate([prompts[0]], GREEDY)[0]
    lora_first = llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest("all"))[0]
    assert base_first.num_cached_tokens == 0
    assert lora_first.num_cached_tokens == 0  # the base model's blocks of the same tokens are not its KV
    assert lora_first.outputs[0].token_ids == hf_greedy(ref, prompts[0], 12)
    which = [None, "all", "all", None]
    outs = llm.generate(prompts, GREEDY, lora_request=[None if w is None else LoRARequest(w) for w in which])
    for p, w, o in zip(prompts, which, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(ref if w else hf_models[arch], p, 12)
    assert outs[1].num_cached_tokens >= 48  # the adapter's own blocks of the shared prefix
    assert llm.engine.core.scheduler.num_preemptions > 0
    _assert_all_free(llm)


def test_speculative_decoding_with_an_adapter(tiny_models, adapters):
    """n-gram drafts verified with the adapter's rows: the same tokens as without speculation."""
    arch = "llama"
    path = str(adapters[arch]["all"])
    ref = peft_model(tiny_models[arch], adapters[arch]["all"])
    rng = random.Random(14)
    phrase = [rng.randrange(3, 49152) for _ in range(6)]
    prompts = [phrase * 5, _prompts(16, [30])[0]]  # the first drafts from its own repeats
    llm = LLM(str(tiny_models[arch]), dtype="float32", kv_cache_memory="64MiB", enable_lora=True,
              lora_modules={"all": path}, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                              "adaptive": False})
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=LoRARequest("all"))
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, 20)
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_verifications"] > 0
    _assert_all_free(llm)


def test_bad_adapters_are_refused_by_name(tiny_models, adapters, tmp_path):
    arch = "llama"
    llm = LLM(str(tiny_models[arch]), dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8 is above --max-lora-rank 4"):
        llm.generate(["Hi"], GREEDY, lora_request=LoRARequest("all", 1, str(adapters[arch]["all"])))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate(["Hi"], GREEDY, lora_request=LoRARequest("x", 1, str(tmp_path)))
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        llm.generate(["Hi"], GREEDY, lora_request=LoRARequest("nope"))
    # an adapter made for another model (qwen2's widths) does not fit llama's projections
    with pytest.raises(ValueError, match="another base model"):
        llm.generate(["Hi"], GREEDY, lora_request=LoRARequest("other", 1, str(adapters["qwen3"]["attn"])))
    assert llm.engine.lora_adapter_names() == []  # nothing half registered
    assert not llm.engine.has_unfinished()
    plain = LLM(str(tiny_models[arch]), dtype="float32", kv_cache_memory="64MiB")
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate(["Hi"], GREEDY, lora_request=LoRARequest("attn", 1, str(adapters[arch]["attn"])))


def test_bfloat16_adapter_distribution_close_to_peft(tiny_models, adapters):
    """bf16 (the CPU default where AVX-512 BF16 / AMX exist) is not token-identical to float32. With an adapter,
    the chosen tokens' log-probabilities after a prefill and after decodes must stay as close to peft's float32
    model as peft's own bf16 model is (1.5x its largest miss on these prompts, at least 0.05: peft's bf16 itself
    misses its float32 by up to ~0.1 here, where the base model's bf16 test in tests/models/test_models_vs_hf.py
    holds 0.05), and each chosen token must be (nearly) peft's best."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    arch = "llama"
    ref = peft_model(tiny_models[arch], adapters[arch]["all"])
    ref16 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_models[arch]),
                                                                           dtype=torch.bfloat16),
                                      str(adapters[arch]["all"])).eval()
    prompts = _prompts(17, [5, 23, 40])
    llm = LLM(str(tiny_models[arch]), dtype="bfloat16", kv_cache_memory="64MiB", enable_lora=True,
              lora_modules={"all": str(adapters[arch]["all"])})
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    ours, peft16 = [], []
    for p, o in zip(prompts, llm.generate(prompts, params, lora_request=LoRARequest("all")), strict=True):
        seq = torch.tensor([p + o.outputs[0].token_ids])
        with torch.no_grad():
            f32 = torch.log_softmax(ref(seq).logits[0].float(), -1)
            b16 = torch.log_softmax(ref16(seq).logits[0].float(), -1)
        for i, (tok, lps) in enumerate(zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)):
            row = f32[len(p) - 1 + i]
            assert row.max() - row[tok] < 0.1, f"token {i}: ours is not (nearly) peft's best"
            ours.append(abs(lps[tok].logprob - row[tok].item()))
            peft16.append(abs(b16[len(p) - 1 + i, tok].item() - row[tok].item()))
    assert max(ours) < max(0.05, 1.5 * max(peft16)), (max(ours), max(peft16))
    _assert_all_free(llm)


def test_vision_language_model_with_images(tiny_gemma3_vlm, tmp_path):
    """Gemma 3 with its vision tower and an adapter on its language model's projections (peft's regex form, as
    adapters of VLMs are written so the tower is left alone): a prompt with an image, one with two and one without,
    in one batch with the base model, equal peft's model; an adapter that also adapts the tower is refused."""
    from transformers import AutoProcessor

    from tests.models.vlm_tiny import random_image

    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    path = write_adapter(tiny_gemma3_vlm, tmp_path / "text", targets, rank=4, alpha=8, seed=5, vision=True)
    ref = peft_model(tiny_gemma3_vlm, path, vision=True)
    processor = AutoProcessor.from_pretrained(str(tiny_gemma3_vlm))

    def chat(images: int, question: str) -> str:
        content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
        return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)

    cases = [(chat(1, "What is in this picture?"), [random_image(0, 40, 70)]),
             (chat(2, "Compare the two."), [random_image(1, 30, 30), random_image(2, 64, 50)]),
             (chat(0, "No picture this time."), [])]
    llm = LLM(str(tiny_gemma3_vlm), dtype="float32", kv_cache_memory="64MiB", enable_lora=True,
              lora_modules={"text": str(path)})
    prompts = [{"prompt": t, "multi_modal_data": {"image": i}} if i else {"prompt": t} for t, i in cases]
    outs = llm.generate(prompts + prompts[:1], GREEDY, lora_request=[LoRARequest("text")] * 3 + [None])
    for (text, images), out in zip(cases, outs[:3], strict=True):
        enc = processor(text=text, images=[images] if images else None, return_tensors="pt")
        with torch.no_grad():
            want = ref.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == want[0, enc["input_ids"].shape[1]:].tolist()
    assert outs[3].outputs[0].token_ids != outs[0].outputs[0].token_ids  # the base model's reply is another
    _assert_all_free(llm)
    both = write_adapter(tiny_gemma3_vlm, tmp_path / "both", ["q_proj", "v_proj"], rank=4, alpha=8, seed=6, vision=True)
    with pytest.raises(ValueError, match="vision_tower.*not a projection"):
        llm.generate(prompts[:1], GREEDY, lora_request=LoRARequest("both", 0, str(both)))
