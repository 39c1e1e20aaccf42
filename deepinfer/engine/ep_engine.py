"""ExpertParallelEngine: N expert-parallel engine ranks behind one EngineClient.

    server / LLM ─▶ ExpertParallelEngine ─▶ rank 0: ProcessEngine ─▶ engine process (scheduler, KV cache,
                     (least loaded rank          ...                   1/N of the routed experts)
                      per request)          rank N-1: ProcessEngine ─▶ engine process
                                                          └── torch.distributed group: MoE all-to-all ──┘

Attention is data-parallel: each rank runs the requests sent to it with its own scheduler and KV cache,
and the ranks meet only in the MoE layers (`engine/expert_parallel.py`). This front end sends each request
to the rank with the fewest running + waiting requests, forwards that rank's stream, and merges the ranks'
stats; the server and the cluster router see one worker (its capacity the ranks' sum).

A rank that dies takes the group with it: its peers would block in their next collective, so a watcher
ends them at once (the collectives' timeout is the backstop). Every open stream then ends with
EngineDeadError and `healthy` turns False (/health answers 503).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine.engine_client import EngineClient, EngineDeadError
from deepinfer.engine.expert_parallel import RankInfo
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.process_engine import ProcessEngine
from deepinfer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# per-rank stats that add up across ranks; the others are rank 0's (the cost model, timestamps)
_SUMMED = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "prefix_queries", "prefix_hits",
           "prefix_hits_device", "prefix_hits_host", "prefix_hits_store", "kv_tokens", "num_preemptions",
           "prefill_queued_seconds", "swa_replayed_tokens")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ExpertParallelEngine(EngineClient):
    def __init__(self, config: EngineConfig, log_level: int | None = None) -> None:
        n = config.parallel.expert_parallel_size
        super().__init__(config.scheduler.max_queue)
        if config.model.num_threads is None:  # the ranks share the machine's cores
            threads = max(1, (os.cpu_count() or 1) // n)
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, num_threads=threads))
        port = _free_port()
        # the ranks start together: each waits in the process group's rendezvous for the others
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(ProcessEngine, config, log_level, RankInfo(r, n, port)) for r in range(n)]
            errors = [f.exception() for f in futures]
            self.ranks: list[ProcessEngine] = [f.result() for f in futures if f.exception() is None]
        if any(errors):
            for rank in self.ranks:
                rank._proc.kill()
            raise next(e for e in errors if e is not None)
        first = self.ranks[0]
        self.tokenizer, self.max_model_len = first.tokenizer, first.max_model_len
        self.vocab_size, self.eos_token_ids = first.vocab_size, first.eos_token_ids
        self.facts = {**first.facts, "expert_parallel_size": n,
                      "max_num_seqs": sum(int(r.facts.get("max_num_seqs", 1)) for r in self.ranks)}
        self.validator = first.validator
        self._placed: dict[str, ProcessEngine] = {}
        self._turn = 0
        self._closing = False
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="deepinfer-ep-watch", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ health

    def _watch(self) -> None:
        """End every rank once one is gone: the others would wait on it in their collectives."""
        while not self._closing:
            dead = [i for i, r in enumerate(self.ranks) if not r.healthy]
            if dead:
                if not self._closing:
                    logger.error("expert-parallel rank %s died; stopping the other ranks", dead)
                    self.dead = EngineDeadError(f"expert-parallel rank {dead[0]} died")
                    for r in self.ranks:
                        if r._proc.is_alive():
                            r._proc.kill()
                return
            self._stop.wait(0.2)

    @property
    def healthy(self) -> bool:
        return self.dead is None and all(r.healthy for r in self.ranks)

    def stats(self) -> dict[str, Any]:
        per_rank = [r.stats() for r in self.ranks]
        merged = dict(per_rank[0])
        for key in _SUMMED:
            if key in merged:
                merged[key] = sum(s.get(key, 0) for s in per_rank)
        if merged.get("kv_blocks_total"):
            merged["kv_usage"] = merged["kv_blocks_used"] / merged["kv_blocks_total"]
        if "eplb" in merged:
            merged["eplb"] = {**merged["eplb"], "ranks": [s.get("eplb", {}) for s in per_rank]}
        merged["expert_parallel_size"] = len(self.ranks)
        return merged

    def num_waiting(self) -> int:
        return sum(r.num_waiting() for r in self.ranks)

    def check_retention(self, retention_class: str | None) -> str:
        return self.ranks[0].check_retention(retention_class)

    # ------------------------------------------------------------------ requests

    def _pick(self) -> ProcessEngine:
        """The rank with the fewest open requests; ties rotate (an idle server spreads its requests)."""
        self._turn = (self._turn + 1) % len(self.ranks)
        n = len(self.ranks)

        def load(i: int) -> tuple[int, int]:
            r = self.ranks[i]
            return int(r.stats().get("num_running", 0)) + r.num_waiting() + len(r._streams), (i - self._turn) % n

        return self.ranks[min(range(n), key=load)]

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """As `EngineClient.generate`, on the least loaded rank."""
        self.check_admission()
        request_id = request_id or f"epreq-{next(self._ids)}"
        rank = self._pick()
        self._placed[request_id] = rank
        try:
            async for out in rank.generate(prompt_token_ids, params, request_id, **kwargs):
                yield out
        except EngineDeadError as e:
            raise EngineDeadError(f"{e} (expert-parallel: {self.dead or 'a rank died'})") from None
        finally:
            self._placed.pop(request_id, None)

    def _submit(self, request: dict[str, Any]) -> None:  # generate() goes to a rank directly
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        rank = self._placed.get(request_id)
        if rank is not None:
            rank.abort(request_id)

    async def call(self, method: str, *args: Any) -> Any:
        self._check_call(method)
        if method == "stats":
            return self.stats()
        if method == "flush_kv_store":
            return all([await r.call(method, *args) for r in self.ranks])
        raise ValueError(f"{method!r} is not supported with expert parallelism (KV export/import is per rank)")

    def shutdown(self) -> None:
        self._closing = True
        self._stop.set()
        with ThreadPoolExecutor(len(self.ranks)) as pool:
            list(pool.map(lambda r: r.shutdown(), self.ranks))
