"""Speculative decoding: proposers (`proposer.py`: the interface; `ngram.py`, `suffix.py`), verification
by the target model with exact acceptance rules (`verify.py`), the draft length chosen per request and
step (`policy.py`), counters (`metrics.py`), and the engine-facing object tying them together
(`speculator.py`)."""

from deepinfer.engine.spec.proposer import Draft, Proposer
from deepinfer.engine.spec.speculator import Speculator, build_proposer

__all__ = ["Draft", "Proposer", "Speculator", "build_proposer"]
