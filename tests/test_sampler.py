"""Seeded sampler: spec moss_tts_local.md §4.1/§4.3 and the §7.4–7.7 vectors."""

import math
import struct
import time

import mmh3
import numpy as np
import pytest
import torch

from gpu_worker.sampler import (
    apply_repetition_penalty,
    derive_sampling_seed,
    first_argmax,
    gumbel_noise,
    murmur3_hash,
    sample,
    top_p_keep_sorted,
)

SEED_1234 = 626674338

# §7.4: (seed, position, j, h, g)
HASH_TABLE = [
    (0, 0, 0, 0x8134CDF8, 0.3801375633297289),
    (626674338, 0, 0, 0x3851D247, -0.41484403575370576),
    (626674338, 0, 1, 0x4FCCA9BE, -0.15328800210147392),
    (626674338, 1, 0, 0x07FAEE39, -1.2436398462434068),
    (626674338, 13, 5, 0x95AFE563, 0.6224457463565491),
    (626674338, 12, 1023, 0x562CEC63, -0.08506858496330151),
]


def _t(vals, dtype=torch.int64):
    return torch.tensor(vals, dtype=dtype)


def _mmh3_ref(seed: int, position: int, j: int) -> int:
    key = struct.pack("<IIII", seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, position & 0xFFFFFFFF, j)
    return mmh3.hash(key, 0, signed=False)


def _run(logits, temperature=1.0, top_k=0, top_p=1.0, seed=SEED_1234, position=0):
    logits = torch.as_tensor(logits)
    B = logits.shape[0]
    full = lambda x, dt: x if torch.is_tensor(x) else torch.full((B,), x, dtype=dt)  # noqa: E731
    return sample(logits, full(temperature, logits.dtype if logits.dtype.is_floating_point else torch.float32),
                  full(top_k, torch.int64), full(top_p, torch.float64 if logits.dtype == torch.float64 else torch.float32),
                  full(seed, torch.int64), full(position, torch.int64))


# ---- §7.4 hash / gumbel ---------------------------------------------------------
def test_hash_and_gumbel_table():
    seeds = _t([r[0] for r in HASH_TABLE])
    pos = _t([r[1] for r in HASH_TABLE])
    h = murmur3_hash(seeds, pos, 1024)
    g = gumbel_noise(seeds, pos, 1024)
    assert h.dtype == torch.int64 and h.shape == (6, 1024)
    assert g.dtype == torch.float64
    for i, (s, p, j, hh, gg) in enumerate(HASH_TABLE):
        assert int(h[i, j]) == hh
        assert _mmh3_ref(s, p, j) == hh
        assert float(g[i, j]) == gg  # bit-exact


def test_hash_matches_mmh3_package_random_keys():
    rng = np.random.default_rng(0)
    seeds = [int(x) for x in rng.integers(0, 2**31, 20)] + [2**40 + 7, 0x7FFFFFFF]
    positions = [int(x) for x in rng.integers(0, 2**32, 22)]
    positions[0] = 2**32 + 5  # taken mod 2^32
    h = murmur3_hash(_t(seeds), _t(positions), 1024)
    assert int(h.min()) >= 0 and int(h.max()) <= 0xFFFFFFFF
    for i, (s, p) in enumerate(zip(seeds, positions)):
        for j in (0, 1, 2, 511, 1023):
            assert int(h[i, j]) == _mmh3_ref(s, p, j), (s, p, j)
    assert torch.equal(murmur3_hash(_t([9]), _t([2**32 + 5]), 8), murmur3_hash(_t([9]), _t([5]), 8))


def test_gumbel_clamp_extremes():
    # u = 0 -> ln u = -inf, clamped to -DBL_MAX; u = 1 -> ln u = 0, clamped to -2^-32
    lo = -math.log(1.7976931348623157e308)
    hi = -math.log(2.0 ** -32)
    u = torch.tensor([0.0, 1.0], dtype=torch.float64)
    L = torch.log(u).clamp(min=-1.7976931348623157e308, max=-(2.0 ** -32))
    assert torch.equal(-torch.log(-L), torch.tensor([lo, hi], dtype=torch.float64))
    g = gumbel_noise(_t([1, 2, 3]), _t([0, 1, 2]), 1024)
    assert torch.isfinite(g).all() and float(g.min()) >= lo and float(g.max()) <= hi


# ---- §7.5 seed derivation ---------------------------------------------------------
def test_seed_derivation():
    assert derive_sampling_seed(1234) == 626674338
    assert derive_sampling_seed(0) == 808733807
    assert derive_sampling_seed(42) == 987912953
    r = derive_sampling_seed(None)
    assert 0 <= r <= 0x7FFFFFFF
    with pytest.raises(ValueError):
        derive_sampling_seed(-1)


# ---- §7.6 seeded draws ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_seeded_draw_stop_head(dtype):
    logits = torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=dtype)
    out = _run(logits, temperature=1.0, top_k=50, top_p=1.0, seed=SEED_1234, position=0)
    assert out.dtype == torch.int64
    assert out.tolist() == [1, 0]
    g = gumbel_noise(_t([SEED_1234]), _t([0]), 2)[0]
    assert abs(float(g[0]) - -0.41484) < 1e-5 and abs(float(g[1]) - -0.15329) < 1e-5
    assert abs(1.0 + float(g[0]) - 0.58516) < 1e-5


# ---- §7.7 top-p ---------------------------------------------------------------------
@pytest.mark.parametrize("p,kept", [(0.75, 3), (0.7, 2), (0.5, 2), (0.4, 1), (1e-9, 1)])
def test_top_p_rule_exact(p, kept):
    probs = torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64)
    keep = top_p_keep_sorted(probs, torch.tensor([p], dtype=torch.float64))
    assert keep[0].tolist() == [True] * kept + [False] * (3 - kept)


@pytest.mark.parametrize("p,support", [(0.75, {0, 1, 2}), (0.7, {0, 1}), (0.5, {0, 1}), (0.4, {0}), (1.0, {0, 1, 2})])
def test_top_p_end_to_end_support(p, support):
    # float64 logits whose softmax is exactly [0.5, 0.25, 0.25]; the tie between
    # columns 1 and 2 is broken by the stable sort (lower index first).
    logits = torch.tensor([[math.log(2.0), 0.0, 0.0]], dtype=torch.float64)
    assert torch.softmax(logits, -1)[0].tolist() == [0.5, 0.25, 0.25]
    n = 600
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 1
    out = sample(logits.expand(n, 3), torch.ones(n, dtype=torch.float64), torch.zeros(n, dtype=torch.int64),
                 torch.full((n,), p, dtype=torch.float64), seeds, torch.arange(n, dtype=torch.int64))
    assert set(out.tolist()) == support


# ---- greedy, top-k, NaN, fallbacks ----------------------------------------------------
def test_greedy_ties_lowest_index_and_ignores_filters():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 7.0, 7.0]])
    for t in (0.0, -1.0):
        out = _run(logits, temperature=t, top_k=1, top_p=0.1, seed=123, position=4)
        assert out.tolist() == [1, 0, 2]


def test_top_k_ties_with_kth_survive():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.5]])
    n = 800
    out = _run(logits.expand(n, 6), top_k=2, seed=torch.arange(n) * 31 + 5, position=torch.arange(n))
    assert set(out.tolist()) == {0, 1, 2, 3}
    # k = 1 with a tie at the top: both tied tokens survive
    out = _run(torch.tensor([[2.0, 5.0, 5.0, 1.0]]).expand(n, 4), top_k=1, seed=torch.arange(n) * 13 + 1,
               position=torch.arange(n))
    assert set(out.tolist()) == {1, 2}


@pytest.mark.parametrize("k", [0, -1, 6, 50])
def test_top_k_inactive_values(k):
    logits = torch.tensor([[0.3, -0.2, 0.1, 0.0, -1.0, 0.2]]).expand(64, 6)
    seeds, pos = torch.arange(64) + 100, torch.arange(64) * 3
    assert torch.equal(_run(logits, top_k=k, seed=seeds, position=pos),
                       _run(logits, top_k=0, seed=seeds, position=pos))


def test_nan_and_all_neg_inf():
    ninf = float("-inf")
    logits = torch.tensor([
        [0.0, 1.0, float("nan"), 2.0, float("nan")],
        [ninf, ninf, ninf, ninf, ninf],
        [ninf, ninf, 0.0, ninf, ninf],
    ])
    assert _run(logits, top_k=2, top_p=0.9).tolist() == [2, 0, 2]
    assert _run(logits, temperature=0.0).tolist() == [2, 0, 2]
    v = torch.tensor([[1.0, float("nan"), 3.0], [1.0, 3.0, 3.0]])
    assert first_argmax(v).tolist() == [1, 1]


def test_temperature_scaling_is_used():
    # v = s + g with s = z / T: a huge T flattens the logits, a tiny T makes it greedy-like
    z = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    g = gumbel_noise(_t([SEED_1234]), _t([0]), 2)[0]
    for T in (0.01, 0.5, 1.0, 3.0, 100.0):
        expect = int(torch.argmax(z[0] / T + g))
        assert _run(z, temperature=T).tolist() == [expect]


# ---- repetition penalty ---------------------------------------------------------------
def test_repetition_penalty():
    logits = torch.tensor([[2.0, -2.0, 0.0, -0.0, 1.5], [2.0, -2.0, 0.0, -0.0, float("nan")]])
    presence = torch.tensor([[True, True, True, True, False], [True, True, True, True, True]])
    out = apply_repetition_penalty(logits, presence, torch.tensor([2.0, 1.0]))
    assert out[0].tolist() == [1.0, -4.0, 0.0, 0.0, 1.5]
    # penalty 1.0: bit-for-bit unchanged (signed zero and NaN payload included)
    assert torch.equal(out[1].view(torch.int32), logits[1].view(torch.int32))
    # all-False presence leaves everything untouched at any penalty
    same = apply_repetition_penalty(logits, torch.zeros_like(presence), torch.tensor([3.0, 0.5]))
    assert torch.equal(same.view(torch.int32), logits.view(torch.int32))
    assert apply_repetition_penalty(logits.double(), presence, torch.tensor([2.0, 1.0])).dtype == torch.float64


# ---- batch invariance ----------------------------------------------------------------
def _random_batch(B, V, dtype, gen):
    logits = (torch.randn(B, V, generator=gen, dtype=torch.float64) * 3).to(dtype)
    temperature = torch.where(torch.rand(B, generator=gen) < 0.2, 0.0,
                              torch.rand(B, generator=gen) * 2 + 0.1).to(torch.float64 if dtype == torch.float64
                                                                          else torch.float32)
    top_k = torch.randint(-1, V + 2, (B,), generator=gen)
    top_p = torch.where(torch.rand(B, generator=gen) < 0.3, 1.0, torch.rand(B, generator=gen)).to(temperature.dtype)
    seed = torch.randint(0, 2**31, (B,), generator=gen)
    position = torch.randint(0, 13 * 4096, (B,), generator=gen)
    return logits, temperature, top_k, top_p, seed, position


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_batch_invariance(dtype):
    gen = torch.Generator().manual_seed(7)
    B, V = 48, 1024
    args = _random_batch(B, V, dtype, gen)
    full = sample(*args)
    single = torch.cat([sample(*(a[i:i + 1] for a in args)) for i in range(B)])
    assert torch.equal(full, single)
    perm = torch.randperm(B, generator=gen)
    assert torch.equal(sample(*(a[perm] for a in args)), full[perm])
    # other rows' contents do not matter
    other = list(args)
    other[0] = args[0].clone()
    other[0][1::2] = torch.randn(B // 2, V, generator=gen).to(dtype)
    assert torch.equal(sample(*other)[0::2], full[0::2])


def test_speed_b256_v1024():
    gen = torch.Generator().manual_seed(1)
    args = _random_batch(256, 1024, torch.float32, gen)
    sample(*args)
    t0 = time.perf_counter()
    for _ in range(5):
        sample(*args)
    dt = (time.perf_counter() - t0) / 5
    print(f"sample B=256 V=1024: {dt * 1e3:.1f} ms/call")
    assert dt < 0.5


# ---- statistics ------------------------------------------------------------------------
def _expected_probs(z, T, k, p):
    """Reference filtering in numpy float64, written straight from §4.1."""
    s = np.asarray(z, dtype=np.float64) / T
    V = len(s)
    if 0 < k < V:
        kth = np.sort(s)[::-1][k - 1]
        s = np.where(s < kth, -np.inf, s)
    if 0 < p < 1:
        order = np.argsort(-s, kind="stable")
        e = np.exp(s[order] - s[order][0])
        C = np.cumsum(e / e.sum())
        remove = np.zeros(V, dtype=bool)
        remove[1:] = C[:-1] > p
        s[order[remove]] = -np.inf
    e = np.exp(s - s.max())
    return e / e.sum()


STAT_TOLERANCE = 0.015  # max |empirical - expected| per token; 1 sigma is <= 0.0036 at 20k draws


@pytest.mark.parametrize("T,k,p", [(1.0, 0, 1.0), (1.7, 5, 1.0), (1.7, 25, 0.8), (0.7, 0, 0.9), (1.3, 3, 0.6)])
def test_draw_frequencies_match_filtered_softmax(T, k, p):
    n = 20_000
    V = 32
    z = np.linspace(2.0, -2.5, V) + np.sin(np.arange(V)) * 0.3
    expected = _expected_probs(z, T, k, p)
    seeds = torch.tensor([derive_sampling_seed(i) for i in range(n)], dtype=torch.int64)
    positions = torch.randint(0, 13 * 4096, (n,), generator=torch.Generator().manual_seed(3))
    out = sample(torch.tensor(z, dtype=torch.float32).expand(n, V), torch.full((n,), T),
                 torch.full((n,), k, dtype=torch.int64), torch.full((n,), p), seeds, positions)
    freq = np.bincount(out.numpy(), minlength=V) / n
    assert np.all(freq[expected == 0] == 0), "a filtered-out token was drawn"
    assert np.max(np.abs(freq - expected)) <= STAT_TOLERANCE


def test_stream_statistics_over_positions():
    # one seed, many positions (the per-request stream) is also distributed as softmax(z)
    n, V = 20_000, 4
    z = torch.tensor([1.0, 0.5, 0.0, -1.0])
    out = sample(z.expand(n, V), torch.ones(n), torch.zeros(n, dtype=torch.int64), torch.ones(n),
                 torch.full((n,), SEED_1234), torch.arange(n))
    freq = np.bincount(out.numpy(), minlength=V) / n
    assert np.max(np.abs(freq - torch.softmax(z.double(), 0).numpy())) <= STAT_TOLERANCE
