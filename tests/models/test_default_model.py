"""The default model (SmolLM2-135M-Instruct GGUF) against HF transformers on the same dequantized weights."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.layers.linear import Linear

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a paged KV cache is in one sentence.",
    "List three prime numbers.",
]
MAX_NEW = 24
MARGIN = 0.05  # nats: where outputs diverge, both tokens must be this close in the reference distribution


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()


def _compare_tie_aware(hf_model, prompt: list[int], ours: list[int], ours_lp: list[dict]) -> None:
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    theirs = ref.sequences[0, len(prompt):].tolist()
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a == b:
            continue
        ref_lp = torch.log_softmax(ref.logits[i][0].float(), -1)
        assert ref_lp[ref_lp.argmax()] - ref_lp[a] < MARGIN, f"step {i}: ours {a} not a near-tie in HF"
        assert b in ours_lp[i] and ours_lp[i][a].logprob - ours_lp[i][b].logprob < MARGIN
        return  # after a tie-break the continuations legitimately differ
    assert ours == theirs


def test_greedy_matches_hf_tie_aware(llm, hf):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)
    prompts = [llm.engine.tokenize(tok.apply_chat_template([{"role": "user", "content": q}],
                                                           add_generation_prompt=True, tokenize=False))
               for q in QUESTIONS]
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs, strict=True):
        _compare_tie_aware(hf, p, o.outputs[0].token_ids, o.outputs[0].logprobs)


def test_packed_projections_hold_their_weights_once(llm):
    # every packed projection's dense copy is freed, except the LM head that is the embedding's own table
    model = llm.engine.core.runner.model
    packed = [m for m in model.modules() if isinstance(m, Linear) and m.has_packed_copy]
    if not packed:
        pytest.skip("no projection is packed on this machine")
    tied = model.lm_head.weight is model.embed_tokens.weight
    assert all(m.dense_released for m in packed if not (tied and m is model.lm_head))
    assert model.embed_tokens.weight.numel() == model.config.vocab_size * model.config.hidden_size


def test_chat_answers_and_reports_cache(llm):
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    params = SamplingParams(temperature=0, max_tokens=20)
    first = llm.chat(msgs, params)[0]
    assert "Paris" in first.outputs[0].text
    assert first.outputs[0].finish_reason == "stop"
    again = llm.chat(msgs, params)[0]
    assert again.outputs[0].text == first.outputs[0].text
    assert again.num_cached_tokens >= (len(again.prompt_token_ids) - 1) // 16 * 16 > 0


def test_stop_strings_and_stop_token_ids(llm):
    msgs = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert "5" in full.text
    cut = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40, stop=["5"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "5"
    assert cut.text == full.text[: full.text.index("5")]
    tok_id = full.token_ids[3]
    by_id = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tok_id]))[0].outputs[0]
    assert by_id.stop_reason == tok_id and by_id.token_ids == full.token_ids[:4]


def test_bad_arguments_raise_clear_errors(llm, tmp_path):
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[5] * (llm.engine.max_model_len + 1)], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[10**7]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported model architecture"):
        LLM(str(tmp_path / "m"))
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(None, not_a_flag=1)
    # the engine is still healthy after rejected requests
    assert not llm.engine.core.has_unfinished()
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_a_vllm_program_runs_unchanged(llm, capsys, caplog):
    """vLLM's engine arguments and generate / chat keywords: accepted where they change nothing here, refused
    (before any model loads) where they would."""
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    out = llm.chat(msgs, greedy, add_generation_prompt=False, continue_final_message=True, use_tqdm=True,
                   lora_request=None)[0]
    assert "Processed prompts" in capsys.readouterr().err  # the bar ran to its end
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == llm.generate([ids], greedy)[0].outputs[0].token_ids
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), priority=[0])[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate(["Hi"], greedy, lora_request=object())
    with pytest.raises(ValueError, match="first come"):
        llm.generate(["Hi"], greedy, priority=[1])
    for kwargs, match in (({"tensor_parallel_size": 2}, "tensor_parallel_size"),
                          ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
                          ({"enable_chunked_prefill": False}, "chunked"),
                          ({"gpu_memory_utilization": 2.0}, "gpu_memory_utilization")):
        with pytest.raises(ValueError, match=match):
            LLM(None, **kwargs)
    with caplog.at_level("WARNING"):
        other = LLM(None, dtype="float32", kv_cache_memory="32MiB", tensor_parallel_size=1, trust_remote_code=True,
                    enforce_eager=True, gpu_memory_utilization=0.9, enable_chunked_prefill=True)
    assert "gpu_memory_utilization is not used" in caplog.text
    assert other.generate([ids], greedy)[0].outputs[0].token_ids == out.outputs[0].token_ids
    other.close()
