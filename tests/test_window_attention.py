"""vocoder_svc/window_attention.py: the ring-window attention, Triton kernel against the torch path.

The kernel runs on the CPU through the Triton interpreter (TRITON_INTERPRET=1), in float32, and is
compared with the torch path (chronological gather + dense masked SDPA), which is itself checked
against a dense reference over the stream's whole history. Kernel tests skip when triton is not
installed (CI); the torch-path ring tests always run. chorus/bench/vocoder_bench.py runs the kernel
compiled on a GPU (bf16, a realistic shape).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import triton_skip_reason  # noqa: E402

_SKIP_TRITON = triton_skip_reason()  # a missing triton skips only the kernel tests
import vocoder_svc.window_attention as WA  # noqa: E402

from vocoder_svc.codec import tiny_v2, window_mask  # noqa: E402
from vocoder_svc.codec_checkpoint import build_codec  # noqa: E402
from vocoder_svc.slot_decoder import SlotDecoder  # noqa: E402

needs_triton = pytest.mark.skipif(_SKIP_TRITON is not None, reason=_SKIP_TRITON or "")
F32, F64 = torch.float32, torch.float64
TOL = 2e-6  # fp32, O(1) outputs: online softmax vs SDPA differ by rounding only


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(gen, b, h, tk, d, w, offsets, rows=None, n_rows=None, dtype=F32, decoder_strides=True):
    """q, k, v [B, H, Tk, D] (as the slot decoder makes them: q/k contiguous, v a strided view of the fused
    projection), rings [R, H, W, D] full of random finite values, rows, offset."""
    if decoder_strides:
        qkv = torch.randn(b, tk, 3, h, d, generator=gen, dtype=dtype).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0].contiguous(), qkv[1].contiguous(), qkv[2]
    else:
        q, k, v = (torch.randn(b, h, tk, d, generator=gen, dtype=dtype) for _ in range(3))
    n_rows = n_rows or b + 3
    kc = torch.randn(n_rows, h, w, d, generator=gen, dtype=dtype)
    vc = torch.randn(n_rows, h, w, d, generator=gen, dtype=dtype)
    if rows is None:
        rows = torch.randperm(n_rows, generator=gen)[:b]
    return q, k, v, kc, vc, torch.as_tensor(rows, dtype=torch.long), torch.as_tensor(offsets, dtype=torch.long)


def _compare(q, k, v, kc, vc, rows, offset, w):
    kc0, vc0 = kc.clone(), vc.clone()
    ref = WA.window_attention(q, k, v, kc, vc, rows, offset, w, impl="torch")
    out = WA.window_attention(q, k, v, kc, vc, rows, offset, w, impl="triton")
    assert out.shape == ref.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)  # attention never writes the ring
    err = (out - ref).abs().max().item()
    assert err <= TOL, err
    return err


# ---- the kernel against the torch path -------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("tk", [1, 5, 8, 13, 40])  # W = 8: Tk < W, Tk = W, Tk > W, several query blocks
@pytest.mark.parametrize("offsets", [[0, 0], [3, 5], [8, 20], [0, 31]])  # fresh, partial, full/wrapped, mixed
def test_kernel_equals_torch(tk, offsets):
    gen = torch.Generator().manual_seed(1000 * tk + sum(offsets))
    _compare(*_inputs(gen, len(offsets), 2, tk, 16, 8, offsets), 8)


@needs_triton
def test_kernel_mixed_batch_and_rows():
    """Every regime in one batch: fresh, partially filled, exactly full, wrapped many times; rows out of
    order and with gaps (as slots and scratch rows are)."""
    gen = torch.Generator().manual_seed(7)
    offsets = [0, 1, 6, 10, 11, 137, 2000]
    rows = [9, 0, 4, 2, 7, 12, 5]
    _compare(*_inputs(gen, len(offsets), 2, 23, 16, 10, offsets, rows=rows, n_rows=13), 10)


@needs_triton
@pytest.mark.parametrize("w", [1, 2, 64, 70])  # tiny windows, a window of one key block, one past it
def test_kernel_window_sizes(w):
    gen = torch.Generator().manual_seed(w)
    _compare(*_inputs(gen, 3, 1, 70, 16, w, [0, w - 1 if w > 1 else 0, 3 * w + 5]), w)


@needs_triton
@pytest.mark.parametrize("d", [8, 24, 48, 7])  # below the tl.dot minimum, not a power of two, odd
def test_kernel_head_dims(d):
    gen = torch.Generator().manual_seed(d)
    _compare(*_inputs(gen, 2, 3, 9, d, 6, [0, 15]), 6)


@needs_triton
@pytest.mark.parametrize("dtype, rel", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_kernel_half_precision(dtype, rel):
    """bf16/fp16 inputs (the GPU dtypes) against the torch path in fp32 on the same rounded inputs. Under
    the interpreter the kernel's dots run in fp32 (its bf16 tl.dot is broken) and its fp32 -> bf16
    casts truncate instead of rounding, so bf16 is held to a few bf16 ulps only."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, kc, vc, rows, offset = _inputs(gen, 3, 2, 50, 64, 40, [0, 17, 300])
    args = [t.to(dtype) for t in (q, k, v, kc, vc)]
    out = WA.window_attention(*args, rows, offset, 40, impl="triton")
    ref = WA.window_attention(*(t.float() for t in args), rows, offset, 40, impl="torch")
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() <= rel * max(1.0, ref.abs().max().item())


@needs_triton
@pytest.mark.parametrize("config", [(16, 16, 4, 2), (32, 16, 4, 2), (16, 32, 4, 2)])
@pytest.mark.parametrize("tk, w", [(50, 40), (23, 64), (96, 24), (16, 17)])
def test_kernel_whole_and_edge_blocks(config, tk, w):
    """Key blocks smaller than the window, so a query block sees some ring and chunk blocks whole (the
    unmasked path) between masked edges, with Tk below, near and above W, from fresh streams to ones
    whose ring wrapped; every block size mix of BLOCK_M and BLOCK_N."""
    gen = torch.Generator().manual_seed(tk * 100 + w)
    offsets = [0, 5, w - 1, w, 3 * w + 7, 1000]
    q, k, v, kc, vc, rows, offset = _inputs(gen, len(offsets), 2, tk, 16, w, offsets)
    ref = WA.window_attention(q, k, v, kc, vc, rows, offset, w, impl="torch")
    out = WA.window_attention(q, k, v, kc, vc, rows, offset, w, impl="triton", config=config)
    assert (out - ref).abs().max().item() <= TOL


@needs_triton
def test_kernel_contiguous_inputs_and_output_layout():
    gen = torch.Generator().manual_seed(3)
    q, k, v, kc, vc, rows, offset = _inputs(gen, 2, 2, 9, 16, 6, [4, 9], decoder_strides=False)
    _compare(q, k, v, kc, vc, rows, offset, 6)
    out = WA.window_attention(q, k, v, kc, vc, rows, offset, 6, impl="triton")
    assert out.transpose(1, 2).is_contiguous()  # [B, Tk, H, D]: the slot decoder's reshape to [B, Tk, H*D] is a view


def test_impl_errors():
    gen = torch.Generator().manual_seed(4)
    args = _inputs(gen, 2, 2, 3, 16, 4, [0, 5], dtype=F64)
    with pytest.raises(ValueError, match="impl must be"):
        WA.window_attention(*args, 4, impl="cuda")
    assert WA.window_attention(*args, 4, impl="auto").dtype == F64  # CPU: the torch path
    if _SKIP_TRITON is None:
        with pytest.raises(ValueError, match="torch path"):  # fp64 is not a kernel dtype
            WA.window_attention(*args, 4, impl="triton")
        big = _inputs(gen, 1, 1, 2, WA.MAX_KERNEL_HEAD_DIM + 2, 4, [0])
        with pytest.raises(ValueError, match="torch path"):
            WA.window_attention(*big, 4, impl="triton")
        assert WA.kernel_selected(F32, torch.device("cpu"), 16, "triton")
    assert not WA.kernel_selected(F32, torch.device("cpu"), 16, "auto")
    assert not WA.kernel_selected(F64, torch.device("cpu"), 16, "auto")
    assert not WA.kernel_selected(F32, torch.device("cpu"), 16, "torch")


@needs_triton
@pytest.mark.parametrize("tk", [4, 9])  # shorter and longer than the window
def test_ring_write_kernel_equals_index_copy(tk):
    """The fused ring write reads k and a strided v (a view of a QKV buffer, as rope_qk returns it) and
    leaves both rings exactly as ring_write's two index_copy_ calls do."""
    gen = torch.Generator().manual_seed(tk)
    b, h, d, w = 3, 2, 16, 6
    k = torch.randn(b, h, tk, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(b, tk, 3, h, d, generator=gen).to(torch.bfloat16)[:, :, 2].transpose(1, 2)
    rows, offset = torch.tensor([4, 0, 2]), torch.tensor([0, 5, 12345])
    index = WA.ring_write_index(rows, offset, h, w, tk)
    caches = []
    for impl in ("torch", "triton"):
        kc = torch.randn(5, h, w, d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        vc = torch.randn(5, h, w, d, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        WA.ring_write_kv(kc, vc, k, v, rows, offset, index, impl=impl)
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


# ---- ring semantics: a stream through ring_write equals attention over its whole history ------------------

def _dense_reference(qs, ks, vs, w):
    """Attention of every position over the full history [H, N, D] with the codec's window mask."""
    pos = torch.arange(qs.shape[1])
    mask = window_mask(pos, pos, w)
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_ring_stream_equals_full_history(impl):
    """Two streams in rows 1 and 3 of a 5-row ring, stepped with different chunkings (Tk < W, = W, > W,
    wrapping many times); every chunk's output equals the dense attention over the whole history."""
    dtype, tol = (F64, 1e-12) if impl == "torch" else (F32, TOL)
    gen = torch.Generator().manual_seed(11)
    h, d, w, n = 2, 16, 7, 60
    qs, ks, vs = (torch.randn(2, h, n, d, generator=gen, dtype=dtype) for _ in range(3))
    ref = [_dense_reference(qs[s], ks[s], vs[s], w) for s in range(2)]
    kc = torch.full((5, h, w, d), 1e6, dtype=dtype)  # stale garbage: must never be read
    vc = torch.full((5, h, w, d), -1e6, dtype=dtype)
    rows = torch.tensor([1, 3])
    parts = [[1, 2, 7, 3, 9, 1, 14, 23], [7, 7, 1, 1, 20, 4, 10, 10]]  # both sum to 60; steps in lockstep
    assert [sum(p) for p in parts] == [n, n] and len(parts[0]) == len(parts[1])
    done = [0, 0]
    for p0, p1 in zip(*parts):
        for s, p in ((0, p0), (1, p1)):
            off = torch.tensor([done[s]])
            sl = slice(done[s], done[s] + p)
            args = (qs[s:s + 1, :, sl], ks[s:s + 1, :, sl], vs[s:s + 1, :, sl], kc, vc, rows[s:s + 1], off, w)
            out = WA.window_attention(*args, impl=impl)
            assert (out[0] - ref[s][:, sl]).abs().max().item() <= tol, (s, done[s], p)
            index = WA.ring_write_index(rows[s:s + 1], off, h, w, p)
            WA.ring_write_kv(kc, vc, args[1], args[2], rows[s:s + 1], off, index, impl=impl)
            done[s] += p
    # the rings hold exactly the last W positions of each stream, at position mod W; other rows untouched
    for s in range(2):
        for pos in range(n - w, n):
            assert torch.equal(kc[rows[s], :, pos % w], ks[s, :, pos])
            assert torch.equal(vc[rows[s], :, pos % w], vs[s, :, pos])
    assert (kc[[0, 2, 4]] == 1e6).all() and (vc[[0, 2, 4]] == -1e6).all()


def test_ring_batched_step_equals_per_row():
    """A batched step (mixed offsets, same Tk) equals the rows stepped one at a time (torch path; SDPA may
    block a batch differently, so up to rounding)."""
    gen = torch.Generator().manual_seed(12)
    q, k, v, kc, vc, rows, offset = _inputs(gen, 3, 2, 9, 16, 6, [0, 4, 33], dtype=F64)
    both = WA.window_attention(q, k, v, kc, vc, rows, offset, 6)
    for b in range(3):
        one = WA.window_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], kc, vc, rows[b:b + 1], offset[b:b + 1], 6)
        assert (both[b:b + 1] - one).abs().max().item() <= 1e-12
    index = WA.ring_write_index(rows, offset, 2, 6, 9)
    assert index.numel() == 3 * 2 * 6 and index.unique().numel() == index.numel()  # min(Tk, W) slots, no collisions


# ---- the slot decoder with the kernel ------------------------------------------------------------------------------

@needs_triton
def test_slot_decoder_triton_attention_equals_torch():
    """SlotDecoder on the tiny v2 codec (head dim 16, every window 4 tokens, Tk up to 32x the frames) with
    the kernel (interpreted) against the torch path: two streams, mixed chunk sizes, past every window."""
    codec = build_codec(tiny_v2(window=4), seed=1, dtype=F32)
    g = torch.Generator().manual_seed(13)
    codes = torch.randint(0, 1024, (12, 2, 6), generator=g)
    outs = {}
    for impl in ("torch", "triton"):
        s = SlotDecoder(codec, slots=2, n_q=12, attention=impl)
        a, b = s.acquire(), s.acquire()
        chunks, i = [], 0
        for p in (4, 2):
            r = s.step({a: codes[:, 0, i:i + p], b: codes[:, 1, i:i + p]})
            chunks.append(torch.stack([r[a], r[b]]))
            i += p
        outs[impl] = torch.cat(chunks, -1)
    ref = codec.decode(codes)
    scale = max(1.0, ref.abs().max().item())
    assert (outs["triton"] - outs["torch"]).abs().max().item() <= 1e-5 * scale
    assert (outs["triton"] - ref).abs().max().item() <= 1e-5 * scale
    assert math.isfinite(outs["triton"].abs().max().item())
