"""Builds the proposers that run a model (`draft_model`, `mtp`) from the engine core's setup: the target's
device, dtype, cache and scheduler limits, and its tokenizer (a draft model must share it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.config import SpeculativeMethod
from deepinfer.engine.spec.proposer import Proposer

if TYPE_CHECKING:
    from deepinfer.engine.core import EngineCore


def build_model_proposer(method: SpeculativeMethod, core: EngineCore) -> Proposer:
    if method.method == "draft_model":
        return _draft_model(method, core)
    if method.method == "mtp":
        from deepinfer.engine.spec.mtp import build_mtp_proposer

        return build_mtp_proposer(method, core)
    raise ValueError(f"speculative method {method.method!r} does not run a model")


def _draft_model(method: SpeculativeMethod, core: EngineCore) -> Proposer:
    from deepinfer.engine.spec.draft_model import DraftModelProposer, load_draft_runner

    if not method.model:
        raise ValueError('speculative method "draft_model" needs "model": the draft model\'s directory or GGUF file')
    sc = core.config.scheduler
    runner, files, hf_config = load_draft_runner(method.model, core.config.model, core.config.cache,
                                                 core.max_model_len, sc.max_num_seqs, sc.max_num_batched_tokens)
    vocab = check_same_vocab(core.files, core.hf_config, files, hf_config)
    return DraftModelProposer(runner, core.config.cache, vocab, sc.max_num_batched_tokens, core.config.model.seed)


def check_same_vocab(target_files, target_config, draft_files, draft_config) -> int:
    """Refuses a draft model whose tokenizer maps tokens to other ids than the target's; returns the number
    of ids both know (draft tokens are drawn below it)."""
    tv, dv = target_config.vocab_size, draft_config.vocab_size
    if target_files.has_tokenizer() and draft_files.has_tokenizer():
        from deepinfer.recipe.tokenizer import load_tokenizer

        t_vocab, d_vocab = load_tokenizer(target_files).get_vocab(), load_tokenizer(draft_files).get_vocab()
        if t_vocab != d_vocab:
            diff = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])[:3]
            raise ValueError(f"the draft model {draft_files.source} does not share the target's tokenizer "
                             f"({len(d_vocab)} vs {len(t_vocab)} tokens; first differences: {diff})")
        return min(len(t_vocab), tv, dv)
    if tv != dv:
        raise ValueError(f"the draft model {draft_files.source} has vocab_size {dv}, the target {tv}: they must "
                         "share the tokenizer")
    return tv
