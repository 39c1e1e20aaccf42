"""The MTP proposer: DeepSeek-V4's multi-token-prediction layer (models/deepseek_v4/mtp.py) drafts from
the target's own last residual streams.

    ModelRunner.run ─▶ observe(rows, streams): after every target forward, each request's rows'
                       streams are kept (the last `keep` positions; rejected drafts' rows are dropped
                       at the next proposal, whose request then has fewer tokens than they assumed)
    propose_batch   ─▶ forward 1: per request, the MTP layer over the positions it has not seen from
                       the target yet (stream of position p with token p + 1, up to the last known
                       token), batched -> draft 1 from the last row
                    ─▶ forward j = 2..k: the layer's own output stream at the previous position with
                       draft j - 1 -> draft j (the chained positions are recomputed from the target's
                       streams once it has verified them)
    on_finished     ─▶ the request's MTP window blocks are freed

The MTP layer's attention keeps a sliding window of K=V: one `SlidingWindow` group in a
`KVCacheManager` of its own (shadow requests with the target's ids), over the layer's cache. Streams are
kept for the last `keep` positions only (window + two steps of drafts), so a request that did not draft
for a while (or has a long prompt) starts its MTP window at a block boundary inside what is kept: the
positions before it are masked (`key_floors`) rather than recomputed. That can lower acceptance on those
first positions, never correctness: verification decides what is kept.
Greedy requests draft the argmax; sampled ones draw from q (temperature / top-k / top-p of the request)
and hand q over for min(1, p/q) verification.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.engine.request import Request
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.spec.draft_sampling import DraftTokenChooser, pack_drafts
from deepinfer.engine.spec.proposer import Draft, Proposer, ProposerStats
from deepinfer.kvcache.blocks import NO_BLOCK
from deepinfer.kvcache.manager import KVCacheManager, PrefixHit
from deepinfer.layers.attention import AttentionBatch
from deepinfer.models.deepseek_v4.mtp import V4MTPLayer


@dataclass
class _State:
    shadow: Request  # the MTP window's view: num_computed_tokens = positions in its KV
    pos0: int = 0  # position of streams[0]
    streams: torch.Tensor | None = None  # [m, hc, D]: the target's streams at pos0 .. pos0 + m - 1
    done: int = 0  # positions < done are in the MTP KV from the target's streams (final)
    floor: int = 0  # first position in the MTP KV (earlier keys are masked)
    extra: dict = field(default_factory=dict)

    def end(self) -> int:
        return self.pos0 + (0 if self.streams is None else self.streams.shape[0])


class MTPProposer(Proposer):
    name = "mtp"

    def __init__(self, target, layer: V4MTPLayer, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, k_max: int, seed: int | None = None) -> None:
        self.target, self.layer = target, layer
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size, "mtp", "mtp", False, [layer.kv_spec], 0)
        self.cache = layer.allocate_cache(num_blocks, block_size, dtype, device)
        self.device = device
        self.keep = layer.window + 2 * (k_max + 1) + block_size
        self.states: dict[str, _State] = {}
        self.chooser = DraftTokenChooser(seed)
        self.stats = ProposerStats()

    # ------------------------------------------------------------------ the target's streams

    def observe(self, rows: list[tuple[str, int, int]], streams: torch.Tensor) -> None:
        """A target forward ran `rows` (request id, first position, count) with these last streams."""
        off = 0
        for rid, start, n in rows:
            part = streams[off:off + n]
            off += n
            st = self.states.get(rid)
            if st is None:
                st = self.states[rid] = _State(Request(rid, [], SamplingParams(max_tokens=None)))
            if st.streams is None or start > st.end() or start < st.pos0:
                st.pos0, st.streams = start, part.clone()
            else:
                st.streams = torch.cat([st.streams[:start - st.pos0], part])
            over = st.streams.shape[0] - self.keep
            if over > 0:
                st.streams, st.pos0 = st.streams[over:].clone(), st.pos0 + over

    # ------------------------------------------------------------------ interface

    def propose(self, req: Request, max_tokens: int) -> Draft:
        return self.propose_batch([req], [max_tokens])[0]

    @torch.inference_mode()
    def propose_batch(self, reqs: list[Request], max_tokens: list[int]) -> list[Draft]:
        out = [Draft() for _ in reqs]
        # forward 1: each request's unseen target positions
        feeds = []  # (index, state, first position, streams, next ids)
        for i, (req, k) in enumerate(zip(reqs, max_tokens, strict=True)):
            if k > 0 and (feed := self._catch_up(req)) is not None:
                feeds.append((i, *feed))
        if not feeds:
            return out
        logits, last = self._run([(st, p, s, ids) for _, st, p, s, ids in feeds])
        tokens: dict[int, list[int]] = {}
        probs: dict[int, list[torch.Tensor]] = {}
        live = []
        for (i, st, p, s, _ids), row, h in zip(feeds, logits, last, strict=True):
            st.done = p + s.shape[0]
            token, q = self._choose(reqs[i], row)
            tokens[i], probs[i] = [token], [q] if q is not None else []
            live.append((i, st, h))
        # forwards 2..k: chained on the layer's own output streams
        for j in range(1, max(max_tokens[i] for i, _, _ in live)):
            live = [(i, st, h) for i, st, h in live if j < max_tokens[i]]
            if not live:
                break
            items = [(st, st.shadow.num_computed_tokens, h.unsqueeze(0),
                      torch.tensor([tokens[i][-1]], device=self.device)) for i, st, h in live]
            ok = [self.kv.allocate(st.shadow, 1) for st, *_ in items]
            live = [x for x, good in zip(live, ok, strict=True) if good]
            items = [x for x, good in zip(items, ok, strict=True) if good]
            if not items:
                break
            logits, last = self._run(items)
            live = [(i, st, h) for (i, st, _), h in zip(live, last, strict=True)]
            for (i, _, _), row in zip(live, logits, strict=True):
                token, q = self._choose(reqs[i], row)
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q)
        return pack_drafts(out, tokens, probs, self.stats)

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        st = self.states.get(req.request_id)
        if st is not None:
            self._cut(st, st.done)  # chained positions: recomputed from the target's streams next time

    def on_finished(self, req: Request) -> None:
        st = self.states.pop(req.request_id, None)
        if st is not None:
            self.kv.free(st.shadow)

    # ------------------------------------------------------------------ steps

    def _cut(self, st: _State, n: int) -> None:
        if n < st.shadow.num_computed_tokens:
            st.shadow.num_computed_tokens = n
            self.kv.truncate(st.shadow, n)

    def _catch_up(self, req: Request):
        """(state, first position, streams [n, hc, D], next ids [n]) of the positions the MTP layer has not
        seen from the target, with their blocks allocated; None if the request cannot draft now."""
        st = self.states.get(req.request_id)
        last = len(req.token_ids) - 2  # the position whose stream predicted the last token
        if st is None or st.streams is None or last < st.pos0 or last >= st.end():
            return None
        # proposed before without a target step since (the request was not scheduled): redo the last row
        st.done = min(st.done, last)
        self._cut(st, st.done)
        if st.done < st.pos0 or st.shadow.request_id not in self.kv.block_tables:
            # no MTP KV for positions just before what is kept: restart the window at a block boundary
            self.kv.free(st.shadow)
            floor = -(-st.pos0 // self.bs) * self.bs
            if floor > last:
                return None
            st.floor = st.done = st.shadow.num_computed_tokens = floor
            hit = PrefixHit([NO_BLOCK] * (floor // self.bs), floor // self.bs)
            st.shadow.token_ids = []
            if not self.kv.allocate(st.shadow, last + 1 - floor, hit):
                self.kv.free(st.shadow)
                return None
        elif not self.kv.allocate(st.shadow, last + 1 - st.done):
            return None
        first = st.done
        streams = st.streams[first - st.pos0:last + 1 - st.pos0]
        ids = torch.tensor(req.token_ids[first + 1:last + 2], device=self.device)
        return st, first, streams, ids

    def _run(self, items: list[tuple[_State, int, torch.Tensor, torch.Tensor]]):
        """One MTP forward over `items` (state, first position, streams, next ids; blocks allocated);
        returns each item's last-row logits (float, CPU) and last output stream."""
        order = sorted(range(len(items)), key=lambda i: items[i][2].shape[0] != 1)  # one-row items first
        qlens = [items[i][2].shape[0] for i in order]
        ctx = [items[i][1] + items[i][2].shape[0] for i in order]
        tables = [self.kv.block_tables[items[i][0].shadow.request_id] for i in order]
        floors = [items[i][0].floor for i in order]
        batch = AttentionBatch(qlens, ctx, tables, sum(q == 1 for q in qlens), torch.zeros(0, dtype=torch.long),
                               self.bs, self.layer.window, floors)
        streams = torch.cat([items[i][2] for i in order])
        ids = torch.cat([items[i][3] for i in order])
        pos = torch.cat([torch.arange(items[i][1], items[i][1] + items[i][2].shape[0]) for i in order]).to(self.device)
        logits, out = self.layer(streams, ids, pos, self.target, self.cache, self.layer.prepare(batch, self.device))
        ends = torch.tensor(qlens).cumsum(0) - 1
        last_logits, last_streams = logits[ends].float().cpu(), out[ends]
        for i, q in zip(order, qlens, strict=True):
            items[i][0].shadow.num_computed_tokens = items[i][1] + q
        back = [0] * len(items)
        for r, i in enumerate(order):
            back[i] = r
        return last_logits[back], last_streams[back]

    def _choose(self, req: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        return self.chooser.choose(req, logits)


def build_mtp_proposer(method, core) -> MTPProposer:
    """The MTP proposer of the engine core's target: DeepSeek-V4 with `num_nextn_predict_layers` > 0 and the
    `mtp.0.*` tensors in its checkpoint (the first MTP layer drafts every position, chained)."""
    from deepinfer.models.deepseek_v4.mtp import num_mtp_layers

    cfg, runner = core.hf_config, core.runner
    if getattr(cfg, "model_type", None) != "deepseek_v4" or not num_mtp_layers(cfg):
        raise ValueError('speculative method "mtp" needs a DeepSeek-V4 checkpoint with num_nextn_predict_layers > 0 '
                         f"(got model_type {getattr(cfg, 'model_type', None)!r}, "
                         f"num_nextn_predict_layers={num_mtp_layers(cfg)})")
    layer = V4MTPLayer(cfg)
    if not layer.load_weights(core.files.iter_weights(runner.dtype)):
        raise ValueError(f"{core.files.source} declares num_nextn_predict_layers={num_mtp_layers(cfg)} but holds no "
                         "mtp.0.* tensors")
    layer = layer.to(device=runner.device, dtype=runner.dtype).eval()
    sc = core.config.scheduler
    bs = core.config.cache.block_size
    k_max = method.num_speculative_tokens
    per_request = -(-(layer.window + 2 * (k_max + 1) + 2 * bs) // bs) + 2
    proposer = MTPProposer(runner.model, layer, sc.max_num_seqs * per_request, bs, runner.dtype, runner.device,
                           k_max, core.config.model.seed)
    runner.model.keep_streams = True
    runner.stream_sink = proposer.observe
    return proposer
