"""gpu_worker/omnivoice/attention_kernel.py against model.document_attention (the torch
reference), run on the CPU through the Triton interpreter (skipped where triton is not installed,
as in CI; on a GPU, python -m chorus.bench.omnivoice_gpu_check compares it with fp32 attention)."""

import numpy as np
import pytest
import torch

from helpers import triton_skip_reason

_SKIP = triton_skip_reason()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)

from gpu_worker.omnivoice import attention_kernel  # noqa: E402
from gpu_worker.omnivoice.model import document_attention  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _qkv(rows, heads=4, kv_heads=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g)  # one fused projection's output
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    return q.view(rows, heads, d), k.view(rows, kv_heads, d), v.view(rows, kv_heads, d)


def test_the_tile_table_covers_every_row_once_and_pads_with_empty_tiles():
    table = attention_kernel.tile_table([5, 1, 9], size=attention_kernel.max_tiles(15, 3, block_m=4), block_m=4)
    assert table.dtype == np.int32 and table.shape == (7, 3)
    assert table[:6].tolist() == [[0, 0, 5], [4, 0, 5], [5, 5, 6], [6, 6, 15], [10, 6, 15], [14, 6, 15]]
    assert (table[6:] == 0).all()
    with pytest.raises(ValueError, match="do not fit"):
        attention_kernel.tile_table([5, 1, 9], size=4, block_m=4)


@pytest.mark.parametrize("block_n", [4, 8])
def test_the_kernel_attends_inside_each_document_as_the_reference(block_n):
    """Documents shorter than, equal to and longer than a tile, grouped heads, q/k/v as strided
    views of one projection output, unused tiles at the table's end."""
    lens = [3, 8, 13, 1]
    rows = sum(lens)
    q, k, v = _qkv(rows)
    tiles = torch.from_numpy(attention_kernel.tile_table(lens, size=attention_kernel.max_tiles(rows, 4, 4) + 2,
                                                         block_m=4))
    got = attention_kernel.document_attention(q, k, v, tiles, block_m=4, block_n=block_n)
    want = document_attention(q, k, v, lens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_document_attends_the_same_alone_or_packed():
    lens = [6, 11, 5]
    q, k, v = _qkv(sum(lens), seed=3)
    packed = attention_kernel.document_attention(q, k, v, torch.from_numpy(attention_kernel.tile_table(lens, block_m=4)),
                                                 block_m=4, block_n=4)
    s = slice(6, 17)
    alone = attention_kernel.document_attention(q[s], k[s], v[s],
                                                torch.from_numpy(attention_kernel.tile_table([11], block_m=4)),
                                                block_m=4, block_n=4)
    assert torch.equal(packed[s], alone)


def test_heads_that_do_not_divide_are_refused():
    q, k, v = _qkv(4, heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="multiple of KV"):
        attention_kernel.document_attention(q, k, v, torch.from_numpy(attention_kernel.tile_table([4])))
