"""Why tests/models/test_qwen3_moe_gguf.py checks bf16 by near ties, not token identity (session 15).

The tiny random Qwen3-MoE GGUF (q4_1) has float32 top-two logit margins of 0.002-0.03 nats, under bf16's
resolution. deepinfer's bf16 prefill attention (paged C kernel, float32 probabilities) and transformers' (torch
flash attention, probabilities rounded to bf16) round differently; this prints how far each side's log-probs
after every prompt are from transformers' float32 run (top 20 tokens), which shows neither is more accurate.

    PYTHONPATH=. python3 benchmarks/repro/qwen3_moe_gguf_bf16_ties.py
"""

import tempfile
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from tests.models.gguf_moe_tiny import hf_from_gguf, write_qwen3_moe_gguf
from tests.models.test_qwen3_moe_gguf import COMMON, PROMPTS


def main() -> None:
    path = write_qwen3_moe_gguf(Path(tempfile.mkdtemp()) / "t-q4_1.gguf", "q4_1")
    hf16, hf32 = hf_from_gguf(path, torch.bfloat16), hf_from_gguf(path, torch.float32)
    with LLM(str(path), dtype="bfloat16", **COMMON) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    ours_err, hf_err = [], []
    for p, o in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            l32 = torch.log_softmax(hf32(torch.tensor([p])).logits[0, -1].double(), -1)
            l16 = torch.log_softmax(hf16(torch.tensor([p])).logits[0, -1].double(), -1)
        row = o.outputs[0].logprobs[0]
        toks = list(row)
        ours = torch.tensor([row[t].logprob for t in toks], dtype=torch.float64)
        ours_err.append((ours - l32[toks]).abs().max().item())
        hf_err.append((l16[toks] - l32[toks]).abs().max().item())
    print("max |logprob - float32| over the top 20 after each prompt")
    print("  deepinfer bf16:   ", [round(x, 4) for x in ours_err])
    print("  transformers bf16:", [round(x, 4) for x in hf_err])


if __name__ == "__main__":
    main()
