"""Routing policies and the router's merge of load reports with its own in-flight requests (no processes)."""

from __future__ import annotations

import time

import pytest

from deepinfer.cluster.policies import (
    DeepInferPolicy,
    LeastRequests,
    RoundRobin,
    RouteInfo,
    WorkerView,
    co_located,
    estimated_prefill_seconds,
    leading_run,
    make_policy,
)
from deepinfer.cluster.pool import Worker, WorkerPool, peer_cost_models, peer_tile_seconds
from deepinfer.cluster.worker import queued_prefill_seconds
from deepinfer.config import RouterConfig
from deepinfer.engine.cost_model import CostModel


def _views(**fields: list) -> list[WorkerView]:
    n = len(next(iter(fields.values())))
    return [WorkerView(f"w{i}", **{k: v[i] for k, v in fields.items()}) for i in range(n)]


def test_round_robin_cycles_each_pool_on_its_own():
    p = RoundRobin()
    ws = _views(num_running=[0, 0, 0])
    req = RouteInfo(10)
    assert [p.pick_prefill(ws, req).url for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    assert [p.pick_decode(ws[:2], req).url for _ in range(3)] == ["w0", "w1", "w0"]


def test_least_requests_counts_queued_and_running():
    p = LeastRequests()
    ws = _views(num_waiting=[3, 0, 1], num_running=[0, 4, 1])
    assert p.pick_prefill(ws, RouteInfo(10)).url == "w2"  # 3, 4, 2 in flight
    assert p.pick_decode(ws, RouteInfo(10)).url == "w0"  # running only


def test_deepinfer_prefill_picks_the_earliest_estimated_finish():
    cost = CostModel()
    p = DeepInferPolicy()
    long_prompt = RouteInfo(4000)
    # w0 has less queued work, but w1's cost model (a faster machine) finishes this long prompt first
    slow = CostModel([c * 4 for c in cost.coef])
    ws = [WorkerView("w0", queued_prefill_seconds=0.5, cost_model=slow),
          WorkerView("w1", queued_prefill_seconds=1.0, cost_model=cost)]
    t0, t1 = (p.prefill_finish(w, long_prompt) for w in ws)
    assert t0 > t1 and p.pick_prefill(ws, long_prompt).url == "w1"
    # a short prompt costs little anywhere: the shorter queue wins
    assert p.pick_prefill(ws, RouteInfo(8)).url == "w0"


def test_a_prefix_in_prefill_on_a_worker_counts_as_cached_there():
    """The next turn of a conversation arrives while the previous turn is still being prefilled on w0 (the
    store does not have it yet): queueing behind it on w0 and computing only the new turn finishes
    before recomputing the whole history on the idle w1."""
    p = DeepInferPolicy()
    cost = CostModel()
    previous = cost.prefill_seconds(1232)
    ws = [WorkerView("w0", queued_prefill_seconds=0.8 * previous), WorkerView("w1")]
    turn = RouteInfo(1264, inflight_prefix_tokens={"w0": 1232})
    assert turn.cached_on(ws[0]) == 1232 and turn.cached_on(ws[1]) == 0
    assert estimated_prefill_seconds(ws[0], turn) < estimated_prefill_seconds(ws[1], turn) / 5
    assert p.pick_prefill(ws, turn).url == "w0"
    assert p.pick_prefill(ws, RouteInfo(1264)).url == "w1"  # without it: the idle worker
    # just started there: about the same finish either way, a tie, which goes where it costs least
    full, suffix = estimated_prefill_seconds(ws[1], turn), estimated_prefill_seconds(ws[0], turn)
    ws[0].queued_prefill_seconds, ws[0].routed_prefill_seconds = full - suffix / 2, 50.0
    assert p.prefill_finish(ws[1], turn) <= p.prefill_finish(ws[0], turn) <= 1.05 * p.prefill_finish(ws[1], turn)
    assert p.pick_prefill(ws, turn).url == "w0"
    # the store's hits count everywhere, the in-flight prefix only where it is computed
    assert RouteInfo(1264, 640, inflight_prefix_tokens={"w0": 1232}).cached_on(ws[1]) == 640


def test_leading_run_matches_a_chained_prefix():
    assert leading_run([b"a", b"b", b"c"], {b"a", b"b", b"x"}) == 2
    assert leading_run([b"a", b"b"], {b"b"}) == 0  # a later block alone is not a prefix
    assert leading_run([], {b"a"}) == 0


def test_deepinfer_prefill_ties_within_the_models_error_go_to_the_worker_given_least_so_far():
    """Two idle workers whose fitted models differ by 2%: the huge prompt goes to the one that has had less
    prefill work, not always to the 2%-faster one; a worker 20% later is not a tie."""
    p = DeepInferPolicy()
    huge = RouteInfo(1500)
    fast = CostModel(tuple(0.98 * c for c in CostModel().coef))
    ws = [WorkerView("w0", cost_model=fast, routed_prefill_seconds=30.0),
          WorkerView("w1", cost_model=CostModel(), routed_prefill_seconds=12.0)]
    assert p.prefill_finish(ws[0], huge) < p.prefill_finish(ws[1], huge)
    assert p.pick_prefill(ws, huge).url == "w1"
    ws[1].queued_prefill_seconds = 0.2 * p.prefill_finish(ws[1], huge)  # busy: w1 would finish 20% later
    assert p.pick_prefill(ws, huge).url == "w0"
    ws[1].queued_prefill_seconds = 0.0
    ws[1].routed_prefill_seconds = 31.0
    assert p.pick_prefill(ws, huge).url == "w0"  # now w0 has had less


def test_deepinfer_prefill_counts_store_hits_as_cheap_not_free():
    from deepinfer.cluster.policies import STORE_LOAD_SECONDS_PER_TOKEN

    cost = CostModel()
    w = WorkerView("w", cost_model=cost)
    cold = estimated_prefill_seconds(w, RouteInfo(2048))
    warm = estimated_prefill_seconds(w, RouteInfo(2048, num_cached_tokens=2032))
    assert warm < cold / 5
    assert warm == pytest.approx(cost.prefill_seconds(2048, 2032) + 2032 * STORE_LOAD_SECONDS_PER_TOKEN)


def test_deepinfer_decode_weighs_running_and_kv_by_capacity():
    # w0: few requests but long contexts; w1: many short requests
    ws = _views(num_running=[2, 12], max_num_seqs=[16, 16], kv_tokens=[90_000, 6_000],
                kv_capacity_tokens=[100_000, 100_000])
    assert DeepInferPolicy(1.0, 1.0).pick_decode(ws, RouteInfo(1)).url == "w1"  # 0.125+0.9 vs 0.75+0.06
    assert DeepInferPolicy(1.0, 0.0).pick_decode(ws, RouteInfo(1)).url == "w0"  # requests only
    # capacity normalises: the same load on a worker twice the size scores half
    big = _views(num_running=[8, 8], max_num_seqs=[16, 32], kv_tokens=[0, 0], kv_capacity_tokens=[1, 1])
    assert DeepInferPolicy().decode_score(big[1]) == pytest.approx(DeepInferPolicy().decode_score(big[0]) / 2)


def test_co_located_means_same_host_and_a_shared_cpu():
    core0 = WorkerView("p", host="h", cpus=(0,))
    assert co_located(core0, WorkerView("d", host="h", cpus=(0, 1)))
    assert not co_located(core0, WorkerView("d", host="h", cpus=(1,)))  # pinned to another core
    assert co_located(core0, WorkerView("d", host="h"))  # no CPU set reported: the host decides
    assert not co_located(core0, WorkerView("d", host="other", cpus=(0,)))
    assert not co_located(WorkerView("p"), WorkerView("d"))  # unknown hosts are never co-located


def test_deepinfer_decode_near_ties_go_to_the_prefill_workers_neighbour():
    """A huge prompt prefilled on core 0 must not have the decode work of the prompts routed away from it
    land on core 0 as well: its own decode goes next to it (its KV then keeps later prompts off that
    decode worker), provided the decode scores are within the margin."""
    prefill = WorkerView("p0", host="h", cpus=(0,))
    # d0 on core 1 scores a little lower than d1 on core 0
    ws = _views(host=["h", "h"], cpus=[(1,), (0,)], num_running=[1, 2], max_num_seqs=[256, 256],
                kv_tokens=[50, 120], kv_capacity_tokens=[10_000, 10_000])
    policy = DeepInferPolicy()
    assert policy.decode_score(ws[0]) < policy.decode_score(ws[1]) < policy.decode_score(ws[0]) + 0.05
    assert policy.pick_decode(ws, RouteInfo(1500), prefill).url == "w1"
    assert policy.pick_decode(ws, RouteInfo(1500)).url == "w0"  # no prefill worker (a retry): the score
    assert DeepInferPolicy(locality_margin=0.0).pick_decode(ws, RouteInfo(1500), prefill).url == "w0"
    # beyond the margin the score wins: d1 holds two other huge prompts' KV
    ws[1].kv_tokens = 3100
    assert policy.pick_decode(ws, RouteInfo(1500), prefill).url == "w0"


def test_one_huge_prompt_still_decoding_next_to_the_prefill_worker_does_not_break_locality():
    """The previous huge prompt (prefilled on core 0, decoding on core 0) is finishing its last tokens when
    the next huge one is prefilled on core 0: the next one's decode must still go to core 0. Sent to core 1
    instead, its KV there sends the short prompts' decode to core 0, next to every later huge prefill
    (session 7's s7c round 0, with a 0.05 margin)."""
    prefill = WorkerView("p0", host="h", cpus=(0,))
    ws = _views(host=["h", "h"], cpus=[(1,), (0,)], num_running=[0, 1], max_num_seqs=[128, 128],
                kv_tokens=[0, 1510], kv_capacity_tokens=[11_648, 11_648])
    assert DeepInferPolicy().pick_decode(ws, RouteInfo(1500), prefill).url == "w1"
    assert DeepInferPolicy(locality_margin=0.05).pick_decode(ws, RouteInfo(1500), prefill).url == "w0"


def test_policies_refuse_an_empty_pool_and_unknown_names():
    for p in (RoundRobin(), LeastRequests(), DeepInferPolicy()):
        with pytest.raises(ValueError):
            p.pick_prefill([], RouteInfo(1))
    with pytest.raises(ValueError):
        make_policy("random")
    with pytest.raises(ValueError):
        DeepInferPolicy(-1.0, 1.0)
    with pytest.raises(ValueError):
        DeepInferPolicy(locality_margin=-0.1)
    with pytest.raises(ValueError):
        RouterConfig(decode_locality_margin=-1.0)
    with pytest.raises(ValueError):
        RouterConfig(routing_policy="fastest")


def test_worker_view_adds_what_the_router_sent_since_the_last_report():
    now = time.monotonic()
    w = Worker("http://a", "prefill", load={"queued_prefill_seconds": 0.2, "num_running": 1, "kv_tokens": 100,
                                             "max_num_seqs": 8, "kv_capacity_tokens": 1000,
                                             "cost_coefficients": list(CostModel().coef)}, report_at=now)
    assert w.queued_prefill_seconds(now) == pytest.approx(0.2)
    w.inflight_prefill.update(old=(now - 1.0, 5.0))  # sent before the report: the report counts it already
    w.inflight_prefill.update(a=(now + 0.01, 0.3), b=(now + 0.02, 0.4))  # a burst the report has not seen yet
    w.inflight_decode_tokens.update(a=300, b=400, c=50)
    assert w.queued_prefill_seconds(now + 0.05) == pytest.approx(0.15 + 0.7)
    # the report counts down as the worker works (to a tenth of it: late, not done); what was sent since does not
    assert w.queued_prefill_seconds(now + 1.0) == pytest.approx(0.02 + 0.7)
    w.prefill_seconds_routed = 7.5
    v = w.view()
    assert v.routed_prefill_seconds == 7.5
    assert v.queued_prefill_seconds == pytest.approx(0.7, abs=0.2)
    assert (v.num_running, v.kv_tokens, v.num_waiting) == (3, 750, 3)
    assert v.cost_model is not None and list(v.cost_model.coef) == list(CostModel().coef)
    assert (v.host, v.cpus) == ("", ())  # the report names neither
    w.load.update(host="box", cpus=[2, 3])
    assert (w.view().host, w.view().cpus) == ("box", (2, 3))


def test_a_long_prompt_nearly_done_does_not_keep_its_worker_looking_busy():
    """The router sent A a 3 s prompt 2.5 s ago and B two short ones just now; A's report (0.5 s left) is
    fresh: the next long prompt goes to A, which will be free first."""
    now = time.monotonic()
    a = Worker("http://a", "prefill", load={"queued_prefill_seconds": 0.5}, report_at=now)
    a.inflight_prefill["long"] = (now - 2.5, 3.0)
    b = Worker("http://b", "prefill", load={"queued_prefill_seconds": 0.0}, report_at=now)
    b.inflight_prefill.update(s1=(now, 0.4), s2=(now, 0.4))
    route = RouteInfo(num_prompt_tokens=1500)
    assert DeepInferPolicy().pick_prefill([a.view(), b.view()], route).url == "http://a"


def test_a_worker_counts_its_queue_down_from_the_engine_snapshot():
    t = 100.0
    stats = {"prefill_queued_seconds": 4.0, "prefill_queued_at": t}  # taken as a 4 s prefill step started
    pending = {"long": (t - 0.5, 4.0), "late": (t + 1.0, 0.3)}  # the first is in the snapshot, the second not
    assert queued_prefill_seconds(stats, {"long": pending["long"]}, t) == pytest.approx(4.0)
    assert queued_prefill_seconds(stats, pending, t + 1.5) == pytest.approx(2.5 + 0.3)
    assert queued_prefill_seconds(stats, pending, t + 3.0) == pytest.approx(1.0 + 0.3)
    assert queued_prefill_seconds(stats, pending, t + 9.0) == pytest.approx(0.4 + 0.3)  # late: a tenth stays
    assert queued_prefill_seconds({"prefill_queued_seconds": 0.0, "prefill_queued_at": t}, {}, t + 9.0) == 0.0


def test_a_worker_prices_a_received_prompts_image_tiles():
    """Until its engine's next snapshot, a worker counts a prompt it received at its own estimate: the image tiles
    it will encode are in it, at its tower's measured seconds per tile (without them a worker two seconds into
    a tile reported a few tenths queued, and the router sent it the next short prompt)."""
    import torch

    from deepinfer.cluster.worker import prefill_estimate
    from deepinfer.engine.cost_model import TERMS
    from deepinfer.multimodal.inputs import MultiModalInputs

    stats = {f"cost_coef_{t}": c for t, c in zip(TERMS, CostModel().coef, strict=True)}
    stats["tile_seconds"] = 2.5
    text = prefill_estimate(stats, 100)
    images = MultiModalInputs(torch.zeros(2, 3, 4, 4), None, tuple(range(10, 18)), 4)
    assert prefill_estimate(stats, 100, images) == pytest.approx(text + 5.0)
    assert prefill_estimate(stats, 100, images.encoded(torch.zeros(2, 4, 8))) == pytest.approx(text)  # encoded


def test_a_worker_past_its_estimate_is_still_busy():
    """A's 4 s prompt has run 6 s (it shares its core): its report is spent, but until a new one comes it
    is still computing. A short prompt goes to the idle B, not to A on a tie (or on A's faster model)."""
    t = time.monotonic()
    a = Worker("http://a", "prefill", load={"queued_prefill_seconds": queued_prefill_seconds(
        {"prefill_queued_seconds": 4.0, "prefill_queued_at": t - 6.0}, {}, t)}, report_at=t)
    b = Worker("http://b", "prefill", load={"queued_prefill_seconds": 0.0}, report_at=t)
    fast = CostModel(tuple(0.5 * c for c in CostModel().coef))
    a.load["cost_coefficients"] = list(fast.coef)
    assert a.queued_prefill_seconds(t + 0.3) > 0.0
    assert DeepInferPolicy().pick_prefill([a.view(), b.view()], RouteInfo(num_prompt_tokens=40)).url == "http://b"


def test_a_snapshot_that_missed_a_received_prompt_does_not_hide_it():
    """The engine's snapshot is stamped after the prompt arrived but was taken before the engine read it
    (queued 0), and stays the latest for the prompt's whole step: the worker's own record counts it down."""
    t = 100.0
    stats = {"prefill_queued_seconds": 0.0, "prefill_queued_at": t + 0.01}
    pending = {"huge": (t, 5.0)}
    assert queued_prefill_seconds(stats, pending, t + 2.0) == pytest.approx(3.0)
    assert queued_prefill_seconds(stats, pending, t + 9.0) == pytest.approx(0.5)  # late, not done
    assert queued_prefill_seconds(stats, {}, t + 2.0) == 0.0


def test_the_router_counts_a_request_its_worker_had_not_seen_when_it_reported():
    """The router sent a 5 s prompt, then a poll overtook it: the report (0 s, stamped after the send)
    does not list it, so the router still counts it; once a report lists it, the report's number rules."""
    now = time.monotonic()
    w = Worker("http://a", "prefill", load={"queued_prefill_seconds": 0.0, "prefill_request_ids": []},
               report_at=now)
    w.inflight_prefill["huge"] = (now - 0.05, 5.0)
    assert w.queued_prefill_seconds(now + 0.1) == pytest.approx(5.0)
    w.load = {"queued_prefill_seconds": 4.0, "prefill_request_ids": ["huge"]}
    assert w.queued_prefill_seconds(now + 0.1) == pytest.approx(3.9)
    w.load = {"queued_prefill_seconds": 0.0}  # a worker that lists nothing: the send time decides
    assert w.queued_prefill_seconds(now + 0.1) == 0.0


def test_pool_rotation_tracks_liveness():
    pool = WorkerPool(interval=0.1, worker_timeout=5.0)
    a = pool.add("http://a/", "prefill")
    pool.add("http://b", "decode")
    assert a.url == "http://a" and pool.rotation("prefill") == []  # not polled yet
    a.alive, a.last_seen = True, time.monotonic()
    assert pool.rotation("prefill") == [a]
    pool.mark_failed(a, "test")
    assert pool.rotation("prefill") == [] and a.failures == 1
    with pytest.raises(ValueError):
        pool.add("http://c", "unified")


def test_sampling_params_survive_the_wire():
    import json

    from deepinfer.cluster.wire import params_from_json, params_to_json
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.engine.structured import StructuredOutputParams

    p = SamplingParams(temperature=0, max_tokens=7, stop=["x"], logit_bias={5: 2.5, 17: -100.0},
                       structured_output=StructuredOutputParams(json_schema={"type": "object"}))
    assert params_from_json(json.loads(json.dumps(params_to_json(p)))) == p
    p = SamplingParams(structured_output=StructuredOutputParams(choice=["yes", "no"]))  # a tuple: JSON makes it a list
    assert params_from_json(json.loads(json.dumps(params_to_json(p)))) == p


def _reporting(url: str, coef, hardware: str | None, queued: float = 0.0, routed: float = 0.0) -> Worker:
    load = {"queued_prefill_seconds": queued, "cost_coefficients": list(coef)}
    if hardware is not None:
        load["hardware"] = hardware
    w = Worker(url, "prefill", load=load, report_at=time.monotonic())
    w.prefill_seconds_routed = routed
    return w


def test_peers_on_the_same_hardware_share_one_cost_model():
    base = CostModel().coef
    slow = [2 * c for c in base]
    a, b = _reporting("http://a", base, "cpu x1"), _reporting("http://b", slow, "cpu x1")
    c, d = _reporting("http://c", slow, "gpu"), _reporting("http://d", base, None)
    models = peer_cost_models([a, b, c, d])
    assert models["http://a"] is models["http://b"]
    assert list(models["http://a"].coef) == pytest.approx([1.5 * x for x in base])
    assert list(models["http://c"].coef) == pytest.approx(slow)  # other hardware: its own
    assert list(models["http://d"].coef) == pytest.approx(list(base))  # names none: its own
    assert peer_cost_models([Worker("http://e", "prefill")]) == {"http://e": None}  # no report yet
    views = WorkerPool.views([a, b])
    assert views[0].cost_model.prefill_seconds(1500) == views[1].cost_model.prefill_seconds(1500)


def test_a_huge_prompt_is_shared_by_peers_whose_own_fits_differ():
    """A took the earlier huge prompts, so its own fit knows them and predicts them 15% faster than B's
    start-up guess; B is a short prompt into its queue. By their own fits A always finishes first and takes
    every huge prompt; as peers they tie, and B, sent less so far, takes this one."""
    base = CostModel().coef
    a = _reporting("http://a", base, "cpu x1", routed=30.0)
    b = _reporting("http://b", [1.15 * x for x in base], "cpu x1", queued=0.1, routed=5.0)
    huge = RouteInfo(1500)
    assert DeepInferPolicy().pick_prefill([a.view(), b.view()], huge).url == "http://a"
    assert DeepInferPolicy().pick_prefill(WorkerPool.views([a, b]), huge).url == "http://b"
    b.load["queued_prefill_seconds"] = 3.0  # really busy: the earliest finish still wins
    assert DeepInferPolicy().pick_prefill(WorkerPool.views([a, b]), huge).url == "http://a"


def test_image_tiles_count_at_the_workers_seconds_per_tile_outside_its_cached_prefix():
    """Tiles a prefill worker encodes cost its measured tower time each; a tile wholly inside the prefix the
    worker will find cached costs nothing, one reaching past it counts in full (its last rows need it)."""
    cost = CostModel()
    # 3 tiles of 4 placeholders each: their last placeholders at positions 13, 17 and 41
    req = RouteInfo(64, num_cached_tokens=16, tile_last_positions=(13, 17, 41))
    w = WorkerView("w0", cost_model=cost, tile_seconds=2.0)
    text = estimated_prefill_seconds(WorkerView("w0", cost_model=cost), req)
    assert req.tiles_on(w) == 2
    assert estimated_prefill_seconds(w, req) == pytest.approx(text + 4.0)
    in_prefill = RouteInfo(64, tile_last_positions=(13, 17, 41), inflight_prefix_tokens={"w0": 48})
    assert in_prefill.tiles_on(w) == 0 and in_prefill.tiles_on(WorkerView("w1", tile_seconds=2.0)) == 3


def test_short_prompts_go_around_a_worker_busy_with_image_tiles():
    """Worker a reports a prompt with 5 tiles queued (the engine prices them at its tower's speed), b a little
    text: a short prompt goes to b. An image prompt itself goes where its tiles finish first. Without the
    tiles in the reports the two look alike and the short prompt would wait behind seconds of tower time."""
    base = CostModel().coef
    a = _reporting("http://a", base, "cpu x1", queued=5 * 2.4 + 0.05, routed=12.0)
    b = _reporting("http://b", base, "cpu x1", queued=0.2, routed=1.0)
    for w in (a, b):
        w.load["tile_seconds"] = 2.4
    short = RouteInfo(40)
    assert DeepInferPolicy().pick_prefill(WorkerPool.views([a, b]), short).url == "http://b"
    image = RouteInfo(400, tile_last_positions=tuple(range(63, 320, 64)))
    views = WorkerPool.views([a, b])
    assert [estimated_prefill_seconds(v, image) > 12.0 for v in views] == [True, True]
    assert DeepInferPolicy().pick_prefill(views, image).url == "http://b"


def test_peers_share_one_tower_speed_and_an_unmeasured_peer_takes_it():
    a, b, c = (_reporting(u, CostModel().coef, "cpu x1") for u in ("http://a", "http://b", "http://c"))
    d = _reporting("http://d", CostModel().coef, "gpu")
    a.load["tile_seconds"], b.load["tile_seconds"], d.load["tile_seconds"] = 2.0, 3.0, 0.05
    speeds = peer_tile_seconds([a, b, c, d, Worker("http://e", "prefill")])
    assert speeds == {"http://a": 2.5, "http://b": 2.5, "http://c": 2.5, "http://d": 0.05, "http://e": 0.0}
    assert [v.tile_seconds for v in WorkerPool.views([a, c])] == [2.0, 2.0]
