"""gpu_worker/kernels.py: the Triton kernels against the torch reference code,
run on the CPU through the Triton interpreter (TRITON_INTERPRET=1). Skipped
when triton is not installed (CI). chorus/bench/kernel_checks.py runs the same
comparisons compiled on a GPU.

Interpreter caveat: its transcendentals are numpy's, torch-CPU's are SLEEF's,
so exp-based results are compared exactly against the torch formula with
numpy's exp, and against the torch op to within a few ulp.
"""


import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import triton_skip_reason  # noqa: E402

_SKIP_TRITON = triton_skip_reason()
if _SKIP_TRITON is not None:
    pytest.skip(_SKIP_TRITON, allow_module_level=True)
import gpu_worker.kernels as K  # noqa: E402
import gpu_worker.sampler_kernel as S  # noqa: E402

from gpu_worker.model import RMSNorm, rope_inv_freq  # noqa: E402
from gpu_worker.torch_ops import rotate_half_split  # noqa: E402
from gpu_worker.sampler import apply_repetition_penalty, sample  # noqa: E402


# inf/NaN rows and exp overflow are deliberate
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---------------------------------------------------------------------------
# fused_sample
# ---------------------------------------------------------------------------
def _reference(logits, t, k, p, seed, pos, presence=None, penalty=None):
    if presence is not None:
        logits = apply_repetition_penalty(logits, presence, penalty)
    return sample(logits, t, k, p, seed, pos)


def _params(gen: torch.Generator, B: int, V: int):
    def pick(options, dtype):
        idx = torch.randint(0, len(options), (B,), generator=gen)
        return torch.tensor(options, dtype=dtype)[idx]

    t = pick([0.0, -1.0, 0.3, 1.0, 1.7, 1.0, 1.7], torch.float32)
    k = pick([-1, 0, 1, 2, 25, 50, V - 1, V, V + 3, 25, 25], torch.int64)
    p = pick([1.0, 0.8, 0.95, 0.5, 1e-6, 0.0, 0.8, 0.8], torch.float32)
    seed = torch.randint(0, 2**31, (B,), generator=gen)
    seed[::5] += 2**40  # a non-zero high word exercises the second hash word
    pos = torch.randint(0, 2**33, (B,), generator=gen)  # beyond 2^32: position mod 2^32
    return t, k, p, seed, pos


def _random_logits(gen: torch.Generator, B: int, V: int, ties: bool) -> torch.Tensor:
    scale = torch.rand(B, 1, generator=gen) * 5 + 0.3
    z = torch.randn(B, V, generator=gen) * scale
    if ties:  # a coarse grid: many exact ties, including with the k-th value
        z = (z * 2).round() / 2
    return z


def _check(got, logits, t, k, p, seed, pos, presence=None, penalty=None, max_boundary=0):
    """Exact match, except rows where the draw flips with a 1e-5 relative move of
    top_p (the nucleus boundary sits within rounding of p; see kernels.py)."""
    want = _reference(logits, t, k, p, seed, pos, presence, penalty)
    bad = (got != want).nonzero().flatten().tolist()
    boundary = 0
    for i in bad:
        rows = slice(i, i + 1)
        alt = {_reference(logits[rows], t[rows], k[rows], p[rows] * f, seed[rows], pos[rows],
                          None if presence is None else presence[rows],
                          None if penalty is None else penalty[rows]).item() for f in (1 - 1e-5, 1 + 1e-5)}
        assert got[i].item() in alt, (
            f"row {i}: kernel {got[i].item()} vs sampler {want[i].item()} "
            f"(T={t[i].item()}, k={k[i].item()}, p={p[i].item()})")
        boundary += 1
    assert boundary <= max_boundary, f"{boundary} nucleus-boundary flips"


@pytest.mark.parametrize("V,B,ties", [(2, 96, False), (2, 64, True), (3, 48, True), (17, 64, False),
                                      (64, 96, True), (64, 64, False), (1000, 24, False),
                                      (1024, 48, False), (1024, 32, True), (2048, 4, True)])
def test_fused_sample_matches_sampler(V, B, ties):
    gen = torch.Generator().manual_seed(V * 1000 + B + ties)
    logits = _random_logits(gen, B, V, ties)
    t, k, p, seed, pos = _params(gen, B, V)
    got = S.fused_sample(logits, t, k, p, seed, pos, impl="triton")
    _check(got, logits, t, k, p, seed, pos, max_boundary=1)


def test_fused_sample_nucleus_ends_in_ties():
    """Four score levels, ~256 columns each: the top-p boundary falls inside a run of equal
    scores, where the kernel keeps the lowest-indexed ones (torch's stable sort) after
    sorting scores alone; top-k small (fast path), 300 and off (full sort)."""
    gen = torch.Generator().manual_seed(12)
    B, V = 32, 1024
    z = torch.randint(0, 4, (B, V), generator=gen).float() * 0.5
    t, p = torch.ones(B), torch.tensor([0.3, 0.5, 0.7, 0.9]).repeat(B // 4)
    seed, pos = torch.randint(0, 2**31, (B,), generator=gen), torch.arange(B)
    for k in (-1, 25, 300):
        kk = torch.full((B,), k)
        assert torch.equal(S.fused_sample(z, t, kk, p, seed, pos, impl="triton"), _reference(z, t, kk, p, seed, pos))


def test_fused_sample_audio_defaults_and_stop_head():
    """The production parameters: audio (T 1.7, top-p 0.8, top-k 25) and the stop head (V = 2)."""
    gen = torch.Generator().manual_seed(7)
    B = 40
    seed = torch.randint(0, 2**31, (B,), generator=gen)
    pos = torch.randint(0, 13 * 4096, (B,), generator=gen)
    for V, t, k, p in ((1024, 1.7, 25, 0.8), (2, 1.0, 50, 1.0)):
        logits = torch.randn(B, V, generator=gen) * 4
        params = (torch.full((B,), t), torch.full((B,), k), torch.full((B,), p), seed, pos)
        got = S.fused_sample(logits, *params, impl="triton")
        _check(got, logits, *params, max_boundary=1)


def test_fused_sample_repetition_penalty_strided_presence():
    gen = torch.Generator().manual_seed(3)
    B, V = 24, 1024
    logits = _random_logits(gen, B, V, ties=False)
    t, k, p, seed, pos = _params(gen, B, V)
    presence_full = torch.rand(B, 12, 1024, generator=gen) < 0.05  # the pool's [B, n_vq, 1024] mask
    penalty = torch.tensor([1.0, 1.3, 0.7, 2.0])[torch.randint(0, 4, (B,), generator=gen)]
    for kk in (0, 5):
        presence = presence_full[:, kk, :V]
        got = S.fused_sample(logits, t, k, p, seed, pos, presence, penalty, impl="triton")
        _check(got, logits, t, k, p, seed, pos, presence, penalty, max_boundary=1)


def test_fused_sample_pure_noise_draws():
    """Equal logits and huge temperature: the draw is the argmax of the hashed Gumbel
    noise alone, so this pins MurmurHash3 and the float64 Gumbel bit for bit."""
    B, V = 96, 64
    gen = torch.Generator().manual_seed(11)
    logits = torch.zeros(B, V)
    t = torch.full((B,), 1e30)
    k = torch.full((B,), -1)
    p = torch.ones(B)
    seed = torch.randint(0, 2**63 - 1, (B,), generator=gen)
    pos = torch.randint(-2**40, 2**40, (B,), generator=gen)
    got = S.fused_sample(logits, t, k, p, seed, pos, impl="triton")
    assert torch.equal(got, _reference(logits, t, k, p, seed, pos))
    assert len(set(got.tolist())) > V // 2  # really noise-driven


def test_fused_sample_special_values():
    inf, nan = float("inf"), float("nan")
    rows = [
        [-inf, -inf, -inf, -inf],        # all -inf: first argmax of z = 0
        [1.0, nan, 3.0, nan],             # NaN: the first NaN index
        [nan, 0.0, 0.0, 0.0],
        [1.0, inf, 2.0, inf],             # +inf: the first +inf
        [-0.0, 0.0, -0.0, 0.0],           # signed zeros are ties
        [2.0, 2.0, 1.0, 2.0],             # greedy / top-k 1 ties
        [-1e30, -2e30, -3e30, -1e30],     # tiny temperature: s overflows to -inf
        [3.0, -inf, -inf, -inf],
        [1e38, 3e38, -3e38, 0.0],
    ]
    z = torch.tensor(rows, dtype=torch.float32)
    n = z.shape[0]
    for t in (0.0, 1.0, 1e-10):
        for k in (-1, 1, 2):
            for p in (1.0, 0.5, 1e-6):
                params = (torch.full((n,), t), torch.full((n,), k), torch.full((n,), p),
                          torch.arange(n) * 7919 + 1, torch.arange(n) + 13)
                got = S.fused_sample(z, *params, impl="triton")
                want = _reference(z, *params)
                assert torch.equal(got, want), (t, k, p, got.tolist(), want.tolist())


def test_fused_sample_position_offset_and_dtypes():
    gen = torch.Generator().manual_seed(5)
    B, V = 16, 1024
    logits = torch.randn(B, V, generator=gen).to(torch.bfloat16)
    t, k, p = torch.full((B,), 1.7, dtype=torch.float64), torch.full((B,), 25, dtype=torch.int32), \
        torch.full((B,), 0.8)
    seed = torch.randint(0, 2**31, (B,), generator=gen)
    base = torch.randint(0, 1000, (B,), generator=gen) * 13
    for c in (0, 1, 12):
        got = S.fused_sample(logits, t, k, p, seed, base, position_offset=c, impl="triton")
        _check(got, logits, t, k, p, seed, base + c, max_boundary=1)


def test_fused_sample_strided_logits():
    gen = torch.Generator().manual_seed(9)
    wide = torch.randn(8, 1100, generator=gen)
    logits = wide[:, :1024]  # a row-strided view
    t, k, p, seed, pos = _params(gen, 8, 1024)
    got = S.fused_sample(logits, t, k, p, seed, pos, impl="triton")
    _check(got, logits.contiguous(), t, k, p, seed, pos, max_boundary=1)


def test_fused_sample_torch_path_on_cpu():
    """impl='auto' never runs a kernel on CPU tensors: it is the sampler itself."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 1024, generator=gen)
    t, k, p, seed, pos = _params(gen, 32, 1024)
    presence = torch.rand(32, 1024, generator=gen) < 0.1
    penalty = torch.full((32,), 1.2)
    got = S.fused_sample(logits, t, k, p, seed, pos, presence, penalty, position_offset=3)
    assert torch.equal(got, _reference(logits, t, k, p, seed, pos + 3, presence, penalty))


# ---------------------------------------------------------------------------
# rms_norm, qk_norm_rope_store, add + norm, local attention, silu_mul
# ---------------------------------------------------------------------------
DTYPES = [torch.float32, torch.bfloat16]


def _dyadic(gen, *shape, dtype):
    """Multiples of 1/8 in [-8, 8]: every partial sum of squares is exact in fp32,
    so the sum is independent of the reduction order and results must be bit-exact."""
    return (torch.randint(-64, 65, shape, generator=gen).float() / 8).to(dtype)


def _ulp_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    ia = a.float().view(torch.int32).long() if a.dtype == torch.float32 else a.view(torch.int16).long()
    ib = b.float().view(torch.int32).long() if b.dtype == torch.float32 else b.view(torch.int16).long()
    return int((ia - ib).abs().max())


def _assert_close_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        assert _ulp_diff(got, want) <= 4
    else:
        assert _ulp_diff(got, want) <= 1 and (got != want).float().mean() < 0.01


def _rms_module(D: int, dtype, gen) -> RMSNorm:
    m = RMSNorm(D, 1e-6)
    with torch.no_grad():
        m.weight.copy_(1 + 0.1 * torch.randn(D, generator=gen))
    return m.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [2560, 64, 80])
def test_rms_norm(dtype, D):
    gen = torch.Generator().manual_seed(D)
    m = _rms_module(D, dtype, gen)
    w = m.weight.detach()
    x = _dyadic(gen, 9, D, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(K.rms_norm(x, w, 1e-6, impl="triton"), m(x))
        # Random data: the sum of squares may round differently (another order), which
        # moves rsqrt by an ulp: every fp32 element of the row may move by an ulp or
        # two; in bf16 the rounding hides it except in rare elements.
        x = (torch.randn(9, D, generator=gen) * 3).to(dtype)
        got, want = K.rms_norm(x, w, 1e-6, impl="triton"), m(x)
        _assert_close_ulp(got, want)
        # strided rows and a leading batch shape
        wide = _dyadic(gen, 2, 5, D + 7, dtype=dtype)
        xs = wide[..., :D]
        assert torch.equal(K.rms_norm(xs, w, 1e-6, impl="triton"), m(xs))
        assert torch.equal(K.rms_norm(x, w, 1e-6), m(x))  # auto on CPU: the torch path


def _qk_reference(q, k, qw, kw, cos, sin, eps):
    def norm(x, w):
        m = RMSNorm(x.shape[-1], eps).to(x.dtype)
        with torch.no_grad():
            m.weight.copy_(w)
            return m(x)
    return rotate_half_split(norm(q, qw), cos, sin), rotate_half_split(norm(k, kw), cos, sin)


def _qk_store(q, k, v, qw, kw, cos, sin, slots, n_slots):
    """Run qk_norm_rope_store (triton) into fresh caches; returns (q, k rows, v rows, caches)."""
    kc = torch.zeros(n_slots, k.shape[1], k.shape[2], dtype=k.dtype)
    vc = torch.zeros_like(kc)
    qo = K.qk_norm_rope_store(q, k, v, qw, kw, cos, sin, 1e-6, kc, vc, slots, impl="triton")
    return qo, kc[slots], vc[slots], kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hk,d", [(32, 8, 128), (4, 2, 16), (3, 1, 80)])
def test_qk_norm_rope_store(dtype, Hq, Hk, d):
    gen = torch.Generator().manual_seed(Hq * d)
    N = 5
    positions = torch.randint(0, 8192, (N,), generator=gen)
    angles = positions.float()[:, None] * rope_inv_freq(1e6, d)[None, :]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype)
    kw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype)
    # q a plain projection view, k and v row-strided slices of a fused qkv projection
    q = _dyadic(gen, N, Hq, d, dtype=dtype)
    kv = _dyadic(gen, N, (2 * Hk + 3) * d, dtype=dtype)
    k, v = kv[:, :Hk * d].view(N, Hk, d), kv[:, Hk * d:2 * Hk * d].view(N, Hk, d)
    slots = torch.tensor([7, 0, 3, 11, 5])
    qo, ko, vo, kc, vc = _qk_store(q, k, v, qw, kw, cos, sin, slots, 12)
    want = _qk_reference(q, k, qw, kw, cos, sin, 1e-6)
    assert torch.equal(qo, want[0]) and torch.equal(ko, want[1]) and torch.equal(vo, v)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    assert not kc[untouched].any() and not vc[untouched].any()
    # the torch path (auto on CPU) is the same function
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    assert torch.equal(K.qk_norm_rope_store(q, k, v, qw, kw, cos, sin, 1e-6, kc2, vc2, slots), want[0])
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)

    q = (torch.randn(N, Hq, d, generator=gen) * 2).to(dtype)
    qo, ko, _, _, _ = _qk_store(q, k, v, qw, kw, cos, sin, slots, 12)
    want = _qk_reference(q, k, qw, kw, cos, sin, 1e-6)
    assert torch.equal(ko, want[1])
    # Random q: as for rms_norm; in bf16 a moved normalised element also moves its
    # rotation pair, by an ulp of the pair's products (an absolute, not relative, ulp).
    if dtype == torch.float32:
        assert torch.allclose(qo, want[0], rtol=4e-7, atol=1e-6)
    else:
        assert (qo != want[0]).float().mean() < 0.02
        assert torch.allclose(qo.float(), want[0].float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [2560, 80])
def test_add_rms_norm(dtype, D):
    gen = torch.Generator().manual_seed(D + 1)
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype)
    x, r = _dyadic(gen, 7, D, dtype=dtype), _dyadic(gen, 7, D, dtype=dtype)
    s, y = K.add_rms_norm(x, r, w, 1e-6, impl="triton")
    assert torch.equal(s, x + r) and torch.equal(y, K.rms_norm(x + r, w, 1e-6, impl="torch"))
    s2, y2 = K.add_rms_norm(x, r, w, 1e-6)  # auto on CPU: the torch path
    assert torch.equal(s2, s) and torch.equal(y2, y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [2560, 64])
def test_add_layer_norm(dtype, D):
    gen = torch.Generator().manual_seed(D + 2)
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype)
    b = (0.1 * torch.randn(D, generator=gen)).to(dtype)
    x = (torch.randn(6, D, generator=gen) * 3).to(dtype)
    r = (torch.randn(6, D, generator=gen)).to(dtype)
    for res in (None, r):
        s, y = K.add_layer_norm(x, res, w, b, 1e-5, impl="triton")
        want_s = x if res is None else x + res
        want = F.layer_norm(want_s, (D,), w, b, 1e-5)
        assert torch.equal(s, want_s)
        # two-pass vs Welford variance: the same value up to rounding
        if dtype == torch.float32:
            assert torch.allclose(y, want, rtol=1e-5, atol=1e-5)
        else:
            assert _ulp_diff(y, want) <= 1 and (y != want).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [True, False])
def test_local_attention(dtype, rope):
    from gpu_worker.torch_ops import local_attention
    gen = torch.Generator().manual_seed(3 + rope)
    B, H, d, P = 3, 4, 20, 13  # d/2 = 10: not a power of two, like the real 80
    angles = torch.arange(P, dtype=torch.float32)[:, None] * rope_inv_freq(10000.0, d)[None, :]
    cos_t, sin_t = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
    kc, vc = torch.zeros(B, H, P, d, dtype=dtype), torch.zeros(B, H, P, d, dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    for p in range(P):
        qkv = (torch.randn(B, 3 * H * d + 5, generator=gen) * 2).to(dtype)[:, :3 * H * d]  # strided rows
        cs = (cos_t[p], sin_t[p]) if rope else (None, None)
        got = K.local_attention(qkv, kc, vc, p, *cs, H, impl="triton")
        want = local_attention(qkv, kc_ref, vc_ref, p, *cs, H)
        # RoPE'd k/v are stored exactly as the torch path stores them
        assert torch.equal(kc[:, :, :p + 1], kc_ref[:, :, :p + 1]) and torch.equal(vc, vc_ref)
        if dtype == torch.float32:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        else:  # scores summed in another order: probabilities may round one bf16 ulp apart
            assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6)
    assert torch.equal(K.local_attention(qkv, kc.clone(), vc.clone(), P - 1, *cs, H), want)  # auto: torch path


def _silu_numpy_exp(g: torch.Tensor) -> torch.Tensor:
    """F.silu's formula x / (1 + exp(-x)) in fp32, with numpy's expf (the interpreter's)."""
    gf = g.float()
    return (gf / (1 + torch.from_numpy(np.exp(-gf.numpy())))).to(g.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gen = torch.Generator().manual_seed(2)
    N, Fdim = 6, 3000
    fused = (torch.randn(N, 2 * Fdim + 8, generator=gen) * 6).to(dtype)  # a fused gate_up output
    gate, up = fused[:, :Fdim], fused[:, Fdim + 8:]
    gate[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.7, -88.7])
    got = K.silu_mul(gate, up, impl="triton")
    assert torch.equal(got, _silu_numpy_exp(gate) * up)
    want = F.silu(gate) * up
    assert _ulp_diff(got, want) <= 4  # numpy's expf vs SLEEF's: an ulp or so before the roundings
    assert torch.equal(K.silu_mul(gate, up), want)  # auto on CPU: the torch path


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_rows(dtype):
    from gpu_worker.linears import fuse_linears
    gen = torch.Generator().manual_seed(9)
    V, H, n_vq, pad = 16, 40, 3, 16
    text = torch.nn.Embedding(50, H, _weight=torch.randn(50, H, generator=gen).to(dtype))
    audio = [torch.nn.Embedding(V, H, _weight=torch.randn(V, H, generator=gen).to(dtype)) for _ in range(n_vq)]
    rows = torch.cat([torch.randint(0, 50, (7, 1), generator=gen), torch.randint(0, V, (7, n_vq), generator=gen)], 1)
    rows[2, 1:] = pad  # a text-only row
    rows[4, 2] = pad
    want = text.weight[rows[:, 0]]
    for k, table in enumerate(audio):
        valid = rows[:, k + 1] != pad
        want = want + torch.where(valid[:, None], table.weight[torch.where(valid, rows[:, k + 1], 0)], 0)
    weights = lambda: [t.weight for t in audio]  # noqa: E731
    with pytest.raises(ValueError):  # separate storages: only the caller's torch path can run
        K.embed_rows(rows, text.weight, weights(), pad, impl="triton")
    fuse_linears(tuple(audio))
    got = K.embed_rows(rows, text.weight, weights(), pad, impl="triton")
    assert torch.equal(got, want)
    assert K.embed_rows(rows, text.weight, weights(), pad) is None  # auto on CPU: the caller's torch path


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 5, 70])
def test_head_linear(dtype, B):
    gen = torch.Generator().manual_seed(B)
    N, Kdim = 40, 600  # neither a multiple of the 16-column or 256-deep tiles
    x = torch.randn(B, Kdim + 3, generator=gen).to(dtype)[:, :Kdim]  # strided rows, as a view of the local output
    w = (torch.randn(N, Kdim, generator=gen) / Kdim ** 0.5).to(dtype)
    got = K.head_linear(x, w, impl="triton")
    want = (x.double() @ w.double().T)
    assert got.dtype == dtype and got.shape == (B, N)
    if dtype == torch.float32:
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    else:  # fp32 sums in another order than the reference, then one rounding to dtype
        assert _ulp_diff(got, want.to(dtype)) <= 1
    assert torch.equal(K.head_linear(x, w), F.linear(x, w))  # auto on CPU: the torch path


def test_qk_norm_rope_store_rotates_k_in_place_and_leaves_v():
    """v_cache None: k_cache may be k's own view (slots = arange), v is not copied anywhere."""
    torch.manual_seed(3)
    N, Hq, Hk, d = 21, 4, 2, 16
    qkv = torch.randn(N, (Hq + 2 * Hk) * d)
    q, k, v = (t.view(N, -1, d) for t in qkv.split([Hq * d, Hk * d, Hk * d], dim=1))
    qw, kw = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    cos, sin = torch.rand(N, d // 2), torch.rand(N, d // 2)
    slots = torch.arange(N)
    kc, vc = torch.zeros(N, Hk, d), torch.zeros(N, Hk, d)
    want_q = K.qk_norm_rope_store(q, k, v, qw, kw, cos, sin, 1e-6, kc, vc, slots, impl="triton")
    v_before = v.clone()
    got_q = K.qk_norm_rope_store(q, k, v, qw, kw, cos, sin, 1e-6, k, None, slots, impl="triton")
    assert torch.equal(got_q, want_q) and torch.equal(k, kc) and torch.equal(v, v_before)
