"""Images in bfloat16 (this CPU emulates it): the tiny random Idefics3 of the tests against transformers, both in
bfloat16, greedy. Session 48 on the 2-core Zen 3: 3 of 4 prompts token-identical; the 4th parts at its 6th token,
where transformers' own bfloat16 logits tie (26009 and 38958 both 2.625; in float32 2.6325 against 2.6282, a gap
below bfloat16's resolution), so either token is the model's argmax within its precision. The float32 tests
(tests/models/test_idefics3.py) hold exactly.

    PYTHONPATH=. python3 benchmarks/repro/vision_bf16_tie.py
"""
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from deepinfer import LLM, SamplingParams
from deepinfer.weights import resolve_model
from tests.models.vlm_tiny import build_vlm, random_image

d = build_vlm(Path("/tmp/deepinfer-vision-bf16"), resolve_model(None).directory)
proc = AutoProcessor.from_pretrained(str(d))
hf = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.bfloat16).eval()
hf.generation_config.eos_token_id = None
llm = LLM(str(d), dtype="bfloat16", kv_cache_memory="64MiB")
sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ok = 0
for seed, (h, w) in enumerate([(40, 70), (50, 30), (64, 64), (20, 90)]):
    img = random_image(seed, h, w)
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}], add_generation_prompt=True)
    enc = proc(text=text, images=[[img]], return_tensors="pt")
    ref = hf.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, enc["input_ids"].shape[1]:].tolist()
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, sp)[0].outputs[0].token_ids
    print(ref == out, ref, out)
    ok += ref == out
print("bf16 identical", ok, "/ 4")
img = random_image(3, 20, 90)
enc = proc(text=text, images=[[img]], return_tensors="pt")
ids = enc["input_ids"]
ref = [33934, 755, 9063, 26009, 45340]
full = torch.cat([ids, torch.tensor([ref])], dim=1)
with torch.no_grad():
    for dt, m in (("bf16", hf), ("fp32", AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32).eval())):
        lg = m(input_ids=full, attention_mask=torch.ones_like(full), pixel_values=enc["pixel_values"].to(m.dtype), pixel_attention_mask=enc["pixel_attention_mask"]).logits[0, -1].float()
        top = torch.topk(lg, 3)
        print(dt, top.indices.tolist(), [round(v, 4) for v in top.values.tolist()], "26009:", round(lg[26009].item(), 4), "38958:", round(lg[38958].item(), 4))
