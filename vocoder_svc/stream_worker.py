"""The stream engine (the CPU default and the reference): DecodeWorker, one thread that decodes
each stream with its own StreamState, batching steps that are due together batch-invariantly.
See vocoder_svc/server.py for how the service picks between the engines."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import torch

from vocoder_svc.batch_thread import BatchThread
from vocoder_svc.codec import MossAudioTokenizer, StreamState
from vocoder_svc.metrics import Metrics


@dataclass
class _Job:
    state: StreamState
    codes: np.ndarray  # [T, n_q] int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class DecodeWorker(BatchThread):
    """One thread that runs decode steps in submission order. It takes the
    oldest pending step and, up to max_batch, later ones with the same
    (frames, codebooks) from other streams, and decodes them in one forward
    (batch-invariant unless invariant=False)."""

    def __init__(self, codec: MossAudioTokenizer, metrics: Metrics, max_batch: int = 1, invariant: bool = True):
        self.codec, self.metrics, self.max_batch = codec, metrics, max(1, max_batch)
        self.invariant = invariant
        super().__init__("codec-decode")

    def submit(self, state: StreamState, codes: np.ndarray) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.queue(_Job(state, codes, fut, loop))
        return fut

    def choose(self, pending: list[_Job]) -> list[_Job]:
        head = pending[0]
        key = head.codes.shape
        group, streams = [], set()
        for j in pending:  # only a stream's oldest step is eligible: the next needs its state
            if j.codes.shape == key and id(j.state) not in streams and len(group) < self.max_batch:
                group.append(j)
            streams.add(id(j.state))
        return group

    def run(self, group: list[_Job]) -> list[np.ndarray]:
        codes = torch.from_numpy(np.stack([j.codes.T for j in group], axis=1).astype(np.int64))
        t0 = time.perf_counter()
        wav = self.codec.decode_step([j.state for j in group], codes,  # [B, C, T*hop]
                                     batch_invariant=self.invariant)
        out = wav.to(device="cpu", dtype=torch.float32).numpy()
        self.metrics.decode_step_ms.observe((time.perf_counter() - t0) * 1000.0)
        self.metrics.decode_batch_streams.observe(len(group))
        return list(out)
