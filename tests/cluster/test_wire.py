"""The decode stream's wire format: each line carries only what its step added, and the router's sum of
the lines is the output the decode worker's own processor built (text, token ids, logprobs, finish)."""

from __future__ import annotations

import json

from deepinfer.cluster.wire import output_delta_from_json, output_delta_to_json
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.outputs import Logprob, RequestOutput, TokenDelta
from deepinfer.engine.sampler import TokenLogprobs
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.recipe.tokenizer import load_tokenizer
from deepinfer.weights.loader import resolve_model


def test_delta_lines_add_up_to_the_workers_outputs_and_stay_small():
    tokenizer = load_tokenizer(resolve_model(None))
    text_ids = tokenizer.encode("Paged attention keeps the KV cache in blocks; a request's table maps them. " * 6)
    prompt, generated = text_ids[:8], text_ids[8:120]
    proc = OutputProcessor(tokenizer, [tokenizer.eos_token_id], lambda seq, stop: None)
    proc.add_request("r", None, prompt, SamplingParams(max_tokens=len(generated), logprobs=2),
                     output_prefix=generated[:1], prefix_logprobs=[{generated[0]: Logprob(-0.5, 1, "x")}])
    first = RequestOutput("r", "the prompt", prompt, [], num_cached_tokens=3, metrics={"arrival": 1.0})
    rebuilt, sizes = None, []
    for i, token in enumerate(generated[1:], 1):
        last = i == len(generated) - 1
        (out,) = proc.process([TokenDelta("r", [token], [TokenLogprobs(-0.1 * i, 1, [(token, -0.1 * i), (7, -3.0)])],
                                          finish_reason="length" if last else None)])
        line = json.dumps(output_delta_to_json(out))
        sizes.append(len(line))
        rebuilt = output_delta_from_json(json.loads(line), rebuilt, first)
        want, got = out.outputs[0], rebuilt.outputs[0]
        assert (got.text, got.token_ids, got.delta_text, got.delta_token_ids) == \
            (want.text, want.token_ids, want.delta_text, want.delta_token_ids)
        assert [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()} for e in got.logprobs] == \
            [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()} for e in want.logprobs]
        assert got.cumulative_logprob == want.cumulative_logprob and got.finish_reason == want.finish_reason
        # request-level facts come from the prefill's output, not the line
        assert (rebuilt.prompt, rebuilt.num_cached_tokens, rebuilt.metrics) == ("the prompt", 3, {"arrival": 1.0})
    assert rebuilt.finished and rebuilt.outputs[0].text == tokenizer.decode(generated)
    # a line's size does not grow with the length of the text so far (the whole output would)
    assert max(sizes[-10:]) < 2 * max(sizes[1:11])

