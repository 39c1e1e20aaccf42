"""Benchmarks that run inside deepinfer, without a server: `deepinfer bench ...`.

`simulate`: routing policies compared on a replayed request trace against modelled prefill and decode
workers (`deepinfer bench simulate`). The measured, side-by-side benchmarks that drive real engines and
servers live in the repository's `benchmarks/` directory.
"""
