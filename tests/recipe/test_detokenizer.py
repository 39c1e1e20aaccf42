"""Incremental detokenization and stop strings, with the default model's real tokenizer."""

from __future__ import annotations

import pytest

from deepinfer.recipe.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def _stream(tok, text: str, stop: list[str], include: bool = False):
    prompt = tok.encode("Say:")
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt, stop, include_stop_str_in_output=include)
    shown = []
    for t in ids:
        hit = d.add_token(t)
        shown.append(d.text(finished=hit is not None))
        if hit:
            break
    return d, shown


def test_multibyte_characters_are_never_split(tokenizer):
    text = " naïve café 日本語 🤖🚀 done"
    d, shown = _stream(tokenizer, text, [])
    assert d.text(finished=True) == text
    assert all("\ufffd" not in s for s in shown)
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:], strict=False))  # text only grows


def test_stop_string_across_tokens_is_cut_and_never_leaked(tokenizer):
    d, shown = _stream(tokenizer, " one two three STOP_HERE four", ["STOP_HERE"])
    assert d.stopped_by == "STOP_HERE"
    assert d.text(finished=True) == " one two three "
    assert all("STOP" not in s and "STO" not in s[-3:] for s in shown[:-1])
    d, _ = _stream(tokenizer, " one two three STOP_HERE four", ["STOP_HERE"], include=True)
    assert d.text(finished=True) == " one two three STOP_HERE"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    d, _ = _stream(tokenizer, " alpha beta gamma", ["gamma", "beta"])
    assert d.stopped_by == "beta" and d.text(True) == " alpha "
