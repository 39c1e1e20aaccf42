"""Routing policies: which prefill worker and which decode worker a request goes to.

A policy sees `WorkerView`s (a worker's last load report merged with what this router
has sent it since) and the request's `RouteInfo`, and picks one worker per pool:

- `round_robin`: in turn, ignoring load.
- `least_requests`: fewest requests in flight (prefill: queued + running; decode: running).
- `deepinfer`: prefill = earliest estimated finish, i.e. the worker's queued prefill seconds plus
  this prompt's uncached compute under that worker's cost model (fitted online to observed step
  times; the router gives peers on the same hardware one model, `pool.peer_cost_models`) plus its
  image tiles at the worker's measured seconds per tile (a vision-language model) plus the
  time to load its cached part from the shared store (prefixes live there, so no cache affinity; a
  store hit is cheaper than compute, not free), where a prefix still being prefilled on a worker
  (not in the store yet) counts as cached on that worker; decode = lowest
  `w_run * running / max_num_seqs + w_kv * kv_tokens / kv_capacity_tokens` (scheduling pressure and
  memory pressure), where scores within `locality_margin` of the lowest are a tie that goes to a
  decode worker co-located with the request's prefill worker (`co_located`).

Ties go to the worker listed first, except in `deepinfer`'s picks (decode: see above); prefill:
finishes within `FINISH_TIE_TOLERANCE` of the earliest are a tie there (within the cost model's own
error), which goes to the worker where the prompt has the most cached (a prefix in prefill there: the
same finish for less compute), then to the worker given the least prefill work so far, so idle workers
share the work instead of one taking all of it. Policies are pure apart from the round-robin cursor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from deepinfer.engine.cost_model import CostModel


@dataclass
class WorkerView:
    url: str
    queued_prefill_seconds: float = 0.0
    num_waiting: int = 0
    num_running: int = 0
    kv_tokens: int = 0
    max_num_seqs: int = 1
    kv_capacity_tokens: int = 1
    cost_model: CostModel | None = None
    routed_prefill_seconds: float = 0.0  # estimated prefill compute sent to it so far
    host: str = ""  # the machine it runs on ("": unknown)
    cpus: tuple[int, ...] = ()  # the CPUs it may run on ((): unknown)
    tile_seconds: float = 0.0  # its vision tower's seconds per image tile (0: not measured, or a text model)


def leading_run(hashes: Sequence[Hashable], blocks: Container[Hashable]) -> int:
    """How many of `hashes`, from the first, are in `blocks` (block hashes are chained: a prefix is shared
    exactly as far as they match)."""
    n = 0
    while n < len(hashes) and hashes[n] in blocks:
        n += 1
    return n


def co_located(a: WorkerView, b: WorkerView) -> bool:
    """Whether two workers share hardware: the same host and, where both report CPU sets, a CPU in
    common. A request whose decode worker is co-located with its prefill worker moves its KV inside
    the machine; and the decode work of requests routed away from a busy prefill worker stays off that
    worker's CPUs (workers pinned two to a core on a small machine)."""
    if not a.host or a.host != b.host:
        return False
    return not a.cpus or not b.cpus or not set(a.cpus).isdisjoint(b.cpus)


@dataclass
class RouteInfo:
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # found in the shared store (or 0 without a store lookup)
    max_tokens: int = 1
    # worker url -> leading prompt tokens that a prompt in prefill there now shares with this one: they
    # will be in that worker's cache by the time this prompt's turn comes (not yet in the store)
    inflight_prefix_tokens: Mapping[str, int] = field(default_factory=dict)
    # per image tile the prefill worker encodes (sent as pixels, not as an encode worker's embeddings), the
    # prompt position of its last placeholder token
    tile_last_positions: tuple[int, ...] = ()

    def cached_on(self, worker: WorkerView) -> int:
        """Prompt tokens `worker` will not have to compute."""
        return max(self.num_cached_tokens, self.inflight_prefix_tokens.get(worker.url, 0))

    def tiles_on(self, worker: WorkerView) -> int:
        """Image tiles `worker` has to run through its vision tower: those not wholly inside the prefix it
        will find cached (a tile reaching past it is needed in full)."""
        cached = self.cached_on(worker)
        return sum(1 for last in self.tile_last_positions if last >= cached)


class RoutingPolicy(ABC):
    name: str = ""

    @abstractmethod
    def pick_prefill(self, workers: Sequence[WorkerView], req: RouteInfo) -> WorkerView: ...

    @abstractmethod
    def pick_decode(self, workers: Sequence[WorkerView], req: RouteInfo,
                    prefill: WorkerView | None = None) -> WorkerView:
        """`prefill`: the worker prefilling this request (None: already prefilled, e.g. a retry)."""


def _check(workers: Sequence[WorkerView]) -> None:
    if not workers:
        raise ValueError("no worker to route to")


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = {"prefill": 0, "decode": 0}

    def _pick(self, pool: str, workers: Sequence[WorkerView]) -> WorkerView:
        _check(workers)
        i = self._next[pool] % len(workers)
        self._next[pool] = i + 1
        return workers[i]

    def pick_prefill(self, workers: Sequence[WorkerView], req: RouteInfo) -> WorkerView:
        return self._pick("prefill", workers)

    def pick_decode(self, workers: Sequence[WorkerView], req: RouteInfo,
                    prefill: WorkerView | None = None) -> WorkerView:
        return self._pick("decode", workers)


class LeastRequests(RoutingPolicy):
    name = "least_requests"

    def pick_prefill(self, workers: Sequence[WorkerView], req: RouteInfo) -> WorkerView:
        _check(workers)
        return min(workers, key=lambda w: w.num_waiting + w.num_running)

    def pick_decode(self, workers: Sequence[WorkerView], req: RouteInfo,
                    prefill: WorkerView | None = None) -> WorkerView:
        _check(workers)
        return min(workers, key=lambda w: w.num_running)


# loading one cached token's KV from the shared store (~23 KB/token for SmolLM2-135M at ~2 GB/s; the
# simulator's `load_seconds_per_token` default)
STORE_LOAD_SECONDS_PER_TOKEN = 1e-5


def estimated_prefill_seconds(worker: WorkerView, req: RouteInfo) -> float:
    """This request's prefill on `worker`: its uncached compute (the worker's own cost model, else the
    default one), its image tiles through the vision tower (at the worker's measured seconds per tile: a
    tile can cost as much as thousands of text tokens), plus loading its store hits. A prefix that a prompt
    in prefill on `worker` shares with it counts as cached there (the request queues behind that prompt
    and finds its blocks)."""
    model = worker.cost_model or CostModel()
    return (model.prefill_seconds(req.num_prompt_tokens, req.cached_on(worker))
            + req.tiles_on(worker) * worker.tile_seconds
            + STORE_LOAD_SECONDS_PER_TOKEN * req.num_cached_tokens)


def prefill_finish(worker: WorkerView, req: RouteInfo) -> float:
    """When `worker` would finish this prefill: its queued seconds plus this request's estimate there."""
    return worker.queued_prefill_seconds + estimated_prefill_seconds(worker, req)


# what is left of a report once the clock has run past it, as a fraction of the report
LATE_WORK_FRACTION = 0.1


def queued_since(reported: float, reported_at: float, sent: dict[str, tuple[float, float]], now: float,
                 acknowledged: Container[str] | None = None) -> float:
    """Prefill seconds queued at `now`, from an estimate `reported` at `reported_at` and the requests `sent`
    (id -> (sent at, estimated seconds)): the estimate counts down a second per second (the worker
    works it off), and what was sent at or after `reported_at` is not in it, so it counts in full.
    Used by a worker (its engine's last-step estimate ages during a long step) and by the router (a
    worker's report ages between polls).

    The countdown stops at `LATE_WORK_FRACTION` of the report, not at 0: until a newer report says
    otherwise, work past its estimate is late, not done (a prompt prefilled next to other processes
    can take twice its estimate), and a worker still computing must never tie with an idle one -- a
    tie sent every short prompt arriving in that window behind the long one.

    `acknowledged`: the ids the report says it covers (None: all sent before it). A request sent before
    the report but not among them had not reached the worker when it answered (a poll can overtake a
    request): it counts in full."""
    return (max(LATE_WORK_FRACTION * reported, reported - (now - reported_at))
            + sum(est for rid, (at, est) in sent.items()
                  if at >= reported_at or (acknowledged is not None and rid not in acknowledged)))


# prefill finishes this close (relative) to the earliest are a tie: within the cost model's own error (its
# median step-time error is 4-8% on a 2-core CPU, benchmarks/scheduling.py). At 5%, a worker a few tenths of
# a second into a short prompt lost every huge one to an idle worker, and the idle one was the worker the
# huge ones had gone to before (it got no short ones: they went to the worker given less): one worker took
# 10 of 12 huge prompts (benchmarks/BENCHMARKS.md, session 7)
FINISH_TIE_TOLERANCE = 0.10

# decode scores this close (absolute) to the lowest are a tie that locality decides. It must exceed one long
# request's share of a worker's KV: at 0.05, a 1500-token prompt (0.13 of a 512 MiB cache) still decoding on
# the worker next to the prefill worker sent the next huge prompt's decode to the other core, and from then
# on every huge prompt's decode ran off its core and the short prompts' decode ran on it (benchmarks/
# BENCHMARKS.md, session 8)
DECODE_LOCALITY_MARGIN = 0.2


class DeepInferPolicy(RoutingPolicy):
    name = "deepinfer"

    def __init__(self, running_weight: float = 1.0, kv_weight: float = 1.0,
                 locality_margin: float = DECODE_LOCALITY_MARGIN) -> None:
        if running_weight < 0 or kv_weight < 0:
            raise ValueError("decode weights must be >= 0")
        if locality_margin < 0:
            raise ValueError("the decode locality margin must be >= 0")
        self.running_weight = running_weight
        self.kv_weight = kv_weight
        self.locality_margin = locality_margin

    def prefill_finish(self, worker: WorkerView, req: RouteInfo) -> float:
        return prefill_finish(worker, req)

    def decode_score(self, worker: WorkerView) -> float:
        return (self.running_weight * worker.num_running / max(worker.max_num_seqs, 1)
                + self.kv_weight * worker.kv_tokens / max(worker.kv_capacity_tokens, 1))

    def pick_prefill(self, workers: Sequence[WorkerView], req: RouteInfo) -> WorkerView:
        _check(workers)
        finish = [self.prefill_finish(w, req) for w in workers]
        cutoff = min(finish) * (1.0 + FINISH_TIE_TOLERANCE)
        # among near-ties: where the prompt costs least (its prefix is in prefill there), then the least work
        return min((w for w, f in zip(workers, finish, strict=True) if f <= cutoff),
                   key=lambda w: (-req.cached_on(w), w.routed_prefill_seconds))

    def pick_decode(self, workers: Sequence[WorkerView], req: RouteInfo,
                    prefill: WorkerView | None = None) -> WorkerView:
        _check(workers)
        scores = [self.decode_score(w) for w in workers]
        cutoff = min(scores) + self.locality_margin
        # among the near-best: co-located with the prefill worker first, then the lowest score
        return min((pair for pair in zip(workers, scores, strict=True) if pair[1] <= cutoff),
                   key=lambda pair: (prefill is None or not co_located(pair[0], prefill), pair[1]))[0]


def make_policy(name: str, running_weight: float = 1.0, kv_weight: float = 1.0,
                locality_margin: float = DECODE_LOCALITY_MARGIN) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_requests":
        return LeastRequests()
    if name == "deepinfer":
        return DeepInferPolicy(running_weight, kv_weight, locality_margin)
    raise ValueError(f"unknown routing policy {name!r}")
