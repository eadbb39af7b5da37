"""gpu_worker/decode_attention.py: the Triton paged decode kernel against its torch reference, through
the Triton interpreter on the CPU (fp32), and the reference against dense attention. Kernel tests skip
without triton (CI); chorus/bench/decode_attention_bench.py runs it compiled on the GPU (bf16)."""

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


def _rows_case(seed, page):
    """Three decodes whose queries sit at rows 5, 2, 7 of a 9-row q, and a fourth table entry without pages."""
    q, k, v, table, _ = _case(seed, [6, 13, 1], page)
    gen = torch.Generator().manual_seed(seed + 100)
    big = torch.randn(9, *q.shape[1:], generator=gen)
    rows = torch.tensor([5, 2, 7], dtype=torch.int32)
    big[rows.long()] = q
    indptr, indices, last = table
    padded = (torch.cat([indptr, indptr[-1:]]), indices, torch.cat([last, torch.zeros(1, dtype=torch.int32)]))
    return q, k, v, table, big, torch.cat([rows, torch.zeros(1, dtype=torch.int32)]), padded


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_rows_put_each_request_at_its_row_and_skip_empty_entries(impl):
    """rows=: request b reads q[rows[b]] and writes out[rows[b]] (a folded step's decodes, after its
    prefill rows); an entry without pages (past the step's decodes in a graph) writes nothing."""
    page = 4
    q, k, v, table, big, rows, padded = _rows_case(21, page)
    ref = DA.paged_decode_attention_torch(q, k, v, *table, page)
    out = torch.full_like(big, 7.0)
    got = DA.paged_decode_attention(big, k, v, *padded, page, rows=rows, out=out, impl=impl, config=(16, 4, 2))
    assert got.data_ptr() == out.data_ptr()
    assert (out[rows[:3].long()] - ref).abs().max().item() <= 2e-6
    untouched = [i for i in range(9) if i not in (5, 2, 7)]
    assert torch.all(out[untouched] == 7.0)  # row 0 too: the empty entry's row


def test_triton_decode_rows_mode_stages_fewer_requests():
    """TritonDecode(rows=True), a folded prefill graph's decode part: up to `batch` decodes, each at its
    own row, the entries past them empty."""
    from gpu_worker.attention import TritonDecode

    page = 4
    q, k, v, table, big, rows, _ = _rows_case(22, page)
    dec = TritonDecode(5, k.shape[0] // page, page, torch.device("cpu"), rows=True)
    dec.stage(tuple(t.numpy() for t in table), rows[:3].numpy())
    paged = (k.view(-1, page, *k.shape[1:]), v.view(-1, page, *v.shape[1:]))
    out = dec.run(big, paged, out=torch.zeros_like(big))
    assert (out[rows[:3].long()] - DA.paged_decode_attention_torch(q, k, v, *table, page)).abs().max() <= 2e-6
    assert torch.all(out[[0, 1, 3, 4, 6, 8]] == 0)
    with pytest.raises(ValueError, match="folded decode of up to 5"):
        dec.stage(tuple(t.numpy() for t in _case(12, [3] * 6, page)[3]), np.arange(6))


class _ReferencePrefill:
    """flashinfer's batch-prefill wrapper as the torch reference: plan() takes the CSR a plan would,
    run() attends the rows the plan covers (into out if given), leaving the others of a graph's q."""

    def __init__(self, kv):
        self.kv = kv

    def plan(self, qo_indptr, page_indptr, pages, last_len, *args, **kwargs):
        from gpu_worker.attention import AttentionBatch

        p = self.kv.page_size
        lens = [(int(page_indptr[i + 1] - page_indptr[i]) - 1) * p + int(last_len[i]) for i in range(len(last_len))]
        kv_indptr = np.concatenate([[0], np.cumsum(lens)])
        slots = np.concatenate([
            (pages[page_indptr[i]:page_indptr[i + 1]].numpy()[:, None] * p + np.arange(p)).reshape(-1)[:n]
            for i, n in enumerate(lens)])
        self.batch = AttentionBatch(positions=None, write_slots=None, qo_indptr=qo_indptr,
                                    kv_indptr=torch.from_numpy(kv_indptr.astype(np.int32)),
                                    kv_indices=torch.from_numpy(slots.astype(np.int32)))
        self.kv.reference.begin(self.batch)

    def run(self, q, pages, out=None):
        n = int(self.batch.qo_indptr[-1])
        result = torch.zeros_like(q) if out is None else out
        result[:n] = self.kv.reference.attend(0, q[:n], self.batch)
        return result


def _mixed_backend(page):
    """FlashInferPagedAttention's host side on the CPU, with _ReferencePrefill for flashinfer."""
    from gpu_worker.attention import FlashInferPagedAttention, TorchPagedAttention

    kv = FlashInferPagedAttention.__new__(FlashInferPagedAttention)
    TorchPagedAttention.__init__(kv, 1, 64 * page, 2, 16, torch.float32, torch.device("cpu"), page)
    kv.reference = TorchPagedAttention.__new__(TorchPagedAttention)
    kv.reference.k_cache, kv.reference.v_cache, kv.reference.scale = kv.k_cache, kv.v_cache, kv.scale
    kv.reference.page_size = page
    kv.num_qo_heads, kv.num_kv_heads, kv.head_dim = 8, 2, 16
    kv.folds_decodes, kv.decode_kernel, kv._plan_copied = True, "auto", {}
    kv.prefill_wrapper = _ReferencePrefill(kv)
    kv._page_tensors = lambda pages: tuple(torch.from_numpy(a) for a in pages)
    kv._plan = lambda wrapper, *args, **kwargs: wrapper.plan(*args, **kwargs)  # no CUDA event to wait on
    return kv


def test_mixed_step_attends_its_decodes_with_the_decode_kernel():
    """A mixed step (prefill chunks, then one-row decodes) on the flashinfer backend: its prefill
    sequences (a one-row chunk too) go to the batch-prefill plan, its decodes to the Triton decode kernel
    at their rows; together they equal the reference over the whole step, eagerly and as a graph's
    wrapper (flashinfer then gets all of q, its plan covering fewer rows)."""
    from gpu_worker.attention import AttentionBatch, PrefillWithDecodes, SequenceSpan, TorchPagedAttention

    page = 4
    kv = _mixed_backend(page)
    gen = torch.Generator().manual_seed(5)
    kv.k_cache.normal_(generator=gen)
    kv.v_cache.normal_(generator=gen)
    spans = [SequenceSpan(np.arange(0, 9), 5), SequenceSpan(np.arange(12, 13), 1),  # a 1-row chunk, then
             SequenceSpan(np.arange(16, 30), 3),                                      # a prefill chunk
             SequenceSpan(np.arange(32, 39), 1), SequenceSpan(np.arange(40, 41), 1)]  # and two decodes
    batch = AttentionBatch.build(spans, torch.device("cpu"), decodes=2)
    q = torch.randn(11, 8, 16, generator=gen)
    want = TorchPagedAttention.attend(_torch_begin(kv, batch), 0, q, batch)
    kv.begin(batch)
    assert isinstance(kv.active, PrefillWithDecodes) and kv.active.decode.batch == 2
    assert kv.active.prefill_rows == 9 and int(kv.prefill_wrapper.batch.qo_indptr[-1]) == 9
    assert (kv.attend(0, q, batch) - want).abs().max().item() <= 2e-6
    # the graph's wrapper: room for 4 decodes; flashinfer's (here the reference's) run gets all of q
    from gpu_worker.attention import TritonDecode
    graphed = PrefillWithDecodes(kv.prefill_wrapper, TritonDecode(4, 64, page, torch.device("cpu"), rows=True),
                                 graphed=True)
    kv.plan_prefill(graphed, batch)
    kv.active = graphed
    assert (kv.attend(0, q, batch) - want).abs().max().item() <= 2e-6
    with pytest.raises(ValueError, match="PrefillWithDecodes"):
        kv.plan_prefill(kv.prefill_wrapper, batch)


def _torch_begin(kv, batch):
    kv.reference.begin(batch)
    return kv.reference
