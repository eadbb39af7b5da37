"""Per-request decode state that lives on the worker, so a decode step
message is O(batch): the next input embedding (feedback of the last frame),
sampling parameters, the frame counter, the repetition-penalty history and
the request's KV slot list (the worker's mirror of the scheduler's table).

Rows are tensors indexed by pool row so a whole batch's parameters gather in
one indexing op; row `capacity` is a spare, never handed out. `sample_and_commit`
is a batch's frame decode against the pool: what every step path (graphed or
eager) ends with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from chorus.v1 import worker_pb2
from gpu_worker.model import FrameSampling, MossTTSLocal


class PoolExhausted(RuntimeError):
    pass


class SlotList:
    """A request's KV slots in position order, in a growable int32 array: a step
    hands attention a view, so building a batch's page table is one concatenate."""

    def __init__(self, capacity: int = 256):
        self._buf = np.empty(capacity, dtype=np.int32)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def extend(self, slots) -> None:
        slots = np.asarray(slots, dtype=np.int32)
        end = self._n + slots.size
        if end > self._buf.size:
            grown = np.empty(max(end, 2 * self._buf.size), dtype=np.int32)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        self._buf[self._n:end] = slots
        self._n = end

    def append(self, slot: int) -> None:
        self.extend((slot,))

    def view(self) -> np.ndarray:
        return self._buf[:self._n]


@dataclass
class RequestState:
    row: int
    kv_slots: SlotList = field(default_factory=SlotList)
    prompt_length: int = 0
    stopped: bool = False


class DecodeStatePool:
    def __init__(self, capacity: int, hidden: int, n_vq: int, audio_vocab: int,
                 dtype: torch.dtype, device: torch.device):
        self.capacity = capacity
        rows = capacity + 1
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.feedback = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.text_temperature = torch.zeros(rows, **f32)
        self.text_top_p = torch.ones(rows, **f32)
        self.text_top_k = torch.zeros(rows, **i64)
        self.audio_temperature = torch.zeros(rows, **f32)
        self.audio_top_p = torch.ones(rows, **f32)
        self.audio_top_k = torch.zeros(rows, **i64)
        self.audio_penalty = torch.ones(rows, **f32)
        self.seed = torch.zeros(rows, **i64)
        self.generation_step = torch.zeros(rows, **i64)
        self.min_frames = torch.zeros(rows, **i64)
        self.presence = torch.zeros(rows, n_vq, audio_vocab, dtype=torch.bool, device=device)
        self._true = torch.ones((), dtype=torch.bool, device=device)  # index_put_'s value, already on the device
        self.penalised = [False] * rows
        self._free = list(range(capacity - 1, -1, -1))
        self.requests: dict[int, RequestState] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def acquire(self, request_id: int, sampling: worker_pb2.SamplingConfig, generation_step: int,
                prompt_length: int) -> RequestState:
        if request_id in self.requests:
            raise ValueError(f"request {request_id} already holds decode state")
        if not self._free:
            raise PoolExhausted(f"decode state pool full ({self.capacity} requests)")
        r = self._free.pop()
        penalty = sampling.audio_repetition_penalty or 1.0
        self.penalised[r] = penalty != 1.0  # host mirror: deciding the penalty path needs no device sync
        # fill_ on a row view: `t[r] = python_number` on CUDA copies a CPU scalar tensor to the device
        # with a blocking copy, which waits for every kernel queued before it: the launch of a step
        # with prefill would wait for the step before it to finish. fill_ passes the number with the
        # kernel: nothing waits.
        for column, value in ((self.text_temperature, sampling.text_temperature),
                              (self.text_top_p, sampling.text_top_p), (self.text_top_k, sampling.text_top_k),
                              (self.audio_temperature, sampling.audio_temperature),
                              (self.audio_top_p, sampling.audio_top_p), (self.audio_top_k, sampling.audio_top_k),
                              (self.audio_penalty, penalty), (self.seed, sampling.seed),
                              (self.min_frames, sampling.min_frames), (self.generation_step, generation_step)):
            column[r].fill_(value)
        self.presence[r].fill_(False)
        self.feedback[r].zero_()
        state = RequestState(row=r, prompt_length=prompt_length)
        self.requests[request_id] = state
        return state

    def release(self, request_id: int) -> bool:
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        self._free.append(state.row)
        return True

    def get(self, request_id: int) -> RequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise KeyError(f"request {request_id} has no decode state (not prefilled, or released)")
        return state

    def sampling(self, rows: Tensor, with_presence: bool) -> FrameSampling:
        """Gather a batch's parameters. with_presence=False skips the penalty history
        (exact when no row has a penalty: a penalty of 1 is a bit-exact no-op)."""
        return FrameSampling(
            text_temperature=self.text_temperature[rows], text_top_k=self.text_top_k[rows],
            text_top_p=self.text_top_p[rows], audio_temperature=self.audio_temperature[rows],
            audio_top_k=self.audio_top_k[rows], audio_top_p=self.audio_top_p[rows],
            audio_penalty=self.audio_penalty[rows], seed=self.seed[rows],
            generation_step=self.generation_step[rows], min_frames=self.min_frames[rows],
            presence=self.presence[rows] if with_presence else None,
        )

    def record_history(self, row: int, codes: Tensor) -> None:
        """Mark generated codes [n, n_vq] in the repetition-penalty history."""
        if codes.numel():
            k = torch.arange(codes.shape[1], device=codes.device).expand_as(codes)
            self.presence[row].index_put_((k.reshape(-1), codes.reshape(-1)), self._true)

    def commit(self, rows: Tensor, codes: Tensor, stop: Tensor, feedback: Tensor) -> None:
        """After a frame: advance n, store the feedback embedding, extend the history.
        Written with masks, not boolean indexing, so it never syncs with the host
        and can live inside a CUDA graph. Rows must be distinct (padding rows all
        point at the spare row, whose contents do not matter)."""
        keep = ~stop
        self.generation_step[rows] = self.generation_step[rows] + keep.to(torch.int64)
        self.feedback[rows] = torch.where(keep[:, None], feedback, self.feedback[rows])
        k = torch.arange(codes.shape[1], device=codes.device)[None, :].expand_as(codes)
        r = rows[:, None].expand_as(codes)
        self.presence[r, k, codes] = self.presence[r, k, codes] | keep[:, None]

    @property
    def spare_row(self) -> int:
        """A row never handed out: the target of padding rows in graphed batches."""
        return self.capacity

    def any_penalised(self, rows: list[int]) -> bool:
        return any(self.penalised[r] for r in rows)


def sample_and_commit(model: MossTTSLocal, pool: DecodeStatePool, hidden: torch.Tensor, rows: torch.Tensor,
                      with_presence: bool) -> torch.Tensor:
    """Frame decode for pool rows `rows` from backbone hidden [B, H]; updates the pool.
    Returns [B, row_width + 2]: the sampled row, the stop flag, and n (frames before)."""
    sp = pool.sampling(rows, with_presence)
    codes, stop = model.decode_frame(hidden, sp)
    frame_rows = model.frame_rows(codes)
    pool.commit(rows, codes, stop, model.embed_rows(frame_rows))
    return torch.cat([frame_rows, stop[:, None].to(frame_rows.dtype), sp.generation_step[:, None]], dim=1)
