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

CUDA graphs: one per (bucket, T), captured lazily on first use (for T in
``graph_frames``) or up front with ``capture()``, largest first, into one
shared memory pool. Warm-up and capture run on scratch rows only, so
capturing while streams are live is safe (the warm-up also compiles the
attention and glue kernels for the shape before capture). Replay copies codes, row ids and
the valid mask into the graph's static input buffers. A (bucket, T) without a
graph runs eagerly with the same bucket (same GEMM shapes). A capture or
replay failure disables graphs for the slot decoder (``graphs_disabled`` says
why). Frames are never padded: padding would advance the causal state.

Calls are serialised by a lock, so a server may call from several threads
(all on the same CUDA stream). Results are returned as fresh tensors, never
views of graph memory.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from vocoder_svc import slot_kernels as sk
from vocoder_svc import window_attention as wa
from vocoder_svc.codec import LN_EPS, LayerScale, MossAudioTokenizer, PatchedPretransform, ProjectedTransformer

HALF = (torch.bfloat16, torch.float16)
# Positions go through fp32 for RoPE (§3.3), exact only below 2**24.
MAX_POSITION = 1 << 24
# Steps launch_pcm may have launched whose PCM is not read yet (each holds a pinned buffer).
STAGING_BUFFERS = 2


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


def rope_freq(head_dim: int, max_period: float, device: torch.device) -> Tensor:
    """freq[i] of §3.3, computed exactly as codec.rope_cos_sin does (same ops, same device)."""
    c = -2.0 * math.log(max_period) / head_dim
    i = torch.arange(head_dim // 2, dtype=torch.float32, device=device)
    return torch.exp(i * torch.tensor(c, dtype=torch.float32, device=device))


@dataclass
class _Layer:
    ln1_w: Tensor
    ln1_b: Tensor
    wqkv: Tensor
    wo: Tensor
    s1: Tensor | None
    ln2_w: Tensor
    ln2_b: Tensor
    w1: Tensor
    w2: Tensor
    s2: Tensor | None


@dataclass
class _Stage:
    """One decoder Transformer stage: weights, window and its per-row KV buffers."""

    index: int  # decoder module index
    mult: int  # tokens of this stage per code frame
    window: int
    heads: int
    head_dim: int
    d_model: int
    w_in: Tensor | None
    w_out: Tensor | None
    layers: list[_Layer]
    freq: Tensor  # [D/2] fp32
    k: list[Tensor]  # per layer [rows, H, W, D]
    v: list[Tensor]


@dataclass
class _Graph:
    """A captured (bucket, T) step and its static inputs/output."""

    replay: Callable[[], None]  # CUDAGraph.replay, or an eager re-run in emulation mode
    codes: Tensor  # [n_q, B, T] long
    rows: Tensor  # [B] long
    valid: Tensor  # [B] bool
    out: Tensor  # [B, C, T*hop]


class SlotDecoder:
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
        self._graphs: dict[tuple[int, int], _Graph] = {}
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
        codec, dev, cd, rd = self.codec, self.device, self.compute_dtype, self.residual_dtype

        def gemm(w: Tensor | None) -> Tensor | None:
            return None if w is None else w.detach().to(device=dev, dtype=cd)

        def vec(w: Tensor) -> Tensor:
            return w.detach().to(device=dev, dtype=rd)

        q = codec.quantizer
        k = self.config.quantizer.codebook_size
        # The folded decode table of §3.2 for the first n_q codebooks: row i*K + c = Out_i(codebook_i[c]),
        # computed with the codec's own 1x1 convolution weights (fp32; fp64 for fp64 codecs).
        rows = []
        for lfq in list(q.quantizers)[: self.n_q]:
            cb = lfq.codebook.weight.detach()
            rows.append(cb if lfq.out_proj is None else
                        F.conv1d(cb.t().unsqueeze(0), lfq.out_proj.weight, lfq.out_proj.bias)[0].t())
        self._table = torch.cat(rows, dim=0).contiguous()  # [n_q*K, rvq]
        self._q_offsets = (torch.arange(self.n_q, device=dev) * k).view(self.n_q, 1, 1)
        if q.output_proj is None:
            self._q_out_w = self._q_out_b = None
        else:
            self._q_out_w = q.output_proj.weight[:, :, 0]
            self._q_out_b = q.output_proj.bias
        self._plan: list[tuple[str, object]] = []  # ("patch", h) or ("stage", _Stage)
        mult = 1
        for i, m in enumerate(codec.decoder):
            if isinstance(m, PatchedPretransform):
                self._plan.append(("patch", m.patch_size))
                mult *= m.patch_size
                continue
            assert isinstance(m, ProjectedTransformer)
            s = m.cfg
            layers = []
            for layer in m.transformer.layers:
                attn = layer.self_attn
                wqkv = attn.in_proj.weight if hasattr(attn, "in_proj") else attn.in_projs[0].weight
                wo = attn.out_proj.weight if hasattr(attn, "out_proj") else attn.out_projs[0].weight
                if hasattr(layer, "ffn"):
                    w1, w2 = layer.ffn[0].weight, layer.ffn[2].weight
                else:
                    w1, w2 = layer.linear1.weight, layer.linear2.weight
                s1 = vec(layer.layer_scale_1.scale) if isinstance(layer.layer_scale_1, LayerScale) else None
                s2 = vec(layer.layer_scale_2.scale) if isinstance(layer.layer_scale_2, LayerScale) else None
                layers.append(_Layer(vec(layer.norm1.weight), vec(layer.norm1.bias), gemm(wqkv), gemm(wo), s1,
                                     vec(layer.norm2.weight), vec(layer.norm2.bias), gemm(w1), gemm(w2), s2))
            shape = (self.rows, s.num_heads, m.window, s.head_dim)
            stage = _Stage(index=i, mult=mult, window=m.window, heads=s.num_heads, head_dim=s.head_dim,
                           d_model=s.d_model,
                           w_in=gemm(None if m.input_proj is None else m.input_proj.weight),
                           w_out=gemm(None if m.output_proj is None else m.output_proj.weight),
                           layers=layers, freq=rope_freq(s.head_dim, s.max_period, dev),
                           k=[torch.zeros(shape, dtype=cd, device=dev) for _ in layers],
                           v=[torch.zeros(shape, dtype=cd, device=dev) for _ in layers])
            self._plan.append(("stage", stage))
        self._max_mult = mult
        self._frames = torch.zeros(self.rows, dtype=torch.long, device=dev)

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
                raise RuntimeError(f"all {self.slots} slot decoder slots are in use")
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
            st: _Stage = item
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

    # ---- graphs ---------------------------------------------------------------------------------
    def _static_inputs(self, bucket: int, t: int) -> tuple[Tensor, Tensor, Tensor]:
        dev = self.device
        codes = torch.zeros(self.n_q, bucket, t, dtype=torch.long, device=dev)
        rows = torch.arange(self.slots, self.slots + bucket, dtype=torch.long, device=dev)  # scratch rows
        valid = torch.zeros(bucket, dtype=torch.bool, device=dev)
        return codes, rows, valid

    def _capture(self, bucket: int, t: int) -> _Graph:
        codes, rows, valid = self._static_inputs(bucket, t)
        if self.graph_mode == "emulate":
            for _ in range(self.warmup):  # the same scratch-row warm-up the CUDA path does
                self._run(codes, rows, valid)
            out = self._run(codes, rows, valid)

            def replay(gr_out: Tensor = out) -> None:
                gr_out.copy_(self._run(codes, rows, valid))

            return _Graph(replay, codes, rows, valid, out)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):  # scratch rows only: live slots are untouched
                self._run(codes, rows, valid)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if t in self.priority_frames:
            if self._priority_pool is None:
                self._priority_pool = torch.cuda.graph_pool_handle()
            pool = self._priority_pool
        else:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            pool = self._pool
        # Captured on a stream of the slot decoder's own, one for priority graphs and one for the rest: a
        # graph bakes in the cuBLAS workspace of the stream it was captured on, and torch.cuda.graph's
        # default capture stream is one per process. Graphs that replay concurrently (a priority first
        # chunk beside a steady step; a decoder hosted in the worker's process beside the worker's
        # graphs) must not share a workspace: on an H200 the hosted decoder and the worker hung the
        # GPU at c16 with their graphs captured on the default stream.
        priority = t in self.priority_frames
        if priority not in self._capture_streams:
            self._capture_streams[priority] = torch.cuda.Stream(device=self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self._capture_streams[priority],
                              capture_error_mode="thread_local"):
            out = self._run(codes, rows, valid)
        self._keep.append(graph)
        return _Graph(graph.replay, codes, rows, valid, out)

    def capture(self, buckets: Iterable[int] | None = None, frames: Iterable[int] | None = None) -> int:
        """Capture graphs for every (bucket, T) given (default: all buckets x graph_frames), largest
        first so the shared pool is sized once. Returns how many are captured now in total."""
        if self.graph_mode is None or self.graphs_disabled:
            return 0
        buckets = self.buckets if buckets is None else tuple(self.bucket_for(int(b)) for b in buckets)
        frames = sorted(self.graph_frames) if frames is None else [int(t) for t in frames]
        with self._lock, torch.inference_mode():
            for b, t in sorted({(b, t) for b in buckets for t in frames}, key=lambda bt: (-bt[0] * bt[1], -bt[0])):
                if (b, t) not in self._graphs:
                    try:
                        self._graphs[(b, t)] = self._capture(b, t)
                    except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager
                        self.graphs_disabled = f"capture of (bucket {b}, T {t}) failed: {e!r}"
                        self._graphs.clear()
                        self._keep.clear()
                        return 0
        return len(self._graphs)

    def _graph_for(self, bucket: int, t: int) -> _Graph | None:
        if self.graph_mode is None or self.graphs_disabled:
            return None
        if (bucket, t) not in self._graphs and t in self.graph_frames:
            self.capture([bucket], [t])  # lazily, on first use
        return self._graphs.get((bucket, t))

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

    def step_pcm(self, codes: Mapping[int, Tensor], int16: Iterable[int] = (), eager: bool = False,
                 bucket: int | None = None) -> dict[int, bytes]:
        """As `step`, but each stream's audio comes back as the wire's interleaved little-endian PCM
        bytes ([T*hop, C]): int16 for the slots in `int16` (chorus.audio.encode_pcm16's values: scale
        by 32767 in fp32, clip, round half to even), float32 for the others."""
        return self.launch_pcm(codes, int16, eager, bucket).result()

    def launch_pcm(self, codes: Mapping[int, Tensor], int16: Iterable[int] = (), eager: bool = False,
                   bucket: int | None = None) -> PendingPcm:
        """step_pcm without waiting for the device: the step, the PCM conversion and the copy to a
        pinned host buffer are queued, and `result()` of the returned handle waits and gives the
        bytes. The next step can be launched first, so the device never idles while the host turns
        one step's PCM into bytes (a 64-stream, 25-frame step's PCM16 is ~25 MB). At most
        STAGING_BUFFERS steps are unread: a further launch waits for the oldest result().

        The conversion runs on the device and the copy goes through a pinned host buffer: a
        64-stream step's float32 audio is ~50 MB, which a pageable copy moved at a few GB/s."""
        want16 = set(int16)
        with self._lock, torch.inference_mode():
            if not codes:
                return PendingPcm(self, [], [], None, None)
            slots, out, stream = self._decode(codes, eager, bucket, allow_priority=True)
            groups = [(torch.int16, [i for i, s in enumerate(slots) if s in want16]),
                      (torch.float32, [i for i, s in enumerate(slots) if s not in want16])]
            with self._on(stream):  # the conversion reads the pcm on the step's stream
                converted = []
                for dtype, idx in groups:
                    if not idx:
                        continue
                    x = out if len(idx) == len(slots) else out[torch.as_tensor(idx, device=out.device)]
                    if dtype == torch.int16:
                        # [n, T*hop, C], interleaved; "auto": the torch path for layouts the kernel skips
                        x = sk.pcm16(x, impl="auto" if self.glue_impl == "triton" else "torch")
                    else:
                        x = x.to(torch.float32).transpose(1, 2).contiguous()
                    converted.append((idx, x))  # contiguous: one plain memcpy to the host
            # The copy to the host runs on a stream of its own, so the next step's kernels (launched
            # ahead) overlap it instead of queueing behind it: a 64 x 25 step's PCM16 is ~25 MB.
            copy_stream = self._copy_stream_after(stream)
            buf = self._staging_acquire(sum(x.numel() * x.element_size() for _, x in converted))
            try:
                with self._on(copy_stream):
                    staged, offset = [], 0
                    for idx, x in converted:
                        nbytes = x.numel() * x.element_size()
                        host = self._staging[buf][offset:offset + nbytes].view(x.dtype).view(x.shape)
                        host.copy_(x, non_blocking=True)
                        if copy_stream is not None:
                            x.record_stream(copy_stream)  # not reused by the step stream before the copy ends
                        staged.append((idx, host))
                        offset += nbytes
                    done = None
                    if copy_stream is not None:
                        # A blocking-sync event: the finisher thread sleeps until the copy is done instead
                        # of spinning a core through the whole (tens of ms) step, as a default event's
                        # wait does. It follows the step too (the copy stream waited for it).
                        done = torch.cuda.Event(blocking=True)
                        done.record(copy_stream)
            except BaseException:
                self._staging_release(buf)  # a lost buffer would block every later launch
                raise
            self._after_step(slots, stream, done)
            return PendingPcm(self, slots, staged, done, buf)

    def _copy_stream_after(self, stream):
        """The stream that copies PCM to the host (None off CUDA), ordered after `stream`'s work."""
        if stream is None:
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copy_stream.wait_stream(stream)
        return self._copy_stream

    def _staging_acquire(self, nbytes: int) -> int:
        """(Under the lock.) A free pinned staging buffer of at least nbytes; waits while every one
        holds a step whose result() has not been read."""
        with self._staging_cond:
            while not self._staging_free:
                self._staging_cond.wait()
            buf = self._staging_free.pop()
            have = self._staging[buf]
            if have is None or have.numel() < nbytes:
                size = max(nbytes, 2 * (0 if have is None else have.numel()))
                self._staging[buf] = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            return buf

    def _staging_release(self, buf: int) -> None:
        with self._staging_cond:
            self._staging_free.append(buf)
            self._staging_cond.notify()

    def uses_priority_stream(self, t: int) -> bool:
        """Do steps of t frames run on the high-priority stream (see priority_frames)?"""
        return t in self.priority_frames and self.graph_mode is not None and not self.graphs_disabled

    def _stream(self, priority: bool):
        """The CUDA stream a step runs on (None off CUDA): the current one, or the high-priority one."""
        if self.device.type != "cuda":
            return None
        if not priority:
            return torch.cuda.current_stream(self.device)
        if self._priority_stream is None:
            # Lower is higher; out-of-range values map to the device's highest priority.
            self._priority_stream = torch.cuda.Stream(self.device, priority=-100)
        return self._priority_stream

    @staticmethod
    def _on(stream):
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def _wait_for_slots(self, slots: list[int], stream) -> None:
        """Order this step after the last step of each of its slots that ran on the other stream
        (a first chunk on the priority stream, then the stream's next step on the current one; or a
        slot's previous owner, cancelled while its last step still ran)."""
        if not self.priority_frames:
            return  # one stream: its steps run in order
        for s in slots:
            last = self._slot_events.get(s)
            if last is not None and last[0] != stream:
                stream.wait_event(last[1])

    def _after_step(self, slots: list[int], stream, event=None) -> None:
        """Remember each slot's last step (its stream, an event after it) for _wait_for_slots;
        only needed when steps run on two streams."""
        if stream is not None and self.priority_frames:
            if event is None:
                event = torch.cuda.Event()
                event.record(stream)
            for s in slots:
                self._slot_events[s] = (stream, event)

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


class PendingPcm:
    """A launched step_pcm (SlotDecoder.launch_pcm): result() waits for the device and returns
    {slot: PCM bytes}, once; the staging buffer goes back to the slot decoder then."""

    def __init__(self, slot_decoder: SlotDecoder, slots: list[int], staged: list[tuple[list[int], Tensor]],
                 done: torch.cuda.Event | None, buf: int | None):
        self._slot_decoder, self.slots, self._staged, self._done, self._buf = slot_decoder, slots, staged, done, buf
        self._read = False

    def wait_device(self) -> None:
        """Block until the step's device work (and its copy to the host buffer) is done."""
        if self._done is not None:
            self._done.synchronize()

    def running(self) -> bool:
        """Is the step's device work (or its copy to the host) still going? (False off CUDA.)"""
        return self._done is not None and not self._done.query()

    def result(self) -> dict[int, bytes]:
        if self._read:
            raise RuntimeError("PendingPcm.result() called twice")
        self._read = True
        try:
            if self._done is not None:
                self._done.synchronize()
            out: dict[int, bytes] = {}
            for idx, host in self._staged:
                for j, i in enumerate(idx):
                    out[self.slots[i]] = host[j].numpy().tobytes()
            return out
        finally:
            if self._buf is not None:
                self._slot_decoder._staging_release(self._buf)
                self._buf = None
