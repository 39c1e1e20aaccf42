"""Logprobs in OpenAI's shapes: Chat Completions `logprobs.content[]` and Completions' parallel lists
(with `echo`, the prompt's tokens first: the first one has no logprob, `null`, as in OpenAI and vLLM),
and vLLM's `prompt_logprobs` list."""

from __future__ import annotations

from deepinfer.engine.outputs import CompletionOutput, Logprob


def _token_str(tokenizer, tid: int) -> str:
    return tokenizer.decode([tid]) if tokenizer is not None else str(tid)


def chat_logprobs(tokenizer, comp: CompletionOutput, start: int, end: int, top_n: int) -> dict:
    content = []
    for i in range(start, end):
        tid = comp.token_ids[i]
        entry = comp.logprobs[i]
        tok = _token_str(tokenizer, tid)
        alts = sorted(((t, lp) for t, lp in entry.items()), key=lambda x: x[1].rank or 0)[:top_n] if top_n else []
        content.append({
            "token": tok, "logprob": entry[tid].logprob, "bytes": list(tok.encode()),
            "top_logprobs": [{"token": (s := _token_str(tokenizer, t)), "logprob": lp.logprob,
                              "bytes": list(s.encode())} for t, lp in alts],
        })
    return {"content": content}


def completion_logprobs(tokenizer, comp: CompletionOutput, start: int, end: int, top_n: int,
                        text_offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for i in range(start, end):
        tid = comp.token_ids[i]
        entry = comp.logprobs[i]
        tok = _token_str(tokenizer, tid)
        tokens.append(tok)
        token_lps.append(entry[tid].logprob)
        alts = sorted(entry.items(), key=lambda x: x[1].rank or 0)[:top_n]
        tops.append({_token_str(tokenizer, t): lp.logprob for t, lp in alts})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(tokenizer, prompt_ids: list[int], entries: list[dict[int, Logprob] | None] | None,
                    top_n: int) -> dict:
    """Completions' lists for the echoed prompt: text offsets from 0, `null` for the first token (and for
    any position without an entry)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for i, tid in enumerate(prompt_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        tok = _token_str(tokenizer, tid)
        tokens.append(tok)
        offsets.append(offset)
        offset += len(tok)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry[tid].logprob)
        alts = sorted(entry.items(), key=lambda x: x[1].rank or 0)[:top_n]
        tops.append({_token_str(tokenizer, t): lp.logprob for t, lp in alts})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def joined(first: dict, second: dict | None) -> dict:
    """Two Completions logprobs objects as one (the prompt's, then the generated tokens')."""
    if second is None:
        return first
    return {k: first[k] + second[k] for k in first}



def vllm_prompt_logprobs(tokenizer, prompt_ids: list[int], entries: list[dict[int, Logprob] | None] | None,
                         top_n: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, `null` for the first, else {token id: {"logprob", "rank",
    "decoded_token"}} for the prompt's token and the `top_n` most likely."""
    out: list[dict | None] = []
    for i, tid in enumerate(prompt_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        if entry is None:
            out.append(None)
            continue
        kept = {t: lp for t, lp in entry.items() if t == tid or (lp.rank is not None and lp.rank <= top_n)}
        out.append({str(t): {"logprob": lp.logprob, "rank": lp.rank,
                             "decoded_token": lp.decoded_token if lp.decoded_token is not None
                             else _token_str(tokenizer, t)} for t, lp in kept.items()})
    return out
