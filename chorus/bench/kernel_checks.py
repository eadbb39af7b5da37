"""GPU checks for gpu_worker/kernels.py: every Triton kernel against its torch
path on realistic decode shapes, then µs per call (eager and inside a CUDA
graph). Not a CI test: CI has no GPU (tests/test_kernels.py covers the same
math through the Triton interpreter on the CPU).

    python -m chorus.bench.kernel_checks --out kernel_checks.json [--quick]

Exactness is reported, not asserted, so one run gives the whole picture:
- fused_sample vs sampler.sample (+ apply_repetition_penalty) on CUDA: rows
  that differ are classified "boundary" when the torch path itself changes its
  draw under a 1e-5 relative move of top_p (the nucleus boundary sits within
  rounding of p: the softmax sum and cumsum run in another order), else
  "unexplained" (a bug; should be 0). The torch path on CUDA vs on the CPU,
  and batch invariance (a row alone vs in a batch of 256) are reported too.
- rms_norm / qk_norm_rope / silu_mul: fraction of differing elements and the
  largest difference in ulps of the output dtype, plus batch invariance.
Every section catches its own exception and records it in the JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback

import torch
import torch.nn.functional as F

import gpu_worker.kernels as K

from chorus.bench.common import write_json
import gpu_worker.sampler_kernel as S
from gpu_worker.model import RMSNorm, rope_inv_freq
from gpu_worker.torch_ops import rotate_half_split
from gpu_worker.sampler import apply_repetition_penalty, sample

DEV = torch.device("cuda")
BATCHES = (1, 16, 64, 256)
V_AUDIO, D, HQ, HK, HD, FF = 1024, 2560, 32, 8, 128, 9728


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def torch_sample(logits, t, k, p, seed, pos, presence=None, penalty=None):
    if presence is not None:
        logits = apply_repetition_penalty(logits, presence, penalty)
    return sample(logits, t, k, p, seed, pos)


def ulp_stats(got: torch.Tensor, want: torch.Tensor) -> dict:
    if got.dtype == torch.float32:
        a, b = got.view(torch.int32).long(), want.view(torch.int32).long()
    else:
        a, b = got.view(torch.int16).long(), want.view(torch.int16).long()
    diff = got != want
    return {"elements": got.numel(), "differ": int(diff.sum()), "differ_frac": float(diff.float().mean()),
            "max_ulp": int((a - b).abs().max()) if got.numel() else 0,
            "rows_differ_frac": float(diff.reshape(got.shape[0], -1).any(1).float().mean()),
            "exact": bool(not diff.any())}


def time_us(fn, iters: int) -> dict:
    """µs per call: eager (launch overhead included) and replayed from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    eager = start.elapsed_time(end) * 1e3 / iters
    per_graph = 20
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    reps = max(1, iters // per_graph)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return {"eager_us": eager, "graph_us": start.elapsed_time(end) * 1e3 / (reps * per_graph)}


def sampling_params(gen, B, V, mixed: bool, t=1.7, k=25, p=0.8):
    if not mixed:
        full = lambda v, dt: torch.full((B,), v, dtype=dt, device=DEV)  # noqa: E731
        tt, kk, pp = full(t, torch.float32), full(k, torch.int64), full(p, torch.float32)
    else:
        def pick(options, dtype):
            idx = torch.randint(0, len(options), (B,), generator=gen, device=DEV)
            return torch.tensor(options, dtype=dtype, device=DEV)[idx]
        tt = pick([0.0, 0.3, 1.0, 1.7, 1.7], torch.float32)
        kk = pick([-1, 0, 1, 2, 25, 50, V - 1, V, 25], torch.int64)
        pp = pick([1.0, 0.8, 0.95, 0.5, 1e-6, 0.8], torch.float32)
    seed = torch.randint(0, 2**31, (B,), generator=gen, device=DEV)
    pos = torch.randint(0, 13 * 4096, (B,), generator=gen, device=DEV)
    return tt, kk, pp, seed, pos


def random_logits(gen, B, V, ties=False):
    scale = torch.rand(B, 1, generator=gen, device=DEV) * 5 + 0.3
    z = torch.randn(B, V, generator=gen, device=DEV) * scale
    return (z * 2).round() / 2 if ties else z


def classify(got, logits, t, k, p, seed, pos, presence=None, penalty=None) -> dict:
    want = torch_sample(logits, t, k, p, seed, pos, presence, penalty)
    bad = (got != want).nonzero().flatten()
    boundary = unexplained = 0
    examples = []
    if bad.numel():
        sel = lambda x: None if x is None else x[bad]  # noqa: E731
        alts = [torch_sample(logits[bad], t[bad], k[bad], p[bad] * f, seed[bad], pos[bad], sel(presence),
                             sel(penalty)) for f in (1 - 1e-5, 1 + 1e-5)]
        ok = (alts[0] == got[bad]) | (alts[1] == got[bad])
        boundary = int(ok.sum())
        unexplained = int((~ok).sum())
        for i in bad[~ok][:5].tolist():
            examples.append({"row": i, "kernel": int(got[i]), "torch": int(want[i]), "T": float(t[i]),
                             "top_k": int(k[i]), "top_p": float(p[i])})
    return {"rows": got.numel(), "differ": int(bad.numel()), "boundary": boundary, "unexplained": unexplained,
            "unexplained_examples": examples}


def merge(acc: dict, r: dict) -> dict:
    for key in ("rows", "differ", "boundary", "unexplained"):
        acc[key] = acc.get(key, 0) + r[key]
    acc.setdefault("unexplained_examples", []).extend(r["unexplained_examples"][:5])
    return acc


# ---------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------
def check_sampler(quick: bool) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(0)
    out: dict = {}

    # mixed parameters (greedy, every top-k/top-p edge), with and without ties, per batch size
    for B in BATCHES:
        for ties in (False, True):
            logits = random_logits(gen, B, V_AUDIO, ties)
            params = sampling_params(gen, B, V_AUDIO, mixed=True)
            got = S.fused_sample(logits, *params, impl="triton")
            out[f"mixed_B{B}_ties{int(ties)}"] = classify(got, logits, *params)

    # production parameters, many rows: the nucleus-boundary flip rate
    rows = 16384 if quick else 131072
    for name, (t, k, p) in {"audio_T1.7_k25_p0.8": (1.7, 25, 0.8), "audio_T1.7_p0.8_nok": (1.7, -1, 0.8),
                            "audio_T1.0_p0.95_nok": (1.0, -1, 0.95)}.items():
        acc: dict = {}
        for _ in range(rows // 4096):
            logits = torch.randn(4096, V_AUDIO, generator=gen, device=DEV) * 3
            params = sampling_params(gen, 4096, V_AUDIO, mixed=False, t=t, k=k, p=p)
            merge(acc, classify(S.fused_sample(logits, *params, impl="triton"), logits, *params))
        acc["differ_rate"] = acc["differ"] / acc["rows"]
        out[name] = acc

    # stop head (V = 2, text params)
    logits = torch.randn(4096, 2, generator=gen, device=DEV) * 3
    params = sampling_params(gen, 4096, 2, mixed=False, t=1.0, k=50, p=1.0)
    out["stop_head_V2"] = classify(S.fused_sample(logits, *params, impl="triton"), logits, *params)

    # repetition penalty through a strided presence view, as decode_frame passes it
    B = 256
    logits = random_logits(gen, B, V_AUDIO)
    params = sampling_params(gen, B, V_AUDIO, mixed=True)
    presence = torch.rand(B, 12, 1024, generator=gen, device=DEV) < 0.05
    penalty = torch.tensor([1.0, 1.3, 0.7], device=DEV)[torch.randint(0, 3, (B,), generator=gen, device=DEV)]
    acc = {}
    for kk in (0, 7, 11):
        got = S.fused_sample(logits, *params, presence[:, kk, :V_AUDIO], penalty, impl="triton")
        merge(acc, classify(got, logits, *params, presence[:, kk, :V_AUDIO], penalty))
    out["penalty_strided_presence"] = acc

    # NaN / inf / signed zeros / ties
    inf, nan = float("inf"), float("nan")
    special = torch.tensor([[-inf] * 4, [1.0, nan, 3.0, nan], [nan, 0.0, 0.0, 0.0], [1.0, inf, 2.0, inf],
                            [-0.0, 0.0, -0.0, 0.0], [2.0, 2.0, 1.0, 2.0], [-1e30, -2e30, -3e30, -1e30],
                            [3.0, -inf, -inf, -inf], [1e38, 3e38, -3e38, 0.0]], device=DEV)
    n = special.shape[0]
    bad = 0
    for t in (0.0, 1.0, 1e-10, 1.7):
        for k in (-1, 1, 2, 4):
            for p in (1.0, 0.5, 1e-6):
                prm = (torch.full((n,), t, device=DEV), torch.full((n,), k, device=DEV),
                       torch.full((n,), p, device=DEV), torch.arange(n, device=DEV) * 7919 + 1,
                       torch.arange(n, device=DEV) + 13)
                bad += int((S.fused_sample(special, *prm, impl="triton") != torch_sample(special, *prm)).sum())
    out["special_values_differ"] = bad

    # pure noise (equal logits, huge T): pins the hash and the float64 Gumbel on the GPU
    B = 4096
    z = torch.zeros(B, 64, device=DEV)
    prm = (torch.full((B,), 1e30, device=DEV), torch.full((B,), -1, device=DEV), torch.ones(B, device=DEV),
           torch.randint(0, 2**62, (B,), generator=gen, device=DEV),
           torch.randint(0, 2**40, (B,), generator=gen, device=DEV))
    out["pure_noise_differ"] = int((S.fused_sample(z, *prm, impl="triton") != torch_sample(z, *prm)).sum())

    # the reference itself: torch on CUDA vs torch on the CPU, and batch invariance
    B = 256
    logits = random_logits(gen, B, V_AUDIO)
    params = sampling_params(gen, B, V_AUDIO, mixed=True)
    cuda_ref = torch_sample(logits, *params)
    cpu_ref = torch_sample(logits.cpu(), *(x.cpu() for x in params)).to(DEV)
    kern = S.fused_sample(logits, *params, impl="triton")
    one_k = torch.cat([S.fused_sample(logits[i:i + 1], *(x[i:i + 1] for x in params), impl="triton")
                       for i in range(B)])
    one_t = torch.cat([torch_sample(logits[i:i + 1], *(x[i:i + 1] for x in params)) for i in range(B)])
    out["reference_and_invariance"] = {
        "rows": B, "torch_cuda_vs_torch_cpu_differ": int((cuda_ref != cpu_ref).sum()),
        "kernel_vs_torch_cpu_differ": int((kern != cpu_ref).sum()),
        "kernel_batch1_vs_batch256_differ": int((one_k != kern).sum()),
        "torch_batch1_vs_batch256_differ": int((one_t != cuda_ref).sum())}
    return out


def check_rms_norm() -> dict:
    gen = torch.Generator(device=DEV).manual_seed(1)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        m = RMSNorm(D, 1e-6).to(DEV)
        with torch.no_grad():
            m.weight.copy_(1 + 0.1 * torch.randn(D, generator=gen, device=DEV))
        m = m.to(dtype)
        for B in BATCHES:
            x = (torch.randn(B, D, generator=gen, device=DEV) * 2).to(dtype)
            with torch.no_grad():
                out[f"{dtype}_N{B}"] = ulp_stats(K.rms_norm(x, m.weight, 1e-6, impl="triton"), m(x))
        x = (torch.randn(256, D, generator=gen, device=DEV) * 2).to(dtype)
        with torch.no_grad():
            full_t, full_k = m(x), K.rms_norm(x, m.weight, 1e-6, impl="triton")
            one_t = torch.cat([m(x[i:i + 1]) for i in range(256)])
            one_k = torch.cat([K.rms_norm(x[i:i + 1], m.weight, 1e-6, impl="triton") for i in range(256)])
        out[f"{dtype}_batch_invariance"] = {"torch_N1_vs_N256_rows_differ": int((one_t != full_t).any(1).sum()),
                                            "kernel_N1_vs_N256_rows_differ": int((one_k != full_k).any(1).sum())}
    return out


def qk_inputs(gen, N, dtype):
    pos = torch.randint(0, 8192, (N,), generator=gen, device=DEV)
    ang = pos.float()[:, None] * rope_inv_freq(1e6, HD).to(DEV)[None, :]
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    q = (torch.randn(N, HQ * HD, generator=gen, device=DEV) * 2).to(dtype).view(N, HQ, HD)
    k = (torch.randn(N, HK * HD, generator=gen, device=DEV) * 2).to(dtype).view(N, HK, HD)
    qw = (1 + 0.1 * torch.randn(HD, generator=gen, device=DEV)).to(dtype)
    kw = (1 + 0.1 * torch.randn(HD, generator=gen, device=DEV)).to(dtype)
    return q, k, qw, kw, cos, sin


def qk_store(q, k, qw, kw, cos, sin, impl):
    """qk_norm_rope_store into fresh caches (v = k); returns (q, stored k)."""
    slots = torch.arange(q.shape[0], device=DEV).flip(0)
    kc = torch.zeros(q.shape[0], HK, HD, dtype=q.dtype, device=DEV)
    vc = torch.zeros_like(kc)
    qo = K.qk_norm_rope_store(q, k, k, qw, kw, cos, sin, 1e-6, kc, vc, slots, impl=impl)
    return qo, kc[slots]


def qk_torch(q, k, qw, kw, cos, sin):
    qn, kn = RMSNorm(HD, 1e-6).to(q), RMSNorm(HD, 1e-6).to(q)
    with torch.no_grad():
        qn.weight.copy_(qw)
        kn.weight.copy_(kw)
        return rotate_half_split(qn(q), cos, sin), rotate_half_split(kn(k), cos, sin)


def check_qk_norm_rope() -> dict:
    gen = torch.Generator(device=DEV).manual_seed(2)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        for N in BATCHES:
            args = qk_inputs(gen, N, dtype)
            gq, gk = qk_store(*args, impl="triton")
            wq, wk = qk_torch(*args)
            out[f"{dtype}_N{N}_q"] = ulp_stats(gq, wq)
            out[f"{dtype}_N{N}_k"] = ulp_stats(gk, wk)
    return out


def check_add_norms() -> dict:
    """add_rms_norm and add_layer_norm (the backbone's and local transformer's residual + norm)."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        w = (1 + 0.1 * torch.randn(D, generator=gen, device=DEV)).to(dtype)
        b = (0.1 * torch.randn(D, generator=gen, device=DEV)).to(dtype)
        for N in BATCHES:
            x = (torch.randn(N, D, generator=gen, device=DEV) * 2).to(dtype)
            r = torch.randn(N, D, generator=gen, device=DEV).to(dtype)
            s, y = K.add_rms_norm(x, r, w, 1e-6, impl="triton")
            s_t, y_t = K.add_rms_norm(x, r, w, 1e-6, impl="torch")
            out[f"rms_{dtype}_N{N}"] = ulp_stats(y, y_t)
            out[f"rms_sum_{dtype}_N{N}_exact"] = bool(torch.equal(s, s_t))
            s, y = K.add_layer_norm(x, r, w, b, 1e-5, impl="triton")
            out[f"ln_{dtype}_N{N}"] = ulp_stats(y, F.layer_norm(x + r, (D,), w, b, 1e-5))
    return out


def check_local_attention() -> dict:
    """The local transformer's fused RoPE + cache append + attention over 13 positions
    against model.local_attention (torch), at the real shapes (32 heads x 80)."""
    from gpu_worker.torch_ops import local_attention
    gen = torch.Generator(device=DEV).manual_seed(6)
    out = {}
    H, d, P = 32, 80, 13
    ang = torch.arange(P, dtype=torch.float32)[:, None] * rope_inv_freq(10000.0, d)[None, :]
    cos_t, sin_t = ang.cos().repeat_interleave(2, -1).to(DEV), ang.sin().repeat_interleave(2, -1).to(DEV)
    for dtype in (torch.bfloat16, torch.float32):
        for B in BATCHES:
            kc = torch.zeros(B, H, P, d, dtype=dtype, device=DEV)
            vc, kc_t, vc_t = torch.zeros_like(kc), torch.zeros_like(kc), torch.zeros_like(kc)
            worst = 0.0
            for p in range(P):
                qkv = (torch.randn(B, 3 * H * d, generator=gen, device=DEV) * 2).to(dtype)
                got = K.local_attention(qkv, kc, vc, p, cos_t[p], sin_t[p], H, impl="triton")
                want = local_attention(qkv, kc_t, vc_t, p, cos_t[p], sin_t[p], H)
                worst = max(worst, float((got.float() - want.float()).abs().max()))
            out[f"{dtype}_B{B}"] = {"max_abs_diff": worst, "cache_exact": bool(torch.equal(kc, kc_t))}
    return out


def check_silu_mul() -> dict:
    gen = torch.Generator(device=DEV).manual_seed(3)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        for N in BATCHES:
            gate = (torch.randn(N, FF, generator=gen, device=DEV) * 4).to(dtype)
            up = torch.randn(N, FF, generator=gen, device=DEV).to(dtype)
            out[f"{dtype}_N{N}"] = ulp_stats(K.silu_mul(gate, up, impl="triton"), F.silu(gate) * up)
        fused = (torch.randn(64, 2 * FF, generator=gen, device=DEV) * 4).to(dtype)  # strided halves
        out[f"{dtype}_strided"] = ulp_stats(K.silu_mul(fused[:, :FF], fused[:, FF:], impl="triton"),
                                            F.silu(fused[:, :FF]) * fused[:, FF:])
    return out


def check_head_linear() -> dict:
    """head_linear vs F.linear (cuBLAS) on the sampling heads' shapes, both against a
    float64 product: each is one rounding of an fp32 sum, in different orders."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    out = {}
    for N in (V_AUDIO, 2):
        w = (torch.randn(N, D, generator=gen, device=DEV) * D ** -0.5).to(torch.bfloat16)
        for B in BATCHES:
            x = torch.randn(B, D, generator=gen, device=DEV).to(torch.bfloat16)
            exact = (x.double() @ w.double().T).to(torch.bfloat16)
            got = K.head_linear(x, w, impl="triton")
            out[f"N{N}_B{B}"] = {"vs_cublas": ulp_stats(got, F.linear(x, w)), "vs_fp64": ulp_stats(got, exact),
                                 "cublas_vs_fp64": ulp_stats(F.linear(x, w), exact),
                                 "batch_invariant": bool(torch.equal(got[:1], K.head_linear(x[:1], w, impl="triton")))}
    return out


def timings(iters: int, only: set[str] | None = None) -> list[dict]:
    gen = torch.Generator(device=DEV).manual_seed(4)
    rows = []

    def add(kernel, shape, torch_fn, triton_fn):
        if only and kernel not in only:
            return
        r = {"kernel": kernel, "shape": shape}
        for impl, fn in (("torch", torch_fn), ("triton", triton_fn)):
            try:
                for key, v in time_us(fn, iters).items():
                    r[f"{impl}_{key}"] = v
            except Exception as e:  # noqa: BLE001 - report and carry on
                r[f"{impl}_error"] = repr(e)
        rows.append(r)
        print(f"{kernel:14s} {shape:26s} " + "  ".join(
            f"{k}={v:8.1f}" for k, v in r.items() if isinstance(v, float)), flush=True)

    for B in BATCHES:
        logits = torch.randn(B, V_AUDIO, generator=gen, device=DEV) * 3
        params = sampling_params(gen, B, V_AUDIO, mixed=False)
        presence = torch.rand(B, 12, 1024, generator=gen, device=DEV) < 0.05
        pen = torch.full((B,), 1.0, device=DEV)
        add("fused_sample", f"B{B} V{V_AUDIO} +penalty",
            lambda: torch_sample(logits, *params, presence[:, 3, :V_AUDIO], pen),
            lambda: S.fused_sample(logits, *params, presence[:, 3, :V_AUDIO], pen, impl="triton"))
        for warps in (1, 2, 8):  # the launch width: one row's sort is latency bound
            add("fused_sample", f"B{B} V{V_AUDIO} warps={warps}",
                lambda: S.fused_sample(logits, *params, impl="triton", num_warps=warps),
                lambda: S.fused_sample(logits, *params, impl="triton", num_warps=warps))
        stop = torch.randn(B, 2, generator=gen, device=DEV)
        sp = sampling_params(gen, B, 2, mixed=False, t=1.0, k=50, p=1.0)
        add("fused_sample", f"B{B} V2 (stop)", lambda: torch_sample(stop, *sp),
            lambda: S.fused_sample(stop, *sp, impl="triton"))
    for N in (V_AUDIO, 2):  # an audio head and the stop head
        hw = (torch.randn(N, D, generator=gen, device=DEV) * D ** -0.5).to(torch.bfloat16)
        for B in BATCHES:
            hx = torch.randn(B, D, generator=gen, device=DEV).to(torch.bfloat16)
            add("head_linear", f"B{B} N{N} K{D} bfloat16", lambda: F.linear(hx, hw),
                lambda: K.head_linear(hx, hw, impl="triton"))
    for dtype in (torch.bfloat16,):
        w = torch.ones(D, device=DEV, dtype=dtype)
        for B in BATCHES:
            x = torch.randn(B, D, generator=gen, device=DEV).to(dtype)
            add("rms_norm", f"N{B} D{D} {str(dtype)[6:]}", lambda: K.rms_norm(x, w, 1e-6, impl="torch"),
                lambda: K.rms_norm(x, w, 1e-6, impl="triton"))
            args = qk_inputs(gen, B, dtype)
            add("qk_norm_rope_store", f"N{B} {HQ}/{HK}x{HD} {str(dtype)[6:]}",
                lambda: qk_store(*args, impl="torch"), lambda: qk_store(*args, impl="triton"))
            r = torch.randn(B, D, generator=gen, device=DEV).to(dtype)
            add("add_rms_norm", f"N{B} D{D} {str(dtype)[6:]}", lambda: K.add_rms_norm(x, r, w, 1e-6, impl="torch"),
                lambda: K.add_rms_norm(x, r, w, 1e-6, impl="triton"))
            qkv = torch.randn(B, 3 * D, generator=gen, device=DEV).to(dtype)
            kc = torch.zeros(B, 32, 13, 80, dtype=dtype, device=DEV)
            cs = torch.ones(80, device=DEV)
            add("local_attention", f"B{B} p12 32x80 {str(dtype)[6:]}",
                lambda: K.local_attention(qkv, kc, kc, 12, cs, cs, 32, impl="torch"),
                lambda: K.local_attention(qkv, kc, kc, 12, cs, cs, 32, impl="triton"))
            gate = torch.randn(B, FF, generator=gen, device=DEV).to(dtype)
            up = torch.randn(B, FF, generator=gen, device=DEV).to(dtype)
            add("silu_mul", f"N{B} F{FF} {str(dtype)[6:]}", lambda: F.silu(gate) * up,
                lambda: K.silu_mul(gate, up, impl="triton"))
    return rows


def summarize(sections: dict) -> dict:
    """The headline numbers: sampler rows that differ (and how many are unexplained),
    and per kernel/dtype the worst differing-element fraction and ulp distance."""
    out: dict = {}
    fs = sections.get("fused_sample", {})
    if "error" not in fs:
        rows = [v for v in fs.values() if isinstance(v, dict) and "unexplained" in v]
        out["fused_sample"] = {"rows": sum(r["rows"] for r in rows), "differ": sum(r["differ"] for r in rows),
                               "unexplained": sum(r["unexplained"] for r in rows),
                               "special_values_differ": fs.get("special_values_differ"),
                               "pure_noise_differ": fs.get("pure_noise_differ")}
    for name in ("rms_norm", "qk_norm_rope", "silu_mul", "add_norms"):
        sec = sections.get(name, {})
        if "error" in sec:
            out[name] = "error"
            continue
        for dt in ("bfloat16", "float32"):
            stats = [v for k, v in sec.items() if dt in k and isinstance(v, dict) and "differ_frac" in v]
            if stats:
                out[f"{name}_{dt}"] = {"max_differ_frac": max(v["differ_frac"] for v in stats),
                                       "max_ulp": max(v["max_ulp"] for v in stats),
                                       "all_exact": all(v["exact"] for v in stats)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--quick", action="store_true", help="fewer sampler rows and timing iterations")
    ap.add_argument("--only", help="comma-separated sections/kernels, e.g. head_linear (default: all)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    if not torch.cuda.is_available() or not K.HAVE_TRITON:
        raise SystemExit("needs CUDA and triton")
    import triton
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "sections": {}}
    t0 = time.time()
    for name, fn in (("fused_sample", lambda: check_sampler(args.quick)), ("rms_norm", check_rms_norm),
                     ("qk_norm_rope", check_qk_norm_rope), ("silu_mul", check_silu_mul),
                     ("add_norms", check_add_norms), ("local_attention", check_local_attention),
                     ("head_linear", check_head_linear)):
        if only and name not in only:
            continue
        t = time.time()
        try:
            result["sections"][name] = fn()
        except Exception:  # noqa: BLE001 - one broken kernel must not hide the others
            result["sections"][name] = {"error": traceback.format_exc()}
        print(f"== {name} ({time.time() - t:.1f}s)", flush=True)
        print(json.dumps(result["sections"][name], indent=1)[:6000], flush=True)
    result["summary"] = summarize(result["sections"])
    print("== summary\n" + json.dumps(result["summary"], indent=1), flush=True)
    result["timings"] = timings(100 if args.quick else 400, only)
    result["wall_s"] = time.time() - t0
    write_json(args.out, result, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
