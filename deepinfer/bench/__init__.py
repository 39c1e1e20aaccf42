"""Benchmarks that run inside deepinfer, without a server: `deepinfer bench ...`.

`simulate`: routing policies compared on a replayed request trace against modelled prefill and decode
workers (`deepinfer bench simulate`). `eplb`: expert-parallel load balancing at 64-128 ranks, routing
(recorded from a real MoE run, `eplb_trace.py`, or a Zipf prior) replayed against modelled ranks across
redundant expert counts (`deepinfer bench eplb`). `economics`: a measured run, or the production figures DeepSeek
published, priced with every step of the arithmetic shown (`deepinfer bench economics`). `plots`: PNGs of
the benchmark scripts' results JSONs (`deepinfer bench plot`; matplotlib, the `bench` extra). The measured,
side-by-side benchmarks that drive real engines and servers live in the repository's `benchmarks/` directory.
"""
