"""Vocoder (MOSS-Audio-Tokenizer decode) benchmark: SlotDecoder streaming,
first-chunk latency and offline decode, against the physical floor.

    python -m chorus.bench.vocoder_bench --preset full --device cuda --dtype bfloat16 --out $OUT/vocoder.json
    python -m chorus.bench.vocoder_bench --preset tiny --device cpu                      # smoke test

Weights are random (build_codec), which costs exactly what real ones do.
Measures, each as the median of N timed runs after warm-up, with
torch.cuda.synchronize() around every run:

  streaming   S streams x steady T-frame steps (default 25 = 2 s) in one
              batched SlotDecoder step, CUDA-graphed (and eager for the
              smallest and largest S): seconds of audio per second;
  first_chunk one stream, one 5-frame step: latency in ms (PCM on the host), graphed and eager;
  offline     codec.decode of S utterances x 100 frames in one call;
  single_bucket  the price of bucket-invariant serving (server --buckets equal to
              --slots): one stream padded to the largest bucket, for the first-chunk
              and the steady step, next to its cost in bucket 1; plus the check that
              a padded stream equals itself batched in that bucket bitwise, and how
              far bucket 1 is from it.

The floor for each case is max(FLOPs / peak FLOP/s, bytes / peak bandwidth):
FLOPs from spec §6 (2(4d^2 + 2 d ff) + 4 d W per token and layer, plus the
stage projections; about 160 GFLOP per second of audio for v2), bytes = the
decoder weights once per step in the compute dtype plus, when streaming, the
KV window of every stream read and written once.

On CUDA the run starts with a check of the Triton window-attention kernel
(vocoder_svc/window_attention.py) against the torch path, bf16, at one
realistic shape (max abs diff and time of each; see window_attention_check).
--attention picks the decoder's attention path (auto = the kernel on CUDA).
--glue picks the decoder's elementwise glue (vocoder_svc/slot_kernels.py: fused
LayerNorm/residual/RoPE Triton kernels, self-tested when the decoder is built;
auto = the kernels on CUDA unless the self-test fails); the path in use is
recorded as decoder.glue_impl (and glue_fallback says why auto fell back).

Results go to stdout as a table and to --out as JSON, rewritten after every
section, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import traceback

import torch

from chorus.bench.common import device_name, write_json
from chorus import provenance
from vocoder_svc.codec import PRESETS, ProjectedTransformer, PatchedPretransform
from vocoder_svc.codec_checkpoint import build_codec
from vocoder_svc import window_attention as wa
from vocoder_svc.slot_decoder import SlotDecoder

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}


def log(msg: str) -> None:
    print(f"[vocoder-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the cost model (§6) ---------------------------------------------------------------------------

def cost_model(codec) -> dict:
    """FLOPs per second of audio (window full), decoder parameters, KV bytes per element."""
    cfg = codec.config
    rate = cfg.frame_rate
    stages, total = [], 0.0
    for m in codec.decoder:
        if isinstance(m, PatchedPretransform):
            rate *= m.patch_size
            continue
        assert isinstance(m, ProjectedTransformer)
        s = m.cfg
        d, ff, w = s.d_model, s.dim_feedforward, m.window
        per_token = s.num_layers * (2 * (4 * d * d + 2 * d * ff) + 4 * d * w)
        per_token += 2 * s.input_dimension * d + 2 * d * s.output_dimension
        flops = rate * per_token
        stages.append({"rate_hz": rate, "window": w, "d_model": d, "layers": s.num_layers,
                       "gflop_per_audio_s": flops / 1e9})
        total += flops
    params = sum(p.numel() for p in codec.decoder.parameters())
    kv_elems = sum(2 * m.cfg.num_layers * m.window * m.cfg.d_model for m in codec.decoder
                   if isinstance(m, ProjectedTransformer))
    return {"flop_per_audio_s": total, "gflop_per_audio_s": total / 1e9, "stages": stages,
            "decoder_params": params, "kv_elems_per_stream": kv_elems}


def floor_s(model: dict, audio_s: float, streams: int, elt: int, streaming: bool, peak_flops: float,
            peak_bw: float) -> dict:
    flops = audio_s * model["flop_per_audio_s"]
    nbytes = model["decoder_params"] * elt + (2 * streams * model["kv_elems_per_stream"] * elt if streaming else 0)
    t_flop, t_bw = flops / peak_flops, nbytes / peak_bw
    return {"flop": flops, "bytes": nbytes, "t_flop_ms": t_flop * 1e3, "t_bytes_ms": t_bw * 1e3,
            "floor_ms": max(t_flop, t_bw) * 1e3, "bound": "compute" if t_flop >= t_bw else "bandwidth"}


# ---- timing ----------------------------------------------------------------------------------------

def timed(fn, iters: int, warmup: int, sync) -> dict:
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return {"median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3,
            "iters": iters}


def git_revision(override: str | None = None) -> dict:
    """chorus.provenance.git_revision, with --git-rev taking the place of CHORUS_GIT_REV."""
    if override:
        return {"revision": override, "dirty": None, "source": "flag"}
    return provenance.git_revision()


# ---- the window-attention kernel ---------------------------------------------------------------------

def window_attention_check(device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                           iters: int = 20, tol: float = 1e-2) -> dict:
    """The Triton ring-window attention against the torch path (ring gather + masked SDPA) at one realistic
    shape: B=4, H=12, D=64, W=400 (the 50-400 Hz stages), Tk=800 (a 25-frame step at the 400 Hz stage),
    offsets 0 / 137 / 2000 / 137 (fresh, partial window, wrapped ring). Inputs are laid out as the decoder
    makes them (v a strided view of the fused projection, rows out of order among 8 ring rows). Reports the
    max abs diff kernel vs torch in `dtype`, and both against the torch path in fp32 on the same (rounded)
    inputs, plus the time of each path."""
    B, H, D, W, TK, R = 4, 12, 64, 400, 800, 8
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, TK, 3, H, D, generator=gen).to(device, dtype).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0].contiguous(), qkv[1].contiguous(), qkv[2]
    kc = torch.randn(R, H, W, D, generator=gen).to(device, dtype)
    vc = torch.randn(R, H, W, D, generator=gen).to(device, dtype)
    rows = torch.tensor([5, 0, 3, 6], device=device)
    offset = torch.tensor([0, 137, 2000, 137], device=device)
    args = (q, k, v, kc, vc, rows, offset, W)
    kern = wa.window_attention(*args, impl="triton")
    ref = wa.window_attention(*args, impl="torch")
    ref32 = wa.window_attention(*(t.float() for t in (q, k, v, kc, vc)), rows, offset, W, impl="torch")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    diff = (kern.float() - ref.float()).abs().max().item()
    out = {"shape": {"B": B, "H": H, "D": D, "W": W, "Tk": TK, "offsets": offset.tolist()}, "dtype": str(dtype),
           "max_abs_diff_kernel_vs_torch": diff,
           "max_abs_diff_kernel_vs_fp32": (kern.float() - ref32).abs().max().item(),
           "max_abs_diff_torch_vs_fp32": (ref.float() - ref32).abs().max().item(),
           "max_abs_ref": ref32.abs().max().item(), "finite": bool(torch.isfinite(kern).all()), "tol": tol}
    out["ok"] = out["finite"] and diff <= tol
    for impl in ("triton", "torch"):
        out[f"{impl}_ms"] = timed(lambda: wa.window_attention(*args, impl=impl), iters, warmup=2,
                                  sync=sync)["median_ms"]
    return out


# ---- main --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="codec shapes (random weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                    help="compute dtype (weights are built in it; the quantizer stays fp32)")
    ap.add_argument("--n-q", type=int, default=12, help="codebooks per frame (MOSS-TTS Local: 12)")
    ap.add_argument("--streams", default=None,
                    help="stream counts for streaming and offline (default 1,8,16,32,64; CPU 1,4)")
    ap.add_argument("--chunk", type=int, default=25, help="steady streaming step, frames")
    ap.add_argument("--first-chunk", type=int, default=5, help="first-chunk step, frames")
    ap.add_argument("--offline-frames", type=int, default=None, help="default 100 (CPU 20)")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per case (default 10 GPU, 2 CPU)")
    ap.add_argument("--latency-iters", type=int, default=None, help="timed first-chunk runs (default 30 GPU, 3 CPU)")
    ap.add_argument("--no-graphs", action="store_true", help="streaming steps eager only, no CUDA graphs")
    ap.add_argument("--attention", default="auto", choices=["auto", "triton", "torch"],
                    help="SlotDecoder window attention: Triton kernel (auto on CUDA) or torch (masked SDPA)")
    ap.add_argument("--glue", default="auto", choices=["auto", "triton", "torch"],
                    help="SlotDecoder elementwise glue: fused Triton kernels (auto: on CUDA, self-tested) or torch")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and codes")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="dense peak of the compute dtype")
    ap.add_argument("--peak-tbps", type=float, default=4.3, help="achievable memory bandwidth, TB/s")
    ap.add_argument("--out", default=None, metavar="JSON", help="write the results here")
    ap.add_argument("--git-rev", default=os.environ.get("CHORUS_GIT_REV"),
                    help="revision to record when the tree has no .git (env CHORUS_GIT_REV)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    cuda = device.type == "cuda"
    iters = args.iters or (10 if cuda else 2)
    lat_iters = args.latency_iters or (30 if cuda else 3)
    streams = sorted({int(s) for s in (args.streams or ("1,8,16,32,64" if cuda else "1,4")).split(",") if s.strip()})
    if args.offline_frames is None:
        args.offline_frames = 100 if cuda else 20
    max_streams = streams[-1]
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    graphs = cuda and not args.no_graphs

    res: dict = {"status": "running", "preset": args.preset, "device": device_name(device),
                 "device_type": device.type, "dtype": args.dtype, "torch": torch.__version__,
                 "cuda": torch.version.cuda, "git": git_revision(args.git_rev), "python": platform.python_version(),
                 "args": vars(args), "graphs": graphs, "streaming": [], "first_chunk": {}, "offline": [],
                 "checks": {}, "errors": []}
    t_start = time.perf_counter()

    def save() -> None:
        res["elapsed_s"] = round(time.perf_counter() - t_start, 2)
        if cuda:
            res["max_memory_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
        write_json(args.out, res)

    def section(name: str, fn) -> None:
        log(f"--- {name}")
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - record it, keep the rest of the run
            log(f"{name} FAILED: {e!r}")
            res["errors"].append({"section": name, "error": repr(e), "trace": traceback.format_exc()[-4000:]})
        save()

    log(f"device {res['device']}, torch {torch.__version__}, cuda {torch.version.cuda}, preset {args.preset}, "
        f"dtype {args.dtype}, streams {streams}, chunk {args.chunk}, first {args.first_chunk}, graphs {graphs}")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    codec = build_codec(PRESETS[args.preset](), seed=args.seed, dtype=dtype, device=device)
    sync()
    res["build_s"] = round(time.perf_counter() - t0, 2)
    model = cost_model(codec)
    elt = torch.empty((), dtype=dtype).element_size()
    fr = codec.config.frame_rate
    res["floor"] = {"peak_tflops": args.peak_tflops, "peak_tbps": args.peak_tbps,
                    "gflop_per_audio_s": model["gflop_per_audio_s"], "stages": model["stages"],
                    "decoder_params": model["decoder_params"],
                    "weight_bytes_per_step": model["decoder_params"] * elt,
                    "kv_bytes_per_stream": model["kv_elems_per_stream"] * elt}
    log(f"built in {res['build_s']} s: decoder {model['decoder_params'] / 1e6:.1f} M params, "
        f"{model['gflop_per_audio_s']:.1f} GFLOP per audio second, "
        f"weights {model['decoder_params'] * elt / 1e9:.3f} GB/step, KV {model['kv_elems_per_stream'] * elt / 1e6:.1f} "
        f"MB/stream")
    peak_f, peak_b = args.peak_tflops * 1e12, args.peak_tbps * 1e12

    decoder = SlotDecoder(codec, slots=max_streams, n_q=args.n_q, compute_dtype=dtype,
                           graphs=graphs, graph_frames=[args.chunk, args.first_chunk] if graphs else [],
                           attention=args.attention, glue=args.glue)
    res["slot_decoder"] = {"slots": decoder.slots, "buckets": list(decoder.buckets), "scratch_rows": decoder.scratch,
                      "state_gb": round(decoder.state_nbytes() / 1e9, 3), "residual_dtype": str(decoder.residual_dtype),
                      "attention": args.attention,
                      "attention_kernel": wa.kernel_selected(dtype, device, 64, args.attention),
                      "glue": args.glue, "glue_impl": decoder.glue_impl, "glue_fallback": decoder.glue_fallback}
    log(f"decoder: attention kernel {res['slot_decoder']['attention_kernel']} ({args.attention}), "
        f"glue {decoder.glue_impl} ({args.glue})"
        + (f"; glue self-test FAILED, torch fallback: {decoder.glue_fallback}" if decoder.glue_fallback else ""))
    save()
    gen = torch.Generator().manual_seed(args.seed + 1)

    def codes(b: int, t: int) -> torch.Tensor:
        return torch.randint(0, codec.codebook_size, (args.n_q, b, t), generator=gen)

    def stream_case(n: int, t: int, graphed: bool, n_iters: int, to_cpu: bool = False,
                    bucket: int | None = None) -> dict:
        slots = [decoder.acquire() for _ in range(n)]
        try:
            chunk = codes(n, t)
            batch = {s: chunk[:, i] for i, s in enumerate(slots)}
            last = {}

            def run() -> None:
                if to_cpu:  # as the service steps: PCM16 wire bytes through the pinned staging buffer
                    last["out"] = decoder.step_pcm(batch, int16=list(batch), eager=not graphed, bucket=bucket)
                else:
                    last["out"] = decoder.step(batch, eager=not graphed, bucket=bucket)

            r = timed(run, n_iters, warmup=2, sync=sync)
            used = decoder.last_step_graphed
            finite = to_cpu or all(bool(torch.isfinite(v).all()) for v in last["out"].values())
        finally:
            for s in slots:
                decoder.release(s)
        audio = n * t / fr
        fl = floor_s(model, audio, n, elt, True, peak_f, peak_b)
        r.update({"streams": n, "frames": t, "bucket": decoder.bucket_for(max(n, bucket or 0)), "graphed": used,
                  "to_cpu": to_cpu,
                  "audio_s_per_step": audio, "audio_s_per_s": audio / (r["median_ms"] / 1e3),
                  "rtf": (r["median_ms"] / 1e3) / audio, "finite": finite, "floor": fl,
                  "efficiency": fl["floor_ms"] / r["median_ms"]})
        log(f"stream n={n:3d} T={t:3d} bucket {r['bucket']:3d} {'graph' if used else 'eager'}"
            f"{' +PCM16 to host' if to_cpu else ''}: "
            f"{r['median_ms']:8.2f} ms/step  {r['audio_s_per_s']:9.1f} audio s/s  floor {fl['floor_ms']:.2f} ms "
            f"({fl['bound']})  eff {r['efficiency'] * 100:.1f}%")
        return r

    # ---- checks first: cheap, and they say whether the numbers mean anything ----
    if cuda:
        def attention_kernel() -> None:
            if not wa.HAVE_TRITON:
                res["checks"]["window_attention"] = {"skipped": "triton is not installed"}
                log("check window attention kernel: SKIPPED (no triton)")
                return
            c = res["checks"]["window_attention"] = window_attention_check(device, torch.bfloat16, seed=args.seed)
            log(f"check window attention kernel (bf16, B=4 H=12 D=64 W=400 Tk=800, offsets 0/137/2000): "
                f"max abs diff kernel vs torch {c['max_abs_diff_kernel_vs_torch']:.3e} "
                f"(kernel vs fp32 {c['max_abs_diff_kernel_vs_fp32']:.3e}, torch vs fp32 "
                f"{c['max_abs_diff_torch_vs_fp32']:.3e}) {'OK' if c['ok'] else 'FAIL'}; "
                f"triton {c['triton_ms']:.3f} ms, torch {c['torch_ms']:.3f} ms; decoder glue {decoder.glue_impl}")
            if not c["ok"]:
                raise RuntimeError(f"window attention kernel disagrees with the torch path: {c}")

        section("window attention kernel", attention_kernel)

    def checks() -> None:
        c = res["checks"]
        x = codes(1, 3 * args.first_chunk)
        ref = codec.decode(x)[0].float()
        out = decoder.decode_stream(x[:, 0], [args.first_chunk] * 3,
                                    step=lambda b: decoder.step(b, eager=True)).float()
        diff = (out - ref).abs().max().item()
        c["slots_vs_offline"] = {"frames": x.shape[2], "max_abs_diff": diff, "max_abs_ref": ref.abs().max().item(),
                                   "rel_max_abs_diff": diff / max(1e-30, ref.abs().max().item()),
                                   "rel_l2": ((out - ref).norm() / ref.norm()).item(),
                                   "note": "decoder (residual fp32 when bf16) vs codec.decode in the codec dtype"}
        log(f"check decoder vs offline: rel max abs diff {c['slots_vs_offline']['rel_max_abs_diff']:.2e}, "
            f"rel l2 {c['slots_vs_offline']['rel_l2']:.2e}")
        # batch independence: stream 0 next to other streams with other codes, same bucket -> same bytes
        n = min(3, max_streams)
        if n >= 2:
            x0, x1 = codes(n, args.first_chunk), codes(n, args.first_chunk)
            sl = [decoder.acquire() for _ in range(n)]
            try:
                a = decoder.step({s: x0[:, i] for i, s in enumerate(sl)}, eager=True)[sl[0]]
                for s in sl:
                    decoder.reset(s)
                b = decoder.step({s: (x0 if i == 0 else x1)[:, i] for i, s in enumerate(sl)}, eager=True)[sl[0]]
                decoder.reset(sl[0])
                alone = decoder.step({sl[0]: x0[:, 0]}, eager=True)[sl[0]]
            finally:
                for s in sl:
                    decoder.release(s)
            c["batch_independence_same_bucket_bitwise"] = bool(torch.equal(a, b))
            c["alone_vs_batched_max_abs_diff"] = (a.float() - alone.float()).abs().max().item()
            log(f"check batch independence (bucket {decoder.bucket_for(n)}): bitwise "
                f"{c['batch_independence_same_bucket_bitwise']}; alone (bucket 1) vs batched max abs diff "
                f"{c['alone_vs_batched_max_abs_diff']:.3e}")

    section("checks", checks)

    def latency_eager() -> None:
        res["first_chunk"]["eager"] = stream_case(1, args.first_chunk, False, lat_iters, to_cpu=True)

    section("first-chunk latency (eager)", latency_eager)

    def offline() -> None:
        for n in streams:
            x = codes(n, args.offline_frames)
            xd = x.to(device)
            last = {}

            def run() -> None:
                last["out"] = codec.decode(xd)

            r = timed(run, max(1, min(iters, 3)), warmup=1, sync=sync)
            audio = n * args.offline_frames / fr
            fl = floor_s(model, audio, n, elt, False, peak_f, peak_b)
            r.update({"streams": n, "frames": args.offline_frames, "audio_s": audio,
                      "audio_s_per_s": audio / (r["median_ms"] / 1e3), "finite": bool(torch.isfinite(last["out"]).all()),
                      "floor": fl, "efficiency": fl["floor_ms"] / r["median_ms"]})
            last.clear()
            res["offline"].append(r)
            log(f"offline n={n:3d} x {args.offline_frames} frames: {r['median_ms']:8.2f} ms  "
                f"{r['audio_s_per_s']:9.1f} audio s/s  floor {fl['floor_ms']:.2f} ms  eff {r['efficiency'] * 100:.1f}%")
            save()

    section("offline decode", offline)

    def streaming_eager() -> None:
        for n in sorted({streams[0], max_streams}):
            r = stream_case(n, args.chunk, False, max(1, iters // 2))
            res["streaming"].append(r)
            save()

    section("streaming (eager)", streaming_eager)

    if graphs:
        def capture() -> None:
            t = time.perf_counter()
            buckets = sorted({decoder.bucket_for(n) for n in streams}, reverse=True)
            decoder.capture(buckets=buckets, frames=[args.chunk])
            decoder.capture(buckets=[1], frames=[args.first_chunk])
            sync()
            res["capture"] = {"graphs": [list(k) for k in decoder.captured], "seconds": round(time.perf_counter() - t, 2),
                              "disabled": decoder.graphs_disabled}
            log(f"captured {len(decoder.captured)} graphs in {res['capture']['seconds']} s"
                + (f"; DISABLED: {decoder.graphs_disabled}" if decoder.graphs_disabled else ""))

        section("graph capture", capture)

        def latency_graphed() -> None:
            res["first_chunk"]["graphed"] = stream_case(1, args.first_chunk, True, lat_iters, to_cpu=True)

        section("first-chunk latency (graphed)", latency_graphed)

        def streaming_graphed() -> None:
            for n in streams:
                res["streaming"].append(stream_case(n, args.chunk, True, iters))
                save()
            res["streaming"].append(stream_case(max_streams, args.chunk, True, max(1, iters // 2), to_cpu=True))

        section("streaming (graphed)", streaming_graphed)

        def graph_parity() -> None:
            # the same codes through a graphed and an eager step from identical (fresh) states
            x = codes(1, args.first_chunk + args.chunk)
            parts = [args.first_chunk, args.chunk]
            g = decoder.decode_stream(x[:, 0], parts)
            e = decoder.decode_stream(x[:, 0], parts, step=lambda b: decoder.step(b, eager=True))
            res["checks"]["graph_vs_eager_bitwise"] = bool(torch.equal(g, e))
            res["checks"]["graph_vs_eager_max_abs_diff"] = (g.float() - e.float()).abs().max().item()
            log(f"check graph vs eager: bitwise {res['checks']['graph_vs_eager_bitwise']}, max abs diff "
                f"{res['checks']['graph_vs_eager_max_abs_diff']:.3e}")

        section("graph parity", graph_parity)

    def single_bucket() -> None:
        top = decoder.buckets[-1]
        sb = res["single_bucket"] = {"bucket": top, "cases": []}
        for t, to_cpu in ((args.first_chunk, True), (args.chunk, False)):
            for b in (1, top):
                r = stream_case(1, t, graphs, lat_iters if to_cpu else iters, to_cpu=to_cpu, bucket=b)
                sb["cases"].append(r)
                save()
        # one stream padded to the top bucket vs batched there with others, and vs bucket 1
        n = min(3, max_streams)
        x, y = codes(n, args.first_chunk), codes(n, args.first_chunk)
        sl = [decoder.acquire() for _ in range(n)]
        try:
            batched = decoder.step({s: (x if i == 0 else y)[:, i] for i, s in enumerate(sl)}, bucket=top)[sl[0]]
            decoder.reset(sl[0])
            padded = decoder.step({sl[0]: x[:, 0]}, bucket=top)[sl[0]]
            decoder.reset(sl[0])
            alone = decoder.step({sl[0]: x[:, 0]})[sl[0]]
        finally:
            for s in sl:
                decoder.release(s)
        sb["padded_vs_batched_bitwise"] = bool(torch.equal(padded, batched))
        sb["bucket1_vs_top_max_abs_diff"] = (alone.float() - padded.float()).abs().max().item()
        log(f"check single bucket {top}: padded == batched bitwise {sb['padded_vs_batched_bitwise']}; "
            f"bucket 1 vs {top} max abs diff {sb['bucket1_vs_top_max_abs_diff']:.3e}")

    section("single bucket (bucket-invariant serving)", single_bucket)

    # ---- summary table ----
    rows = [("case", "streams", "T", "path", "ms", "audio s/s", "floor ms", "eff %")]
    for name, r in ([("first-chunk", v) for v in res["first_chunk"].values()]
                    + [("streaming", r) for r in res["streaming"]]
                    + [("1-bucket", r) for r in res.get("single_bucket", {}).get("cases", [])]):
        path = ("graph" if r["graphed"] else "eager") + ("+PCM16" if r["to_cpu"] else "") + f"@B{r['bucket']}"
        rows.append((name, r["streams"], r["frames"], path,
                     f"{r['median_ms']:.2f}", f"{r['audio_s_per_s']:.1f}", f"{r['floor']['floor_ms']:.2f}",
                     f"{r['efficiency'] * 100:.1f}"))
    for r in res["offline"]:
        rows.append(("offline", r["streams"], r["frames"], "eager", f"{r['median_ms']:.2f}",
                     f"{r['audio_s_per_s']:.1f}", f"{r['floor']['floor_ms']:.2f}", f"{r['efficiency'] * 100:.1f}"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    print("\n".join("  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in rows), flush=True)
    res["status"] = "ok" if not res["errors"] else "partial"
    save()
    log(f"done in {res['elapsed_s']} s, status {res['status']}" + (f", json {args.out}" if args.out else ""))
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
