"""Gemma 3 with images in bfloat16 (this CPU emulates it): the tiny random Gemma 3 VLM of the tests against
transformers, both in bfloat16, greedy, 10 tokens. Session 50 on the 2-core Zen 3: the one-image and no-image cases
are token-identical; the two-image case parts at its 10th token, an exact bfloat16 tie in transformers itself:
its uncached forward over the prompt and the first 9 tokens gives 33735 and 36530 the same logit (2.9531) and its
argmax takes 33735, as deepinfer does, while its cached `generate` takes 36530. In float32 the two part (36530
2.9669, 33735 2.9505) and deepinfer matches transformers (tests/models/test_gemma3_vlm.py).

    PYTHONPATH=. python3 benchmarks/repro/gemma3_vlm_bf16_tie.py
"""
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from deepinfer import LLM, SamplingParams
from deepinfer.weights import resolve_model
from tests.models.test_gemma3_vlm import _cases, _prompt
from tests.models.vlm_tiny import build_gemma3_vlm

d = Path("/tmp/deepinfer-gemma3-vlm-bf16")
if not d.exists():
    build_gemma3_vlm(d, resolve_model(None).directory)
proc = AutoProcessor.from_pretrained(str(d))
cases = _cases(proc)
hf = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.bfloat16).eval()
hf.generation_config.eos_token_id = None
llm = LLM(str(d), dtype="bfloat16", kv_cache_memory="64MiB")
outs = llm.generate([_prompt(t, i) for t, i in cases], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
for (text, images), out in zip(cases, outs, strict=True):
    enc = proc(text=text, images=[images] if images else None, return_tensors="pt")
    ref = hf.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, enc["input_ids"].shape[1]:].tolist()
    print(ref == out.outputs[0].token_ids, "transformers", ref, "deepinfer", out.outputs[0].token_ids)
text, images = cases[1]
enc = proc(text=text, images=[images], return_tensors="pt")
first9 = outs[1].outputs[0].token_ids[:9]
ids = torch.cat([enc["input_ids"], torch.tensor([first9])], dim=1)
types = torch.cat([enc["token_type_ids"], torch.zeros(1, 9, dtype=torch.long)], dim=1)
for dtype in (torch.bfloat16, torch.float32):
    model = AutoModelForImageTextToText.from_pretrained(str(d), dtype=dtype).eval()
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=enc["pixel_values"], token_type_ids=types,
                       attention_mask=torch.ones_like(ids)).logits[0, -1].float()
    print(dtype, "uncached argmax", int(logits.argmax()), "33735:", round(float(logits[33735]), 4),
          "36530:", round(float(logits[36530]), 4))
