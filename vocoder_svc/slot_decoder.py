"""SlotDecoder: slot-based batched streaming decode for the MOSS-Audio-Tokenizer
codec, with CUDA graphs per (batch bucket, frames) on GPU.

Many streams are decoded together in one batched step. The slot decoder owns all
streaming state in preallocated device buffers, so every tensor a step
touches has a shape fixed by (bucket, T) and the step can be captured once in
a CUDA graph and replayed with new inputs. On CPU (and for any (bucket, T)
without a graph) the very same step function runs eagerly.

Math: exactly the codec's (vocoder_svc/codec.py, spec §3, §4), reusing its
weights and its RoPE helper (attention: vocoder_svc/window_attention.py):

    quantizer gather-sum (fp32) -> per Transformer stage: in_proj, layers
    (pre-norm LN, fused QKV, interleaved-pair RoPE at absolute positions,
    windowed causal attention over cache + chunk, LayerScale residuals,
    erf-GELU FFN), out_proj -> patch up -> ... -> de-interleave.

State (§4.1), per row (a row is a slot or a scratch row):

* ``frames[row]``: code frames this stream has consumed. Every stage's token
  offset is ``frames * tokens_per_frame(stage)``, so one counter is the whole
  position state.
* per stage and layer, ``k[l], v[l]``: ``[rows, H, W, D]``, a ring of the
  rotated keys and the values of the last W tokens: position p of the stage
  lives at ring index ``p mod W``. Positions are implied by the offset: the
  ring holds positions ``[offset - W, offset)`` (those >= 0 exist; a negative
  one means "empty"). A step reads only positions in
  ``[max(0, offset + i - W + 1), offset + i]`` for its query i, so nothing
  below 0 or at/after the offset is ever read from the ring and a fresh or
  released stream is just ``frames = 0``: nothing is cleared (buffers start
  zeroed and only finite K/V are written, so even the masked entries the
  torch path gathers stay finite).

  Why a ring and not the chronological cache of spec §4.1/§4.2 (which keeps
  the last W entries in order and shifts them every step): the shift rewrote
  the whole [rows, H, W, D] cache of every participant in every layer of every
  step, and the dense [B, 1, Tk, W+Tk] mask it went with is 100+ MB per layer
  at the 400 Hz stage. With the ring a step writes only its own last
  min(Tk, W) tokens, and the Triton kernel needs neither a gather, a
  concatenation nor a mask. This is not the spec's pitfall "v1 ring" (§4.3):
  that one writes the chunk into a W-ring before attending and so loses keys;
  here the chunk attends over ring + chunk first and is written afterwards,
  which is exactly cache + chunk (keys are still visited in chronological
  order). Attention is vocoder_svc/window_attention.py: the Triton kernel on
  CUDA (fp16/bf16/fp32), the torch path elsewhere (gather the ring into
  chronological order, then the same masked SDPA as before: CPU results are
  bit-identical to the shifted cache).

One step for a bucket of B rows and T frames (all shapes static):

    rows   = [slot ids of the participants..., scratch rows for padding]
    f      = where(valid, frames[rows], 0)            # padding = fresh stream
    off    = f*m; pos_q = off + [0, T*m)               # the chunk's positions
    write  = ring index (pos mod W) of the chunk's last min(T*m, W) tokens, per row/head   # once per stage
    per layer: o = window_attention(q, k_new, v_new, k[l], v[l], rows, off, W)
                 # kernel: query P reads positions [max(0, P-W+1), P] from
                 #   k[l][rows, :, p mod W] (p < off) or k_new[:, :, p - off] (p >= off)
                 # torch:  kc = cat(k[l] gathered at (off + [0, W)) mod W, k_new); SDPA(q, kc, vc, mask)
                 #   with mask = codec.window_mask(pos[W:], pos, W), pos = off + [-W, T*m), once per stage
               k[l][rows, :, write] = k_new[:, :, -min(T*m, W):]   # index_copy_ after the read, same for v
    frames[rows] = f + T

Padding rows read and write only scratch rows (one per padding position, so
writes never collide; there are as many scratch rows as the largest bucket,
which graph warm-up needs, so KV memory is 2 x slots when slots is the largest
bucket), hence they never change a slot's state, and their
inputs (codes 0, fresh positions) never depend on anything else. Every op is
row-wise, so a stream's result depends only on its own codes and state and
on the step's shapes (bucket, T): decoded alone or next to others in the same
bucket it is bit-identical. (Across different buckets the GEMM shapes differ,
and a GPU may then pick other kernels: expect ~1e-6 in fp32, and far more in
bf16: bucket 1 vs bucket 4 differed by up to 0.125 (max abs) on an H200 with
the random-weight full preset. A slot decoder with a single bucket, ``buckets=
[slots]``, is bucket-invariant by construction, at the price of always
computing the full bucket; ``step(bucket=...)`` times that.)

Precision: ``compute_dtype`` bf16/fp16 follows the reference's autocast
policy (§3.7) without autocast's per-step weight casts: GEMM weights are cast
once, GEMMs, the KV cache and attention run in bf16 (attention keeps its
softmax and accumulation in fp32, kernel or SDPA), while the quantizer (fp32),
LayerNorm, RoPE and the residual stream stay in fp32. With compute dtype
equal to the codec dtype (fp32/fp64) the slot decoder uses the codec's own tensors
and its result equals ``codec.decode`` up to rounding.

Glue (vocoder_svc/slot_kernels.py, ``glue=``): the elementwise work between
the GEMMs runs as fused Triton kernels on CUDA: LN1 + cast, RoPE of q and k
straight from the fused QKV output, and each LayerScale residual add together
with the LayerNorm after it (LN2, or the next layer's LN1), so the layer loop
carries ``(y, a)``: the residual stream and its normalised copy. The torch
path is the same math op for op (CPU results are unchanged); the kernels equal
it bitwise except LayerNorm's mean/variance rounding (at most a bf16 ulp of
its output). On CUDA they are self-tested against the torch path when the
slot decoder is built (``glue_impl`` says which path runs).

The weights' layout is slot_plan.py, the CUDA graphs slot_graphs.py, launching a step and
reading its PCM back slot_pcm.py.

Calls are serialised by a lock, so a server may call from several threads
(all on the same CUDA stream). Results are returned as fresh tensors, never
views of graph memory.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from vocoder_svc import slot_kernels as sk
from vocoder_svc import window_attention as wa
from vocoder_svc.codec import LN_EPS, MossAudioTokenizer
from vocoder_svc.slot_graphs import GraphCapture, StepGraph
from vocoder_svc.slot_pcm import STAGING_BUFFERS, PcmLaunch
from vocoder_svc.slot_plan import Stage, build_weights

HALF = (torch.bfloat16, torch.float16)
# Positions go through fp32 for RoPE (§3.3), exact only below 2**24.
MAX_POSITION = 1 << 24

# Above this many streams the buckets grow by BUCKET_STEP instead of doubling: a step costs
# its bucket, and under load (c256 end to end) the ready streams rarely fill a power of two,
# so doubling paid for up to twice the streams a step had. 8: at c256 with 5-frame chunks steps
# held ~49 streams, padded to 64 (benchmarks/README.md).
BUCKET_STEP = 8


def default_buckets(slots: int) -> tuple[int, ...]:
    """1, 2, 4, ... BUCKET_STEP, then every BUCKET_STEP streams, up to `slots`, plus `slots` itself."""
    out, b = [], 1
    while b < min(slots, BUCKET_STEP):
        out.append(b)
        b *= 2
    b = BUCKET_STEP
    while b < slots:
        out.append(b)
        b += BUCKET_STEP
    out.append(slots)
    return tuple(out)


class SlotDecoder(GraphCapture, PcmLaunch):
    """Slot-based batched streaming decoder (see the module docstring).

    codec: a MossAudioTokenizer (its weights are shared, not copied, unless
        compute_dtype differs from the codec's dtype).
    slots: concurrent streams.
    n_q: codebooks per frame (fixed for the slot decoder; 12 for MOSS-TTS Local).
    compute_dtype: None = the codec's dtype; torch.bfloat16 for the fast GPU path.
    buckets: allowed batch sizes (default 1, 2, 4, ..., slots); the largest must be >= slots.
    graphs: True / False / None (= on for CUDA devices), or "emulate": run the
        graph bookkeeping (static buffers, scratch-row warm-up) with an eager
        "replay"; for CPU tests of that path.
    graph_frames: the T values that get graphs (lazily on first use); default 1..25.
    attention: window attention implementation (vocoder_svc/window_attention.py): "auto" (the Triton
        kernel on CUDA for fp16/bf16/fp32, else torch), "triton" or "torch".
    glue: the layers' elementwise glue (vocoder_svc/slot_kernels.py: LayerNorm + cast, LayerScale
        residual + the next LayerNorm, RoPE of q/k): "auto" (fused Triton kernels on CUDA for
        fp16/bf16/fp32 compute, after a self-test against the torch path at construction; a failure
        logs a warning and keeps the torch path), "triton" (the kernels; a failed self-test raises) or
        "torch". ``glue_impl`` says which runs; ``glue_fallback`` why "auto" fell back, if it did.
    """

    def __init__(self, codec: MossAudioTokenizer, slots: int = 16, n_q: int | None = None,
                 compute_dtype: torch.dtype | None = None, buckets: Iterable[int] | None = None,
                 graphs: bool | str | None = None, graph_frames: Iterable[int] | None = None,
                 warmup: int = 2, attention: str = "auto", glue: str = "auto", priority_frames: Iterable[int] = ()):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.codec = codec
        self.config = codec.config
        self.device = codec.device
        self.slots = slots
        self.n_q = codec.num_codebooks if n_q is None else int(n_q)
        if not 1 <= self.n_q <= codec.num_codebooks:
            raise ValueError(f"n_q must be in 1..{codec.num_codebooks}, got {self.n_q}")
        codec_dtype = codec.dtype
        self.compute_dtype = codec_dtype if compute_dtype is None else compute_dtype
        # Residual stream / norms / output: fp32 under a half compute dtype (autocast policy), else the same.
        self.residual_dtype = torch.float32 if self.compute_dtype in HALF else self.compute_dtype
        self.buckets = tuple(sorted(set(default_buckets(slots) if buckets is None else (int(b) for b in buckets))))
        if not self.buckets or self.buckets[0] < 1 or self.buckets[-1] < slots:
            raise ValueError(f"buckets {self.buckets} must be positive and reach slots={slots}")
        self.scratch = self.buckets[-1]  # scratch rows [slots, slots + scratch): padding and warm-up
        self.rows = slots + self.scratch
        if graphs is None:
            graphs = self.device.type == "cuda"
        if graphs is True and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device (use graphs='emulate' to test the path on CPU)")
        self.graph_mode: str | None = "emulate" if graphs == "emulate" else ("cuda" if graphs else None)
        self.graph_frames = frozenset(range(1, 26) if graph_frames is None else (int(t) for t in graph_frames))
        self.warmup = warmup
        if attention not in ("auto", "triton", "torch"):
            raise ValueError(f"attention must be 'auto', 'triton' or 'torch', got {attention!r}")
        self.attention_impl = attention
        if glue not in ("auto", "triton", "torch"):
            raise ValueError(f"glue must be 'auto', 'triton' or 'torch', got {glue!r}")
        self.glue = glue
        self.graphs_disabled: str | None = None
        # Steps of these sizes replay their graphs on a high-priority CUDA stream, from a memory pool of
        # their own (graphs of one pool must never run concurrently), so a new stream's first chunk does
        # not queue behind a steady step already on the device. Their rows are never a running step's:
        # per-slot events order each slot's steps across the two streams (_wait_for_slots).
        self.priority_frames = frozenset(int(t) for t in priority_frames) if self.graph_mode else frozenset()
        self.last_step_priority = False
        self._priority_pool = None
        self._priority_stream = None
        self._copy_stream = None  # launch_pcm's device-to-host copies
        self._slot_events: dict[int, tuple[object, object]] = {}  # slot -> (stream, event after its last step)
        self.last_step_graphed = False
        self._graphs: dict[tuple[int, int], StepGraph] = {}
        self._pool = None
        self._keep: list[object] = []  # the CUDAGraph objects behind the replay methods
        self._capture_streams: dict[bool, object] = {}  # priority? -> the stream its graphs are captured on
        self._lock = threading.RLock()
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._active: set[int] = set()
        self._frames_host = [0] * slots
        # launch_pcm's pinned host buffers: one per step whose PCM is not yet read back
        self._staging: list[Tensor | None] = [None] * STAGING_BUFFERS
        self._staging_free = list(range(STAGING_BUFFERS))
        self._staging_cond = threading.Condition()
        with torch.inference_mode():
            self._build()
            # Before any step or graph capture: on CUDA the fused kernels are self-tested here first.
            shapes = [(st.d_model, st.heads, st.head_dim) for kind, st in self._plan if kind == "stage"]
            self.glue_impl, self.glue_fallback = sk.select_impl(glue, self.device, self.compute_dtype, shapes)
        # Which attention implementation the steps take (the kernel needs CUDA, the dtype and head dims).
        stages = [st for kind, st in self._plan if kind == "stage"]
        self.attention_path = ("triton" if stages and all(
            wa.kernel_selected(self.compute_dtype, self.device, st.head_dim, attention) for st in stages) else "torch")
        # What the step passes as impl=: on CUDA "auto" (the kernels for the inputs they support, which are
        # all of the slot decoder's; torch for anything else), on CPU "triton" (the interpreter, tests only).
        self._glue_call = ("torch" if self.glue_impl == "torch" else
                           "auto" if self.device.type == "cuda" else "triton")

    # ---- construction -------------------------------------------------------------
    def _build(self) -> None:
        w = build_weights(self.codec, self.n_q, self.rows, self.compute_dtype, self.residual_dtype)
        self._table, self._q_offsets, self._q_out_w, self._q_out_b = w.table, w.q_offsets, w.q_out_w, w.q_out_b
        self._plan, self._max_mult = w.plan, w.max_mult
        self._frames = torch.zeros(self.rows, dtype=torch.long, device=self.device)

    # ---- facts ------------------------------------------------------------------------
    @property
    def hop(self) -> int:
        return self.config.hop

    @property
    def channels(self) -> int:
        return self.config.channels

    def state_nbytes(self) -> int:
        """Bytes of KV state (slots and scratch rows)."""
        return sum(t.numel() * t.element_size() for kind, st in self._plan if kind == "stage"
                   for t in (*st.k, *st.v)) + self._frames.numel() * 8

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} streams exceed the largest bucket {self.buckets[-1]}")

    @property
    def max_stream_frames(self) -> int:
        """Frames one stream may decode in total: its positions must stay exact in fp32 (see step)."""
        return MAX_POSITION // self._max_mult

    def frames_decoded(self, slot: int) -> int:
        self._check_slot(slot)
        return self._frames_host[slot]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)

    # ---- slots --------------------------------------------------------------------------
    def acquire(self) -> int:
        """A free slot holding a fresh stream. RuntimeError when all are taken."""
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {self.slots} slots are in use")
            slot = self._free.pop()
            self._reset(slot)
            self._active.add(slot)
            return slot

    def release(self, slot: int) -> None:
        """Free a slot; the next stream to get it starts fresh."""
        with self._lock:
            self._check_slot(slot)
            self._reset(slot)
            self._active.discard(slot)
            self._free.append(slot)

    def reset(self, slot: int) -> None:
        """Restart the stream in `slot` (e.g. a new segment after a pad frame)."""
        with self._lock:
            self._check_slot(slot)
            self._reset(slot)

    def _reset(self, slot: int) -> None:
        # The next step reads this slot's frames as 0 (valid=False): no ring position is below the
        # offset any more, so nothing is read (module docstring).
        self._frames_host[slot] = 0

    def _check_slot(self, slot: int) -> None:
        if slot not in self._active:
            raise ValueError(f"slot {slot} is not acquired")

    # ---- the step function (eager on CPU, captured on CUDA) -----------------------------------
    def _forward(self, codes: Tensor, rows: Tensor, valid: Tensor) -> Tensor:
        """codes [n_q, B, T] long, rows [B] long (distinct), valid [B] bool -> pcm [B, C, T*hop].

        Reads and advances the state of `rows`; invalid rows start from a fresh
        state and must be scratch rows. No host syncs, no data-dependent shapes."""
        cd, rd = self.compute_dtype, self.residual_dtype
        n_q, bsz, t = codes.shape
        frames = torch.where(valid, self._frames.index_select(0, rows), 0)  # [B]
        # Quantizer (§3.2): gather-sum of the folded table, then the output projection, in fp32.
        z = F.embedding(codes + self._q_offsets, self._table).sum(dim=0)  # [B, T, rvq]
        x = z if self._q_out_w is None else F.linear(z, self._q_out_w, self._q_out_b)  # [B, T, 768] token-major
        for kind, item in self._plan:
            if kind == "patch":
                # §3.4 in token-major layout: [B, L, C*h] -> [B, L*h, C], out[t*h+j, c] = in[t, c*h+j].
                h = item
                b, length, ch = x.shape
                x = x.reshape(b, length, ch // h, h).transpose(2, 3).reshape(b, length * h, ch // h)
                continue
            st: Stage = item
            tk, w, hd, nh, d = t * st.mult, st.window, st.head_dim, st.heads, st.d_model
            offset = frames * st.mult  # [B]
            pos_q = offset.unsqueeze(1) + torch.arange(tk, device=codes.device)  # [B, Tk] absolute positions
            # Ring slots of the chunk's last min(Tk, W) tokens, and (torch path only) the chronological
            # gather index and the additive window mask: once per stage, shared by its layers.
            if wa.kernel_selected(cd, codes.device, hd, self.attention_impl):
                write = gather = mask = None  # the kernels compute ring slots from offset themselves
            else:
                write = wa.ring_write_index(rows, offset, nh, w, tk)
                gather = wa.ring_gather_index(rows, offset, nh, w)
                mask = wa.additive_window_mask(offset, w, tk, cd)  # [B, 1, Tk, W+Tk]
            angle = pos_q.to(torch.float32).unsqueeze(-1) * st.freq  # §3.3 fp32 recipe
            cos, sin = torch.cos(angle).unsqueeze(1), torch.sin(angle).unsqueeze(1)  # [B, 1, Tk, D/2]
            y = x.to(rd) if st.w_in is None else F.linear(x.to(cd), st.w_in).to(rd)  # [B, Tk, d]
            # The residual stream y is carried with the next pre-norm's output: each LayerScale residual
            # add is fused with the LayerNorm after it (slot_kernels; the torch path is the plain
            # `y = y + s*o; a = LN(y).to(cd)`), the last one of the stage is a plain scaled add.
            glue = self._glue_call
            nl = len(st.layers)
            if nl:
                a = sk.layer_norm_cast(y, st.layers[0].ln1_w, st.layers[0].ln1_b, LN_EPS, cd, impl=glue)
            for li, lay in enumerate(st.layers):
                # q, k rotated (interleaved-pair RoPE, fp32 math), v: [B, H, Tk, D]
                q, k, v = sk.rope_qk(F.linear(a, lay.wqkv), cos, sin, nh, hd, impl=glue)
                o = wa.window_attention(q, k, v, st.k[li], st.v[li], rows, offset, w, impl=self.attention_impl,
                                        mask=mask, index=gather)  # [B, H, Tk, D]
                # after the read: it overwrites keys this chunk still needed
                wa.ring_write_kv(st.k[li], st.v[li], k, v, rows, offset, write, impl=self.attention_impl)
                o = F.linear(o.transpose(1, 2).reshape(bsz, tk, d), lay.wo)
                y, f = sk.scaled_add_layer_norm(y, o, lay.s1, lay.ln2_w, lay.ln2_b, LN_EPS, cd, impl=glue)
                f = F.linear(F.gelu(F.linear(f, lay.w1), approximate="none"), lay.w2)
                if li + 1 < nl:
                    nxt = st.layers[li + 1]
                    y, a = sk.scaled_add_layer_norm(y, f, lay.s2, nxt.ln1_w, nxt.ln1_b, LN_EPS, cd, impl=glue)
                else:
                    y = sk.scaled_add(y, f, lay.s2, impl=glue)
            x = y if st.w_out is None else F.linear(y.to(cd), st.w_out)
        self._frames.index_copy_(0, rows, frames + t)
        # §3.5: [B, C*M, 1] interleaved -> [B, C, M]
        c = self.config.internal_channels
        n = x.shape[1] * x.shape[2]
        return x.to(rd).reshape(bsz, n // c, c).transpose(1, 2).contiguous()

    def _run(self, codes: Tensor, rows: Tensor, valid: Tensor) -> Tensor:
        """_forward under the attention-backend policy (used for eager steps, warm-up and capture)."""
        with self._attention_backends():
            return self._forward(codes, rows, valid)

    def _attention_backends(self):
        # On CUDA keep SDPA on kernels known to be capturable and deterministic in the forward pass
        # (the additive mask rules out flash; memory-efficient takes it; fp64 falls back to math).
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    # ---- stepping -------------------------------------------------------------------------------
    def step(self, codes: Mapping[int, Tensor], to_cpu: bool = False, eager: bool = False,
             bucket: int | None = None) -> dict[int, Tensor]:
        """Decode T new frames for each slot: {slot: codes [n_q, T]} -> {slot: pcm [C, T*hop]}.

        Every participant must have the same T (> 0). The batch is padded to a
        bucket with scratch rows. to_cpu: return CPU tensors (one device-to-host
        copy); otherwise device tensors that do not alias graph memory.
        eager: skip graphs for this step (tests, parity checks).
        bucket: pad to the smallest bucket holding max(len(codes), bucket) rows
        instead of len(codes) (e.g. to time one stream at the largest bucket)."""
        if not codes:
            return {}
        with self._lock, torch.inference_mode():
            slots, out, stream = self._decode(codes, eager, bucket)
            out = out.to("cpu", copy=True) if to_cpu else out.clone()  # never a view of graph memory
            self._after_step(slots, stream)
            return {s: out[i] for i, s in enumerate(slots)}

    def _decode(self, codes: Mapping[int, Tensor], eager: bool, bucket: int | None,
                allow_priority: bool = False) -> tuple[list[int], Tensor, object]:
        """One step on the device (call under the lock): the slots in order, pcm [n, C, T*hop] (which
        may alias graph memory until the next step) and the CUDA stream it ran on (None off CUDA);
        read the pcm on that stream."""
        slots = list(codes)
        for s in slots:
            self._check_slot(s)
        batch = self._batch_codes([codes[s] for s in slots])  # [n_q, n, T] long (on its own device)
        n, t = len(slots), batch.shape[2]
        if t == 0:
            raise ValueError("a step needs at least one frame")
        for s in slots:
            if (self._frames_host[s] + t) * self._max_mult > MAX_POSITION:
                raise ValueError(f"slot {s}: stream longer than the {MAX_POSITION // self._max_mult} frames "
                                 f"whose positions are exact in fp32")
        bucket = self.bucket_for(max(n, bucket or 0))
        pad = bucket - n
        if pad:
            batch = torch.cat((batch, batch.new_zeros(self.n_q, pad, t)), dim=1)
        rows = torch.tensor(slots + list(range(self.slots, self.slots + pad)), dtype=torch.long)
        # valid = the row continues a stream: a fresh stream (and a padding row) reads frames as 0, so
        # acquire and release need no device write (one that could race a step on the other stream).
        valid = torch.tensor([self._frames_host[s] > 0 for s in slots] + [False] * pad)
        gr = None if eager else self._graph_for(bucket, t)
        priority = gr is not None and allow_priority and t in self.priority_frames
        stream = self._stream(priority)
        out = None
        with self._on(stream):
            if stream is not None:
                self._wait_for_slots(slots, stream)
            if gr is not None:
                try:
                    # Non-blocking from the host: a blocking copy waits for every kernel already queued
                    # on the stream, i.e. for the step launched ahead, so this launch then waited for
                    # the previous step to finish (58% of the H200 slot decoder thread at c256) and the GPU
                    # idled while the host launched the next. The host tensors are this step's own.
                    gr.codes.copy_(batch, non_blocking=True)
                    gr.rows.copy_(rows, non_blocking=True)
                    gr.valid.copy_(valid, non_blocking=True)
                    gr.replay()
                    out = gr.out
                except Exception as e:  # noqa: BLE001
                    # A failed replay may have run partly; nothing is committed host-side, but device
                    # state of these rows is unknown, so the step fails and graphs are switched off.
                    self.graphs_disabled = f"replay of (bucket {bucket}, T {t}) failed: {e!r}"
                    self._graphs.clear()
                    self._keep.clear()
                    raise
            if out is None:
                dev = self.device
                out = self._run(batch.to(dev), rows.to(dev), valid.to(dev))
        self.last_step_graphed, self.last_step_priority = out is not None and gr is not None, priority
        for s in slots:
            self._frames_host[s] += t
        return slots, out[:n], stream

    def _batch_codes(self, items: list[Tensor]) -> Tensor:
        shapes = {tuple(c.shape) for c in items}
        if len(shapes) != 1:
            raise ValueError(f"all streams in a step need the same codes shape [n_q, T]; got {sorted(shapes)}")
        shape = shapes.pop()
        if len(shape) != 2 or shape[0] != self.n_q:
            raise ValueError(f"codes must be [n_q={self.n_q}, T], got {list(shape)}")
        for c in items:
            if c.dtype.is_floating_point or c.dtype == torch.bool:
                raise ValueError(f"codes must be integers, got {c.dtype}")
        batch = torch.stack([c.to(items[0].device, torch.long) for c in items], dim=1)
        if batch.numel():
            lo, hi = int(batch.min()), int(batch.max())
            if lo < 0 or hi >= self.config.quantizer.codebook_size:
                raise ValueError(f"codes must lie in [0, {self.config.quantizer.codebook_size}); got [{lo}, {hi}]")
        return batch

    # ---- whole-utterance helper ---------------------------------------------------------------------
    def decode_stream(self, codes: Tensor, parts: Iterable[int],
                      step: Callable[[Mapping[int, Tensor]], dict[int, Tensor]] | None = None) -> Tensor:
        """Decode codes [n_q, T] on a fresh slot in chunks `parts` (summing to T); returns [C, T*hop]."""
        step = step or self.step
        slot = self.acquire()
        try:
            outs, i = [], 0
            for p in parts:
                outs.append(step({slot: codes[:, i:i + p]})[slot])
                i += p
            if i != codes.shape[1]:
                raise ValueError(f"parts sum to {i}, codes have {codes.shape[1]} frames")
            return torch.cat(outs, dim=-1)
        finally:
            self.release(slot)
