"""The packed canvas step: canvases live on the worker between steps; one step runs a list of
requests, each at its own step index with its own knobs, through ONE forward over all their
documents (packing.py), then unmasks each canvas on its own (unmask.py).

A request's tokens depend only on its own inputs, knobs and seed: documents never attend across
each other, positions restart per document, and its noise comes from its own (seed, step)
generator. A canvas is dropped once its last step has run (its codes go out in that outcome);
release() drops one earlier and is a no-op for a canvas no longer held.

A step runs in two halves so the worker can overlap them: `launch` checks the step, queues its
work and the device-to-host copy of the canvases it finishes (on CUDA into pinned memory, behind
an event: nothing waits), and `finish` waits for that copy and returns the outcomes. The next
step may be launched before the previous one is finished: each step reads the canvases as the
steps queued before it leave them (the stream orders them on the device).

On CUDA the forward's attention is one Triton launch a layer (attention.py), over the step
padded to its bucket, and with cuda_graphs the forward up to the final norm replays from the
bucket's CUDA graph (graphs.py; without, it runs eagerly in the same bucket, with the same
kernels); the audio head and the unmasking (batched_unmask.py) run eagerly after it. The only
device-to-host copy of a step is the finished canvases' codes.

What a step's canvases fix (the layout, the head's rows, the packed mask, the unmasking tables, the
bucket's attention plan and positions) is built once and reused while the same canvases step
together (`Packed`): the host's time per step is what the worker's loop cannot overlap with its
messages, and at one canvas it is most of a GPU step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from chorus.omnivoice.knobs import RANGES, UnmaskKnobs, in_range, packed_rows, range_text
from gpu_worker.omnivoice.attention import make_document_attention
from gpu_worker.omnivoice.batched_unmask import Item, Tables, unmask_batch
from gpu_worker.omnivoice.model import OmniVoiceModel
from gpu_worker.omnivoice.packing import Document, Layout, layout
from gpu_worker.omnivoice.staging import to_device
from gpu_worker.omnivoice.unmask import reveal_counts, step_generator, unmask_step


class CanvasError(ValueError):
    """A canvas request the worker cannot run; the message names the field at fault."""


@dataclass
class CanvasSpec:
    request_id: int
    text_ids: np.ndarray                 # int64 [N]: style + text segment ids
    reference_codes: np.ndarray | None   # int64 [R, 8]
    target_frames: int
    knobs: UnmaskKnobs
    seed: int


@dataclass
class CanvasOutcome:
    request_id: int
    step: int
    finished: bool
    codes: np.ndarray | None             # int64 [T, 8] when finished


@dataclass
class PendingStep:
    """A launched step: its (request_id, step, finished) in item order, and the codes of the
    canvases it finished ([sum of their frames, C], in item order) on their way to the host."""

    items: list[tuple[int, int, bool]]
    frames: list[int]                      # target frames of each finished canvas, in item order
    codes: Tensor | None = None            # host tensor, filled once `done`
    done: torch.cuda.Event | None = None   # the step's end on the device; None on the CPU (already done)
    started: torch.cuda.Event | None = None  # the device reached the step (every step before it is done)

    def ready(self) -> bool:
        """Its outcomes can be reported: once its codes are on the host when it finishes canvases;
        else once the device has started it. Such a step's only result is that it ran; reported
        then, the scheduler plans the step after next while this one runs, and the device never
        holds more than this step and the scheduler's lookahead behind it."""
        if self.codes is None and self.started is not None:
            return self.started.query()
        return self.done is None or self.done.query()


@dataclass
class Canvas:
    spec: CanvasSpec
    ids: Tensor               # int64 [C, P + T]: the cond document; the canvas is its last T columns
    audio_mask: Tensor        # bool [P + T]
    counts: tuple[int, ...]   # cells revealed at each step
    steps_done: int = 0

    @property
    def target(self) -> int:
        return self.spec.target_frames

    @property
    def document(self) -> Document:
        return Document(self.ids.shape[1] - self.target, self.target, self.spec.knobs.guidance_scale != 0)


@dataclass
class Packed:
    """What a list of canvases fixes for every step they take together: the layout, the rows the
    head reads and the packed audio mask on the device, which canvases unmask together and their
    tables. At one canvas (and whenever no canvas joins or leaves) it is built once, not every step."""

    key: int                       # unique in its engine: graphs.py reuses what a step of the same key left
    canvases: list[Canvas]
    layout: Layout
    gather: Tensor                 # the layout's gather, on the device
    mask: Tensor                   # bool [rows]: the packed audio mask
    batched: list[int]             # the canvases unmasked together (batched_unmask.py), by index
    tables: Tables | None          # their tables


class CanvasEngine:
    def __init__(self, model: OmniVoiceModel, *, max_batch: int = 64, max_packed_rows: int = 24576,
                 attention: str = "auto", cuda_graphs: bool = True, batched_unmask: bool | None = None):
        """attention: auto, torch, flashinfer or triton (attention.make_document_attention); cuda_graphs:
        replay the bucketed forward from CUDA graphs (triton or flashinfer on CUDA; without, it runs eagerly
        in the same buckets);
        batched_unmask: unmask a step's canvases together (batched_unmask.py; None: on CUDA),
        else one by one with the reference (unmask.py)."""
        self.model = model
        self.cfg = model.cfg
        p = next(model.parameters())
        self.device = p.device
        self.max_batch = max_batch
        self.max_packed_rows = max_packed_rows
        self.attention = make_document_attention(attention, self.cfg, p.dtype, self.device)
        self.batched_unmask = self.device.type == "cuda" if batched_unmask is None else batched_unmask
        self.bucketed = None  # the forward in (rows, documents) buckets: triton or flashinfer on CUDA
        if self.device.type == "cuda" and self.attention.bucketed:
            from gpu_worker.omnivoice.graphs import BucketedForward

            self.bucketed = BucketedForward(model, self.attention, max_packed_rows, max_batch, replay=cuda_graphs)
        self.canvases: dict[int, Canvas] = {}
        self.dropped: set[int] = set()  # canvases of failed plans whose steps are skipped until released
        self._packed: Packed | None = None  # the last step's canvases and tables (_packed_for)
        self._packs = 0  # Packed built so far: the next one's key
        self.steps = 0

    def __len__(self) -> int:
        return len(self.canvases)

    def start(self, spec: CanvasSpec) -> None:
        """Hold a new canvas, all MASK, behind its prefix (text ids, then reference codes)."""
        if spec.request_id in self.canvases:
            raise CanvasError(f"canvas_start.request_id {spec.request_id}: that canvas is already held")
        text = np.asarray(spec.text_ids, dtype=np.int64)
        if text.ndim != 1 or text.size == 0:
            raise CanvasError("canvas_start.text_ids: needs at least one id (the style and text segments)")
        if text.min() < 0 or text.max() >= self.cfg.vocab_size:
            raise CanvasError(f"canvas_start.text_ids: ids must lie in [0, {self.cfg.vocab_size})")
        ref = spec.reference_codes
        ref = np.zeros((0, self.cfg.num_codebooks), np.int64) if ref is None else np.asarray(ref, dtype=np.int64)
        if ref.ndim != 2 or ref.shape[1] != self.cfg.num_codebooks:
            raise CanvasError(f"canvas_start.reference_codes: shape {list(ref.shape)}, needs "
                              f"[frames, {self.cfg.num_codebooks}]")
        if ref.size and (ref.min() < 0 or ref.max() >= self.cfg.audio_mask_id):
            raise CanvasError(f"canvas_start.reference_codes: codes must lie in [0, {self.cfg.audio_mask_id})")
        if spec.target_frames < 1:
            raise CanvasError(f"canvas_start.target_frames {spec.target_frames}: needs at least 1 frame")
        for f in fields(UnmaskKnobs):
            value = getattr(spec.knobs, f.name)
            if f.name in RANGES and not in_range(f.name, value):
                raise CanvasError(f"canvas_start.knobs.{f.name} = {value}: must lie in {range_text(f.name)}")
        rows = packed_rows(text.size + ref.shape[0], spec.target_frames, spec.knobs.guidance_scale)
        if rows > self.max_packed_rows:
            raise CanvasError(f"canvas_start: the canvas needs {rows} packed rows, over the worker's "
                              f"max_packed_rows {self.max_packed_rows}")
        c = self.cfg.num_codebooks
        ids = np.concatenate([np.broadcast_to(text, (c, text.size)), ref.T,
                              np.full((c, spec.target_frames), self.cfg.audio_mask_id, np.int64)], axis=1)
        mask = np.arange(ids.shape[1]) >= text.size
        counts = reveal_counts(spec.target_frames, spec.knobs.num_step, spec.knobs.t_shift, c)
        # Staged (staging.py): a plain copy would wait for the steps already queued on the stream.
        self.canvases[spec.request_id] = Canvas(spec, to_device(ids, self.device), to_device(mask, self.device), counts)

    def release(self, request_id: int) -> None:
        self._forget(self.canvases.pop(request_id, None))
        self.dropped.discard(request_id)

    def _forget(self, canvas: Canvas | None) -> None:
        """A canvas leaves: the tables that hold it go with it (they keep its tensors alive)."""
        if canvas is not None and self._packed is not None and any(c is canvas for c in self._packed.canvases):
            self._packed = None

    def drop(self, request_id: int) -> None:
        """A failed plan's canvas: released, and remembered until the scheduler releases it, so the
        plans it sent before it heard of the failure can skip its steps (`dropped`)."""
        self._forget(self.canvases.pop(request_id, None))
        self.dropped.add(request_id)

    def step(self, items: list[tuple[int, int]]) -> list[CanvasOutcome]:
        """launch + finish: one step, synchronously."""
        return self.finish(self.launch(items))

    def launch(self, items: list[tuple[int, int]]) -> PendingStep:
        """Queue step `step` of each listed (request_id, step) in one packed forward. Checked before
        anything changes: a bad list changes no canvas."""
        running = self._check(items)
        started = None
        if self.device.type == "cuda":
            started = torch.cuda.Event()
            started.record()
        # A step that reveals nothing (a tiny canvas) needs no logits: its documents stay out.
        scored = [(c, k) for c, k in running if c.counts[k] > 0]
        if scored:
            self._unmask(scored)
        for c, k in running:
            c.steps_done = k + 1
        finished = [c for c, _ in running if c.steps_done == c.spec.knobs.num_step]
        pending = PendingStep([(c.spec.request_id, k, c.steps_done == c.spec.knobs.num_step) for c, k in running],
                              [c.target for c in finished], started=started)
        if finished:  # one device-to-host copy for every canvas this step finishes
            codes = torch.cat([c.ids[:, -c.target:] for c in finished], dim=1).T.contiguous()
            pending.codes = self._to_host(codes)
            for c in finished:
                self._forget(self.canvases.pop(c.spec.request_id))
        if self.device.type == "cuda":  # the step is done (codes on the host) when this event is
            pending.done = torch.cuda.Event()
            pending.done.record()
        self.steps += 1
        return pending

    def finish(self, pending: PendingStep) -> list[CanvasOutcome]:
        """Wait for the step's codes; its outcomes in item order."""
        blocks = iter(())
        if pending.codes is not None:
            if pending.done is not None:
                pending.done.synchronize()
            blocks = iter(np.split(pending.codes.numpy(), np.cumsum(pending.frames)[:-1]))
        return [CanvasOutcome(rid, k, finished, next(blocks).copy() if finished else None)
                for rid, k, finished in pending.items]

    def _to_host(self, codes: Tensor) -> Tensor:
        """A host tensor the codes are queued to (pinned on CUDA: the copy does not wait)."""
        if self.device.type != "cuda":
            return codes
        host = torch.empty(codes.shape, dtype=codes.dtype, pin_memory=True)
        host.copy_(codes, non_blocking=True)
        return host

    def _check(self, items: list[tuple[int, int]]) -> list[tuple[Canvas, int]]:
        if len(items) > self.max_batch:
            raise CanvasError(f"canvas_step: {len(items)} canvases, over the worker's max_batch {self.max_batch}")
        if len({rid for rid, _ in items}) != len(items):
            raise CanvasError("canvas_step: a request is listed twice in one step")
        running = []
        for rid, k in items:
            c = self.canvases.get(rid)
            if c is None:
                raise CanvasError(f"canvas_step.request_id {rid}: no canvas is held for it (never started, "
                                  "released, or finished)")
            if k != c.steps_done:
                raise CanvasError(f"canvas_step.step {k} for request {rid}: its next step is {c.steps_done}")
            running.append((c, k))
        rows = sum(c.ids.shape[1] + (c.target if c.document.guided else 0) for c, _ in running)
        if rows > self.max_packed_rows:
            raise CanvasError(f"canvas_step: {rows} packed rows, over the worker's max_packed_rows "
                              f"{self.max_packed_rows}")
        return running

    def _packed_for(self, scored: list[tuple[Canvas, int]]) -> Packed:
        """The step's Packed: the previous step's while the same canvases step together."""
        p = self._packed
        if p is None or len(p.canvases) != len(scored) or any(a is not c for a, (c, _) in zip(p.canvases, scored)):
            p = self._packed = self._pack([c for c, _ in scored])
        return p

    def _pack(self, canvases: list[Canvas]) -> Packed:
        lay = layout([c.document for c in canvases])
        mask = []
        for c in canvases:
            mask.append(c.audio_mask)
            if c.document.guided:  # the uncond document: the canvas alone
                mask.append(c.audio_mask[-c.target:])
        batched = [i for i, c in enumerate(canvases) if self.batched_unmask and c.spec.knobs.class_temperature <= 0]
        tables = None
        if batched:
            tables = Tables.of([Item(canvases[i].ids[:, -canvases[i].target:], lay.cond_column[i], lay.uncond_column[i],
                                     canvases[i].spec.knobs, 0, None) for i in batched], self.cfg.num_codebooks,
                               self.device)
        self._packs += 1
        return Packed(self._packs, canvases, lay, to_device(lay.gather, self.device), torch.cat(mask), batched, tables)

    @torch.inference_mode()
    def _unmask(self, scored: list[tuple[Canvas, int]]) -> None:
        p = self._packed_for(scored)
        lay = p.layout
        ids = []
        for (c, _), ucol in zip(scored, lay.uncond_column):
            ids.append(c.ids)
            if ucol is not None:  # guided: the uncond document, the canvas alone
                ids.append(c.ids[:, -c.target:])
        logits = self._logits(torch.cat(ids, dim=1), p)
        batched = set(p.batched)
        for i, ((c, k), col, ucol) in enumerate(zip(scored, lay.cond_column, lay.uncond_column)):
            if i in batched:
                continue
            knobs = c.spec.knobs
            cond = logits[:, col:col + c.target].float()
            uncond = None if ucol is None else logits[:, ucol:ucol + c.target].float()
            noisy = knobs.position_temperature > 0 or knobs.class_temperature > 0
            generator = step_generator(c.spec.seed, k) if noisy else None
            c.ids[:, -c.target:] = unmask_step(c.ids[:, -c.target:], cond, uncond, knobs, c.counts[k],
                                               self.cfg.audio_mask_id, generator)
        if p.batched:
            items = []
            for i in p.batched:
                (c, k), knobs = scored[i], scored[i][0].spec.knobs
                generator = step_generator(c.spec.seed, k) if knobs.position_temperature > 0 else None
                items.append(Item(c.ids[:, -c.target:], lay.cond_column[i], lay.uncond_column[i], knobs, c.counts[k],
                                  generator))
            revealed = unmask_batch(logits, items, self.cfg.audio_mask_id, p.tables)
            for i, canvas in zip(p.batched, revealed):
                c = scored[i][0]
                c.ids[:, -c.target:] = canvas

    def _logits(self, ids: Tensor, p: Packed) -> Tensor:
        """Logits [C, n, V] at the layout's gathered rows (fp32, or the activations' dtype from a
        bucket): graphed when a graph holds the step."""
        lay = p.layout
        if self.bucketed is not None:
            h = self.bucketed.hidden(ids, p.mask, lay.positions.numpy(), lay.doc_lens, key=p.key)
            if h is not None:
                return self.model.head_logits(h, p.gather)
        return self.model(ids, p.mask, to_device(lay.positions, self.device), lay.doc_lens, p.gather, self.attention)

    def warm_up(self, capture: bool = True) -> float:
        """Run a step of a guided and an unguided canvas unpadded (Triton and flashinfer compile their
        kernels on first use, which must not land on a user's request), then capture every graph (capture:
        else each on first use) and run the step in its bucket; forget the canvases. Returns seconds."""
        t0 = time.perf_counter()
        bucketed, self.bucketed = self.bucketed, None
        ids = ((1 << 62), (1 << 62) + 1)[:min(2, self.max_batch)]
        text = np.arange(100, 120, dtype=np.int64)
        frames = max(1, min(50, (self.max_packed_rows - 2 * text.size) // 3))
        try:
            for in_buckets in (False, True):
                if in_buckets:
                    if bucketed is None:
                        break
                    self.bucketed = bucketed
                    if capture:
                        bucketed.capture_all()
                for i, guidance in zip(ids, (2.0, 0.0)):
                    self.start(CanvasSpec(i, text, None, frames, UnmaskKnobs(num_step=2, guidance_scale=guidance), 0))
                self.step([(i, 0) for i in ids])
                for i in ids:
                    self.release(i)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self.bucketed = bucketed
            for i in ids:
                self.release(i)
        self.steps = 0
        return time.perf_counter() - t0
