"""The scheduler's policy: which requests run, what each step does, what its journal means.

A new request is refused when its expected wait passes the bound (scheduler_svc/admission.py:
the latency promise), else it waits in FIFO order until it is admitted (KV for its rows is found), prefills
its rows a chunk at a time, then decodes one frame per step until it stops, reaches its
frame budget, or is aborted; a finished request is released on the worker in the next plan.

KV: every row of a request lives in one slot. A prefix may come from the radix cache
(locked while the request runs); the rest is the request's own, allocated a page at a time
as it grows. When a decode step cannot get a page, the cache is evicted first, then
requests are retracted (fewest frames first): their rows go back to the cache, and they
re-prefill prompt + output later and resume at the same frame. Seeded sampling depends only
on (seed, frame, channel), so none of this changes a request's frames.

Steps may be planned before the previous journals return (the driver's lookahead): a
request that stopped in step N may still be decoded in the steps already planned, and those
late frames are discarded here. Retraction waits until no step is in flight.

Pure bookkeeping: no I/O, no clock, no metrics (`counts` is what the driver publishes).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from chorus.v1 import worker_pb2
from chorus.wire import matrix_array, rows_matrix
from scheduler_svc.admission import Decision, Estimate, Rates, decide
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.kv_allocator import KVSlotAllocator
from scheduler_svc.radix_cache import RadixCache
from scheduler_svc.request import ErrorEvent, EventSink, FinishEvent, FrameEvent, Phase, QueueFull, Request
from scheduler_svc.row_keys import prompt_row_key, prompt_row_keys

log = logging.getLogger("chorus.scheduler")


@dataclass
class Counts:
    """Running totals of what the policy did."""
    frames: int = 0
    prefill_rows: int = 0
    radix_hit_rows: int = 0
    retractions: int = 0
    aborted: int = 0
    admitted: int = 0    # accepted with an expected time to first frame within the objective
    queued: int = 0      # accepted beyond the objective, within the wait bound
    refused: int = 0     # refused: the expected wait passed the bound, or the queue was full


@dataclass
class Step:
    plan: worker_pb2.StepPlan
    writes: dict[int, int]  # request id -> rows whose KV this plan writes


class Policy:
    def __init__(self, config: SchedulerConfig, hello: worker_pb2.Hello, sink: EventSink):
        worker_page = max(hello.page_size, 1)
        page_size = config.page_size or worker_page
        if page_size % worker_page:
            raise ValueError(f"page size {page_size} is not a multiple of the worker's page size {worker_page}: "
                             f"its attention reads whole pages (leave --page-size at 0 to use the worker's)")
        self.config = config
        self.sink = sink
        self.kv = KVSlotAllocator(hello.kv_slots, page_size)
        self.cache = RadixCache(self.kv)
        self.max_running = min(config.max_running or hello.max_batch, hello.max_batch)  # 0: the worker's
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.pending_release: list[int] = []  # request ids whose worker state the next plan frees
        self.counts = Counts()
        self.rates = Rates()  # the driver's measurements, for admission estimates
        self.finished: list[Request] = []  # ended by stop or max_frames since the driver last looked
        self._ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._steps_since_prefill = 0

    # ---- requests in and out -------------------------------------------------
    def add(self, req: Request) -> Request:
        """Queue a request, or QueueFull (with a retry hint) when the queue is full or its expected
        wait passes max_expected_wait_s."""
        estimate = self.estimate()
        if len(self.waiting) >= self.config.max_queue:
            self.counts.refused += 1
            raise QueueFull(f"the waiting queue is full ({self.config.max_queue} requests); retry later",
                            retry_after=self._finite(estimate.wait_s))
        if estimate.decision is Decision.REFUSE:
            self.counts.refused += 1
            raise QueueFull(f"the expected wait ({estimate.wait_s:.1f} s) passes the bound "
                            f"({self.config.max_expected_wait_s:g} s); retry in {estimate.retry_after_s:.1f} s",
                            retry_after=estimate.retry_after_s)
        if estimate.decision is Decision.QUEUE:
            self.counts.queued += 1
        else:
            self.counts.admitted += 1
        req.id = next(self._ids)
        req.keys = prompt_row_keys(req.prompt_rows).tolist()
        self.waiting.append(req)
        return req

    def abort(self, req: Request) -> None:
        """The client went away: drop the request wherever it is. Idempotent."""
        if req.phase is Phase.DONE:
            return
        if req.phase is Phase.WAITING:
            self.waiting.remove(req)
            req.phase = Phase.DONE
            return
        self._finish(req, None)
        self.counts.aborted += 1

    def estimate(self) -> Estimate:
        """The admission estimate for a request arriving now (behind every waiting request)."""
        return decide(len(self.waiting), len(self.running), self.max_running, self.prefill_interval(len(self.running)),
                      self.rates, self.config.ttfa_objective_ms / 1e3, self.config.max_expected_wait_s)

    def _finite(self, seconds: float) -> float:
        """A retry hint: the estimate, or the bound while nothing has been measured."""
        return seconds if seconds != float("inf") else self.config.max_expected_wait_s

    @property
    def loaded(self) -> bool:
        """Whether the scheduler runs under load (loaded_batch or more requests admitted): the frontends
        then start new streams with their loaded first-chunk size (--first-chunk-frames-loaded)."""
        return 0 < self.config.loaded_batch <= len(self.running)

    # ---- a step --------------------------------------------------------------
    def schedule(self, in_flight: int = 0) -> Step | None:
        """The next step: a frame for every decoding request, then prefill chunks (admitting waiting
        requests) when prefill is due. None: nothing to do, or KV is short and only retraction would
        help, which waits until the `in_flight` steps already planned have returned."""
        decoders = [r for r in self.running.values()
                    if r.phase is Phase.DECODE or (r.phase is Phase.PREFILL and r.rows_sent == r.prefill_len)]
        decoders = [r for r in decoders if 0 < r.frames_planned < r.max_frames and not r.paused]
        if not self._reserve_decode_pages(decoders, in_flight):
            return None
        plan = worker_pb2.StepPlan(step_id=next(self._step_ids))
        writes: dict[int, int] = {}
        for req in decoders:
            pos = req.rows_sent
            if pos >= len(req.kv_slots):
                req.kv_slots += self.kv.alloc(1)
            plan.decode.add(request_id=req.id, kv_slot=req.kv_slots[pos])
            req.rows_sent += 1
            req.frames_planned += 1
            writes[req.id] = 1
        interval = self.prefill_interval(len(plan.decode))
        prefill_now = self._steps_since_prefill + 1 >= interval
        if prefill_now:
            self._admit(in_flight)
        # A step that prefills for `interval` steps takes their rows: gathering must not cut the rate
        # at which requests get in (a burst of arrivals under load would drain at a chunk per interval).
        budget = (self.config.prefill_chunk * interval or 1 << 30) if prefill_now else 0
        for req in self.running.values():
            if req.phase is not Phase.PREFILL or req.rows_sent >= req.prefill_len or budget <= 0:
                continue
            start = req.rows_sent
            n = min(budget, req.prefill_len - start)
            first = start == req.cached_len
            item = plan.prefill.add(request_id=req.id, first_chunk=first, last_chunk=start + n == req.prefill_len,
                                    generation_step=len(req.frames))
            item.rows.CopyFrom(rows_matrix(req.rows(start, start + n)))
            item.kv_slots.extend(req.kv_slots[start:start + n])
            if first:
                item.prefix_slots.extend(req.kv_slots[:start])
                item.sampling.CopyFrom(req.sampling)
                item.prompt_length = req.prompt_len
            req.rows_sent += n
            writes[req.id] = n
            self.counts.prefill_rows += n
            if item.last_chunk:
                req.frames_planned += 1
            budget -= n
        plan.release.extend(self.pending_release)
        self.pending_release = []
        self._steps_since_prefill = 0 if plan.prefill else self._steps_since_prefill + 1
        if not (plan.prefill or plan.decode or plan.release):
            return None
        return Step(plan, writes)

    def prefill_interval(self, decoding: int) -> int:
        """Prefill work is admitted and prefilled every n-th step (n returned here). While requests
        decode it is gathered (each step that carries prefill pays a fixed cost in the worker, folded or
        not): n = prefill_interval, or under load (loaded_batch or more decoding) at least
        loaded_prefill_interval; with nothing decoding, 1."""
        if not decoding:
            return 1
        interval = max(1, self.config.prefill_interval)
        if self.config.loaded_batch and decoding >= self.config.loaded_batch:
            interval = max(interval, self.config.loaded_prefill_interval)
        return interval

    def _reserve_decode_pages(self, decoders: list[Request], in_flight: int) -> bool:
        """Make room for every decoder that needs a new page this step: evict the cache, then (with
        nothing in flight) retract the requests with fewest frames. False: wait for in-flight steps."""
        need = sum(1 for r in decoders if r.rows_sent >= len(r.kv_slots)) * self.kv.page_size
        if self.kv.free_slots >= need or self.cache.ensure_free(need):
            return True
        if in_flight:
            return False
        victims = sorted(self.running.values(), key=lambda r: (len(r.frames), -r.id))
        while self.kv.free_slots < need and victims:
            victim = victims.pop(0)
            if victim in decoders and victim.rows_sent >= len(victim.kv_slots):
                need -= self.kv.page_size
            if victim in decoders:
                decoders.remove(victim)
            self.retract(victim)
            self.cache.ensure_free(need)
        return True

    def _admit(self, in_flight: int) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            total = req.prompt_len + len(req.frames)
            match = None
            if self.config.radix_cache:
                # Never match the last row: its hidden state is what samples the next frame.
                match = self.cache.match_prefix(req.keys[:total - 1], self.config.cache_key)
                self.cache.lock(match.node)  # before any eviction below can take it
            cached = match.length if match else 0
            # Keep a page per running request in reserve so admission never starves decodes.
            reserve = len(self.running) * self.kv.page_size
            fits = self.cache.ensure_free(total - cached + reserve) or (
                not self.running and not in_flight and self.cache.ensure_free(total - cached))
            if not fits:
                if match:
                    self.cache.unlock(match.node)
                break  # FIFO: wait for running requests to finish or be retracted
            self.waiting.popleft()
            req.prefix_node = match.node if match else None
            req.kv_slots = (match.slots if match else []) + self.kv.alloc(total - cached)
            req.cached_len = req.rows_sent = req.rows_written = cached
            req.prefill_len = total
            req.frames_planned = len(req.frames)
            if req.retractions == 0:
                req.cached_prompt_rows = cached
                self.counts.radix_hit_rows += cached
            req.phase = Phase.PREFILL
            req.holds_worker_state = True
            self.running[req.id] = req

    # ---- its journal ---------------------------------------------------------
    def apply(self, journal: worker_pb2.Journal, writes: dict[int, int]) -> None:
        """A step's results: rows written, a frame (or a stop) per request sampled."""
        for rid, n in writes.items():
            req = self.running.get(rid)
            if req is not None:
                req.rows_written += n
        rows = matrix_array(journal.rows) if journal.request_ids else None
        for i, rid in enumerate(journal.request_ids):
            req = self.running.get(rid)
            if req is None or journal.generation_steps[i] != len(req.frames):
                continue  # finished or aborted while the step ran, or a frame past its end
            if journal.stopped[i]:
                self._finish(req, "stop")
                continue
            req.phase = Phase.DECODE
            row = rows[i].copy()
            req.frames.append(row)
            req.keys.append(prompt_row_key(row))
            self.sink.emit(req, FrameEvent(len(req.frames) - 1, row))
            self.counts.frames += 1
            if len(req.frames) >= req.max_frames:
                self._finish(req, "max_frames")

    def fail(self, request_ids: Iterable[int], message: str, unavailable: bool = False) -> None:
        """End these running requests with an error (their step failed; unavailable: the worker is gone)."""
        for rid in request_ids:
            req = self.running.get(rid)
            if req is not None:
                self._finish(req, None)
                self.sink.emit(req, ErrorEvent(message, unavailable))

    def fail_all(self, message: str) -> None:
        """The worker is gone and no other came: end every request, running or waiting, as unavailable."""
        self.fail(list(self.running), message, unavailable=True)
        while self.waiting:
            req = self.waiting.popleft()
            req.phase = Phase.DONE
            self.sink.emit(req, ErrorEvent(message, unavailable=True))

    # ---- ending --------------------------------------------------------------
    def retract(self, req: Request, why: str = "KV full") -> None:
        """Free a running request's KV and queue it first to re-prefill prompt + output."""
        log.info("retracting request %d at frame %d (%s)", req.id, len(req.frames), why)
        self.counts.retractions += 1
        req.retractions += 1
        self._drop_from_worker(req)
        req.phase = Phase.WAITING
        req.frames_planned = len(req.frames)
        self.waiting.appendleft(req)

    def forget_worker_state(self) -> None:
        """The worker lost its KV and decode state (it restarted): every running request is queued
        again to re-prefill its prompt and the frames it has (the determinism contract makes its audio
        go on exactly), and the KV bookkeeping and the radix cache start empty: a cached prefix would
        point at rows the new worker never wrote."""
        running = sorted(self.running.values(), key=lambda r: r.id, reverse=True)  # appendleft: keep order
        for req in running:
            self.retract(req, "the worker restarted")
        self.cache.reset()
        self.kv.reset()
        # Plans lost on the way may have left decode state for these in the new worker: release it
        # (the next plan's releases run before its prefills; an unknown id is a no-op).
        self.pending_release = [req.id for req in running]

    def _finish(self, req: Request, reason: str | None) -> None:
        req.phase = Phase.DONE
        self._drop_from_worker(req)
        if reason is not None:
            req.finish_reason = reason
            self.sink.emit(req, FinishEvent(reason))
            self.finished.append(req)

    def _drop_from_worker(self, req: Request) -> None:
        self.running.pop(req.id, None)
        if req.holds_worker_state:
            self.pending_release.append(req.id)
            req.holds_worker_state = False
        self._release_kv(req)

    def _release_kv(self, req: Request) -> None:
        """Give the request's KV back: written rows to the radix cache (so a re-prefill or a request
        with the same prefix can reuse them), the rest to the allocator; then unlock its matched prefix."""
        m, n = req.cached_len, req.rows_written
        own = req.kv_slots[m:]
        if self.config.radix_cache and n > m:
            p = self.cache.insert(req.keys[:n], req.kv_slots[:n], self.config.cache_key)
            whole = n - n % self.kv.page_size
            if p > m:
                self.kv.free(req.kv_slots[m:p])  # someone cached these rows first: ours are duplicates
            own = req.kv_slots[max(whole, m):]
        if own:
            self.kv.free(own)
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.kv_slots, req.prefix_node = [], None
        req.cached_len = req.rows_sent = req.rows_written = 0
