"""gpu_worker/decode_attention.py: the Triton paged decode kernel against its torch reference, through
the Triton interpreter on the CPU (fp32), and the reference against dense attention. Kernel tests skip
without triton (CI); benchmarks/decode_attention_bench.py runs it compiled on the GPU (bf16)."""

import math

import numpy as np
import pytest
import torch

from helpers import triton_skip_reason  # noqa: E402

_SKIP_TRITON = triton_skip_reason()
from gpu_worker import decode_attention as DA  # noqa: E402
from gpu_worker.attention import page_table  # noqa: E402

needs_triton = pytest.mark.skipif(_SKIP_TRITON is not None, reason=_SKIP_TRITON or "")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _case(seed, lens, page, hq=8, hkv=2, d=16, dtype=torch.float32):
    """q, caches and the page table of requests with these context lengths, their pages scattered."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-n // page) for n in lens) + 3
    k = torch.randn(n_pages * page, hkv, d, generator=gen, dtype=dtype)
    v = torch.randn(n_pages * page, hkv, d, generator=gen, dtype=dtype)
    order = torch.randperm(n_pages, generator=gen).numpy()
    slots, used = [], 0
    for n in lens:
        pages = order[used:used + -(-n // page)]
        used += len(pages)
        slots.append((pages[:, None] * page + np.arange(page)).reshape(-1)[:n])
    indptr = np.concatenate([[0], np.cumsum(lens)])
    table = [torch.from_numpy(a.astype(np.int32)) for a in page_table(indptr, np.concatenate(slots), page)]
    q = torch.randn(len(lens), hq, d, generator=gen, dtype=dtype)
    return q, k, v, table, slots


def test_reference_equals_dense_attention():
    q, k, v, table, slots = _case(0, [1, 7, 33], 4, dtype=torch.float64)
    out = DA.paged_decode_attention_torch(q, k, v, *table, 4)
    for b, s in enumerate(slots):
        kk = k[torch.from_numpy(s)].repeat_interleave(4, dim=1)
        vv = v[torch.from_numpy(s)].repeat_interleave(4, dim=1)
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[b], kk) / math.sqrt(16), dim=-1)
        assert torch.allclose(out[b], torch.einsum("hl,lhd->hd", w, vv), atol=1e-12)


@needs_triton
@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("config", [(16, 4, 2), (32, 4, 2)])
def test_kernel_equals_reference(page, config):
    """Contexts of one row, within one block, on block and page boundaries, and across many blocks."""
    q, k, v, table, _ = _case(page, [1, 5, 16, 17, 32, 70], page)
    ref = DA.paged_decode_attention_torch(q, k, v, *table, page)
    out = DA.paged_decode_attention(q, k, v, *table, page, impl="triton", config=config)
    assert (out - ref).abs().max().item() <= 2e-6


@needs_triton
def test_kernel_gqa_groups_and_out_buffer():
    """Group sizes 1 (MHA) and 8, and writing into a strided output buffer (a graph's static tensor)."""
    for hq, hkv in ((4, 4), (8, 1)):
        q, k, v, table, _ = _case(hq, [3, 40], 8, hq=hq, hkv=hkv)
        ref = DA.paged_decode_attention_torch(q, k, v, *table, 8)
        buf = torch.zeros(2, hq, 32)
        out = DA.paged_decode_attention(q, k, v, *table, 8, out=buf[:, :, :16], impl="triton", config=(16, 4, 2))
        assert out.data_ptr() == buf.data_ptr() and (buf[:, :, :16] - ref).abs().max().item() <= 2e-6
        assert torch.all(buf[:, :, 16:] == 0)


@needs_triton
def test_kernel_is_batch_invariant():
    """A request's output does not depend on the others in the batch (no split over the context)."""
    q, k, v, table, _ = _case(3, [9, 50, 21], 4)
    together = DA.paged_decode_attention(q, k, v, *table, 4, impl="triton", config=(16, 4, 2))
    indptr, indices, last = table
    alone = DA.paged_decode_attention(q[1:2], k, v, torch.tensor([0, int(indptr[2] - indptr[1])], dtype=torch.int32),
                                      indices[int(indptr[1]):int(indptr[2])], last[1:2], 4, impl="triton",
                                      config=(16, 4, 2))
    assert torch.equal(together[1:2], alone)


@needs_triton
def test_triton_decode_stages_a_table_and_attends():
    """attention.TritonDecode (the worker's decode kernel above 48 requests, in and out of CUDA graphs):
    a staged page table in its one buffer, then run() over the paged views flashinfer would get."""
    from gpu_worker.attention import TritonDecode

    page = 4
    q, k, v, table, _ = _case(11, [6, 13, 1], page)
    dec = TritonDecode(3, k.shape[0] // page, page, torch.device("cpu"))
    dec.stage(tuple(t.numpy() for t in table))
    paged = (k.view(-1, page, *k.shape[1:]), v.view(-1, page, *v.shape[1:]))
    out = dec.run(q, paged)
    assert (out - DA.paged_decode_attention_torch(q, k, v, *table, page)).abs().max().item() <= 2e-6
    with pytest.raises(ValueError, match="page table of 2 sequences"):
        dec.stage(tuple(t.numpy() for t in _case(12, [3, 4], page)[3]))


def test_triton_decode_threshold_is_a_graph_bucket_boundary():
    """A batch and its decode-graph bucket must pick the same kernel, so graphed frames equal eager ones."""
    from gpu_worker.attention import TRITON_DECODE_ABOVE
    from gpu_worker.cuda_graphs import BUCKETS

    assert TRITON_DECODE_ABOVE in BUCKETS


def test_kernel_supports_the_shapes_it_handles():
    """What FlashInferPagedAttention asks before choosing the kernel: MOSS-TTS's backbone (32 q heads,
    8 KV heads, head dim 128, bf16) yes; shapes whose fallback would sync inside a CUDA graph, no."""
    assert DA.kernel_supports(32, 8, 128, torch.bfloat16) == DA.HAVE_TRITON
    assert not DA.kernel_supports(32, 8, 80, torch.bfloat16)   # head dim not a power of two
    assert not DA.kernel_supports(30, 8, 128, torch.bfloat16)  # heads not a multiple of the KV heads
    assert not DA.kernel_supports(32, 8, 128, torch.float64)
