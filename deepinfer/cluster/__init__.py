"""Prefill/decode disaggregation: worker roles, KV transfer between workers, the router, launchers."""
