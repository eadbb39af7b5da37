"""The stream engine (the CPU default and the reference): DecodeWorker, one thread that decodes
each stream with its own StreamState, batching steps that are due together batch-invariantly.
See vocoder_svc/server.py for how the service picks between the engines."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from vocoder_svc.codec import MossAudioTokenizer, StreamState
from vocoder_svc.metrics import Metrics


@dataclass
class _Job:
    state: StreamState
    codes: np.ndarray  # [T, n_q] int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def resolve_future(fut: asyncio.Future, result: object, error: BaseException | None) -> None:
    if fut.done():  # the call was cancelled meanwhile
        return
    if isinstance(error, asyncio.CancelledError):
        fut.cancel()
    elif error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class DecodeWorker:
    """One thread that runs decode steps in submission order. It takes the
    oldest pending step and, up to max_batch, later ones with the same
    (frames, codebooks) from other streams, and decodes them in one forward
    (batch-invariant unless invariant=False)."""

    def __init__(self, codec: MossAudioTokenizer, metrics: Metrics, max_batch: int = 1, invariant: bool = True):
        self.codec, self.metrics, self.max_batch = codec, metrics, max(1, max_batch)
        self.invariant = invariant
        self._cond = threading.Condition()
        self._pending: list[_Job] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="codec-decode", daemon=True)
        self._thread.start()

    def submit(self, state: StreamState, codes: np.ndarray) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            if self._closed:
                raise RuntimeError("decode worker is closed")
            self._pending.append(_Job(state, codes, fut, loop))
            self._cond.notify()
        return fut

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _take(self) -> list[_Job] | None:
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if not self._pending:
                return None
            head = self._pending[0]
            key = head.codes.shape
            group, streams = [], set()
            for j in self._pending:  # only a stream's oldest step is eligible: the next needs its state
                if j.codes.shape == key and id(j.state) not in streams and len(group) < self.max_batch:
                    group.append(j)
                streams.add(id(j.state))
            taken = {id(j) for j in group}
            self._pending = [j for j in self._pending if id(j) not in taken]
            return group

    def _run(self) -> None:
        while (group := self._take()) is not None:
            group = [j for j in group if not j.future.cancelled()]  # best effort: skip abandoned steps
            if not group:
                continue
            try:
                codes = torch.from_numpy(np.stack([j.codes.T for j in group], axis=1).astype(np.int64))
                t0 = time.perf_counter()
                wav = self.codec.decode_step([j.state for j in group], codes,  # [B, C, T*hop]
                                             batch_invariant=self.invariant)
                out = wav.to(device="cpu", dtype=torch.float32).numpy()
                self.metrics.decode_step_ms.observe((time.perf_counter() - t0) * 1000.0)
                self.metrics.decode_batch_streams.observe(len(group))
                results = [(out[b], None) for b in range(len(group))]
            except BaseException as e:  # noqa: BLE001 - reported to every waiting call
                results = [(None, e)] * len(group)
            for job, (res, err) in zip(group, results):
                job.loop.call_soon_threadsafe(resolve_future, job.future, res, err)
