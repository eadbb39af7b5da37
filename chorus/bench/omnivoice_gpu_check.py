"""OmniVoice on one GPU in one command: the Triton and flashinfer attention against the torch reference,
graphed against eager steps (same tokens at equal batch), fp16 against fp32 (share of equal
cells), and the packed step's time eager and graphed at several batches against the FLOP floor.
Full-size dummy weights, O1 canvases (~25 English words, 6 s, 32 steps, guidance 2). Not a CI
test: CI has no GPU.

    python -m chorus.bench.omnivoice_gpu_check --out benchmarks/results/omnivoice_gpu_check.json

Prints a line per stage as it goes (flashinfer JIT-compiles each kernel on first use: 15-130 s),
then one JSON. A stage that fails is recorded with its error and the run goes on; the exit
status is 1 when any stage failed or a parity check did not hold.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[omnivoice-gpu-check {time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chorus.bench.omnivoice_gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention", default="auto", choices=("auto", "flashinfer", "triton"),
                   help="the engines' attention backend (gpu_worker/omnivoice/attention.py; auto: the worker's)")
    p.add_argument("--parity-batches", default="1,4,16", help="canvas counts of the graphed-vs-eager check")
    p.add_argument("--bench-batches", default="1,8,16,32", help="canvas counts of the step timing")
    p.add_argument("--agreement-batch", type=int, default=4, help="canvases of the fp16-vs-fp32 check")
    p.add_argument("--num-step", type=int, default=32, help="unmasking steps per canvas")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per batch after one warm-up run")
    p.add_argument("--torch-baseline", action="store_true", help="also time the eager torch-attention step")
    p.add_argument("--unfused", action="store_true",
                   help="also time graphed steps without the Triton norm/SiLU kernels (torch ops)")
    p.add_argument("--profile-batch", type=int, default=32, help="canvases of the profiled graphed steps (0: none)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense fp16 matrix rate (floor)")
    p.add_argument("--out", default=None, help="write the JSON here too")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run what needs no GPU on the CPU with the tiny preset and torch attention (tests the script)")
    args = p.parse_args(argv)

    report: dict = {"bench": "omnivoice_gpu_check", "stages": {}, "failed": []}

    def stage(name: str, fn):
        say(f"{name} ...")
        t = time.perf_counter()
        try:
            result = fn()
            report["stages"][name] = result
            say(f"{name} done in {time.perf_counter() - t:.1f} s: {json.dumps(result, default=str)[:400]}")
            return result
        except Exception as e:  # noqa: BLE001 - record it and go on
            traceback.print_exc()
            report["stages"][name] = {"error": f"{type(e).__name__}: {e}"}
            report["failed"].append(name)
            say(f"{name} FAILED: {type(e).__name__}: {e}")
            return None

    import numpy as np
    import torch

    from chorus.bench.common import device_name, write_json
    from chorus.bench.omnivoice_step import O1_TEXT, step_flops, step_ms
    from chorus.omnivoice.knobs import FRAME_RATE, UnmaskKnobs
    from chorus.omnivoice.prompt import plan_pieces
    from chorus.omnivoice.tokenizer import load_omnivoice_tokenizer
    from chorus.provenance import git_revision
    from gpu_worker.omnivoice.engine import CanvasEngine, CanvasSpec
    from gpu_worker.omnivoice.loader import build_omnivoice

    dry = args.cpu_dry_run
    if not torch.cuda.is_available() and not dry:
        say("no CUDA device: nothing to check")
        return 1
    dev = torch.device("cpu" if dry else "cuda")
    sync = (lambda: None) if dry else torch.cuda.synchronize
    attention = "torch" if dry else args.attention
    report.update(device=device_name(dev), git=git_revision(), torch=torch.__version__, peak_tflops=args.peak_tflops)

    def import_flashinfer():
        import flashinfer
        return {"version": getattr(flashinfer, "__version__", "?")}

    if not dry and stage("import flashinfer", import_flashinfer) is None:
        return finish(report, args.out, write_json)

    def attention_vs_reference():
        from gpu_worker.omnivoice.attention import FlashInferDocuments
        from gpu_worker.omnivoice.model import document_attention

        say("  (first use JIT-compiles flashinfer's ragged prefill kernel: 15-130 s)")
        fi = FlashInferDocuments(16, 8, 128, torch.float16, dev)
        doc_lens = [248, 212, 7, 1, 300, 36 + 212, 212]
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(sum(doc_lens), 16, 128, device=dev, dtype=torch.float16, generator=g)
        k, v = (torch.randn(sum(doc_lens), 8, 128, device=dev, dtype=torch.float16, generator=g) for _ in range(2))
        got = fi.plan(doc_lens)(q, k, v).float()
        exact = document_attention(q.float(), k.float(), v.float(), doc_lens)
        sdpa16 = document_attention(q, k, v, doc_lens).float()
        out = {"max_abs_err_flashinfer": (got - exact).abs().max().item(),
               "max_abs_err_torch_fp16": (sdpa16 - exact).abs().max().item()}
        from chorus.triton_support import HAVE_TRITON
        if HAVE_TRITON:
            from gpu_worker.omnivoice.attention import TritonDocuments
            tr = TritonDocuments(16, 8, 128, torch.float16, dev)
            packed = tr.plan(doc_lens)(q, k, v)
            start = sum(doc_lens[:4])
            doc = slice(start, start + doc_lens[4])  # the 300-row document
            alone = tr.plan(doc_lens[4:5])(q[doc], k[doc], v[doc])
            out.update(max_abs_err_triton=(packed.float() - exact).abs().max().item(),
                       triton_document_alone_equals_packed=bool(torch.equal(packed[doc], alone)))
        return out

    if not dry:
        stage("attention vs fp32 reference", attention_vs_reference)

    tok = load_omnivoice_tokenizer(None)
    piece = plan_pieces(tok, O1_TEXT, language="en")[0]
    prefix, target = len(piece.text_ids), piece.target_frames
    knobs = UnmaskKnobs(num_step=args.num_step, guidance_scale=2.0)
    batches = sorted({int(b) for b in (args.parity_batches + "," + args.bench_batches).split(",")} |
                     {args.agreement_batch} | ({args.profile_batch} if args.profile_batch else set()))
    top = max(batches)
    max_rows = top * (prefix + 2 * target)
    report.update(prefix_rows=prefix, target_frames=target, num_step=args.num_step, guidance_scale=2.0)

    say("building the full-size dummy model (fp16)")
    model = build_omnivoice(preset="tiny" if dry else "full", load_format="dummy", dtype="float32" if dry else "float16",
                            device=str(dev))
    engines: dict[str, CanvasEngine] = {}

    def build(name: str, **kw) -> CanvasEngine:
        e = CanvasEngine(kw.pop("model", model), max_batch=top, max_packed_rows=max_rows, **kw)
        engines[name] = e
        return e

    def warm_eager():
        e = build("eager", attention=attention, cuda_graphs=False)
        return {"seconds": round(e.warm_up(), 1), "attention": e.attention.name}

    stage("eager engine warm-up", warm_eager)

    def warm_graphed():
        e = build("graphed", attention=attention, cuda_graphs=True)
        if e.bucketed is None:
            del engines["graphed"]
            raise RuntimeError("no bucketed forward (triton or flashinfer on CUDA expected)")
        n = len(e.bucketed.buckets.all())
        say(f"  capturing {n} step graphs (rows buckets {e.bucketed.buckets.rows}, document buckets "
            f"{e.bucketed.buckets.docs})")
        seconds = e.warm_up(capture=True)
        if e.bucketed.disabled:
            raise RuntimeError(e.bucketed.disabled)
        return {"seconds": round(seconds, 1), "graphs": len(e.bucketed.graphs),
                "left_out": {f"{b.rows}x{b.docs}": why for b, why in e.bucketed.unusable.items()},
                "memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if not dry else None}

    stage("graphed engine warm-up and capture", warm_graphed)

    def generate(engine: CanvasEngine, batch: int, first_id: int = 0) -> list[np.ndarray]:
        for i in range(batch):
            engine.start(CanvasSpec(first_id + i, np.asarray(piece.text_ids), None, target, knobs, seed=i))
        codes = {}
        for k in range(args.num_step):
            for o in engine.step([(first_id + i, k) for i in range(batch)]):
                if o.finished:
                    codes[o.request_id - first_id] = o.codes
        sync()
        return [codes[i] for i in range(batch)]

    def compare(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
        equal = sum(int((x == y).sum()) for x, y in zip(a, b))
        cells = sum(x.size for x in a)
        return {"canvases_identical": sum(bool(np.array_equal(x, y)) for x, y in zip(a, b)), "canvases": len(a),
                "cell_agreement": round(equal / cells, 5)}

    parity_ok = True
    if "graphed" in engines and "eager" in engines:
        def parity():
            nonlocal parity_ok
            rows = {}
            for b in [int(x) for x in args.parity_batches.split(",")]:
                runs = engines["graphed"].bucketed.runs
                got = generate(engines["graphed"], b)
                graphed_steps = engines["graphed"].bucketed.runs - runs
                rows[b] = compare(got, generate(engines["eager"], b)) | {"graphed_steps": graphed_steps}
                parity_ok &= rows[b]["canvases_identical"] == b and graphed_steps == args.num_step
                say(f"  batch {b}: {rows[b]}")
            return rows

        stage("graphed vs eager tokens", parity)

    def agreement():
        model32 = copy.deepcopy(model).float()
        e32 = build("fp32", model=model32, attention="torch", cuda_graphs=False)
        b = args.agreement_batch
        ref = generate(e32, b)
        out = {"fp16_eager": compare(generate(engines["eager"], b), ref)} if "eager" in engines else {}
        if "graphed" in engines:
            out["fp16_graphed"] = compare(generate(engines["graphed"], b), ref)
        # One step's logits on the same input (whole canvases diverge once one reveal differs).
        from gpu_worker.omnivoice.packing import Document, layout
        lay = layout([Document(prefix, target, True)] * b)
        g = torch.Generator(device=dev).manual_seed(1)
        ids = torch.randint(0, 1024, (8, lay.rows), device=dev, generator=g)
        mask = torch.ones(lay.rows, dtype=torch.bool, device=dev)
        args16 = (ids, mask, lay.positions.to(dev), lay.doc_lens, lay.gather.to(dev))
        with torch.inference_mode():
            l16 = model(*args16, engines["eager"].attention if "eager" in engines else None)
            l32 = model32(*args16)
        out["first_step_logits"] = {"argmax_agreement": round((l16.argmax(-1) == l32.argmax(-1)).float().mean().item(), 5),
                                    "max_abs_diff": (l16 - l32).abs().max().item(), "max_abs": l32.abs().max().item()}
        del engines["fp32"], e32, model32
        if not dry:
            torch.cuda.empty_cache()
        return out

    stage("fp16 vs fp32 agreement", agreement)

    def fused_vs_torch():
        from gpu_worker.omnivoice import model as model_module
        from gpu_worker.omnivoice.packing import Document, layout

        if not model_module.fused(torch.zeros(1, dtype=model.llm.norm.weight.dtype, device=dev)):
            return {"skipped": "no triton here: the torch ops run"}
        docs = [Document(prefix, target, True)] * 2
        lay = layout(docs)
        g = torch.Generator(device=dev).manual_seed(0)
        ids = torch.randint(0, 1024, (8, lay.rows), device=dev, generator=g)
        mask = torch.ones(lay.rows, dtype=torch.bool, device=dev)
        with torch.inference_mode():
            fused = model(ids, mask, lay.positions.to(dev), lay.doc_lens, lay.gather.to(dev))
            model_module.KERNELS = "torch"
            try:
                plain = model(ids, mask, lay.positions.to(dev), lay.doc_lens, lay.gather.to(dev))
            finally:
                model_module.KERNELS = "auto"
        return {"max_abs_diff": (fused - plain).abs().max().item(), "max_abs": plain.abs().max().item(),
                "argmax_agreement": (fused.argmax(-1) == plain.argmax(-1)).float().mean().item()}

    stage("fused kernels vs torch ops (logits)", fused_vs_torch)

    def unmask_kernel_vs_torch():
        import numpy as np_

        from gpu_worker.omnivoice import unmask_kernel
        from gpu_worker.omnivoice.batched_unmask import _scores

        if not unmask_kernel.usable(torch.zeros(1, 1, 1, device=dev)):
            return {"skipped": "no compiled triton here: the torch scoring runs"}
        g = torch.Generator(device=dev).manual_seed(1)
        c, v, t, canvases = 8, model.cfg.audio_vocab_size, target, 8
        n = t * canvases
        logits = (torch.randn(2 * n, c, v, device=dev, generator=g) * 4).transpose(0, 1)  # the head's layout
        cond = torch.arange(n, device=dev)
        uncond = cond + n
        ones = torch.ones(n, device=dev)
        noise = -torch.log(-torch.log(torch.rand(c, n, device=dev, generator=g) + 1e-10) + 1e-10)
        canvas = torch.full((c, n), v - 1, device=dev)

        class Column:
            def __init__(self, col, ucol):
                self.cond_column, self.uncond_column = col, ucol
        items = [Column(i * t, n + i * t) for i in range(canvases)]
        got_codes, got = unmask_kernel.scores(logits, cond, uncond, 2 * ones, 5 * ones, ones, noise, canvas, v - 1)
        codes, want = _scores(logits, items, np_.arange(canvases) * t, [t] * canvases, list(range(canvases)), cond,
                              uncond, cond, 2 * ones, 5 * ones, ones, noise, canvas, v - 1)
        # the worker hands the kernel the head's fp16 logits: same cells from them as from an fp32 copy
        half = logits.half()
        codes16, _ = unmask_kernel.scores(half, cond, uncond, 2 * ones, 5 * ones, ones, noise, canvas, v - 1)
        codes32, _ = unmask_kernel.scores(half.float(), cond, uncond, 2 * ones, 5 * ones, ones, noise, canvas, v - 1)
        # a program's warps, timed at 32 canvases' cells (the worker launches with the default 4)
        big = 32 // canvases
        wide = torch.cat([half] * big, dim=1)  # [C, 2 n big, V]: every cell's cond and uncond rows
        cols = torch.arange(n * big, device=dev)
        args = (cols, cols + n * big, 2 * ones.repeat(big), 5 * ones.repeat(big), ones.repeat(big),
                noise.repeat(1, big), canvas.repeat(1, big), v - 1)
        warps_us = {}
        for w in (1, 2, 4, 8):
            unmask_kernel.scores(wide, *args, num_warps=w)  # compiles
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                unmask_kernel.scores(wide, *args, num_warps=w)
            end.record()
            end.synchronize()
            warps_us[w] = round(start.elapsed_time(end) * 100, 1)
        return {"cells": c * n, "code_agreement": (got_codes == codes).float().mean().item(),
                "score_max_abs_diff": (got - want).abs().max().item(),
                "scores_equal_share": (got == want).float().mean().item(),
                "fp16_read_equals_fp32_copy": bool(torch.equal(codes16, codes32)),
                "us_at_32_canvases_by_num_warps": warps_us}

    stage("unmask kernel vs torch scoring", unmask_kernel_vs_torch)

    def step_bench():
        flops1 = step_flops(model.cfg, prefix, target, True)
        rows = []
        kinds = [k for k in ("eager", "graphed") if k in engines]
        if args.torch_baseline:
            build("torch", attention="torch", cuda_graphs=False)
            kinds.insert(0, "torch")
        if args.unfused and not dry:
            from gpu_worker.omnivoice import model as model_module
            model_module.KERNELS = "torch"  # read at capture: these graphs hold the torch ops
            try:
                build("unfused", attention=attention, cuda_graphs=True).warm_up()
            finally:
                model_module.KERNELS = "auto"
            kinds.append("unfused")
        for b in [int(x) for x in args.bench_batches.split(",")]:
            row = {"batch": b, "floor_ms": round(b * flops1 / (args.peak_tflops * 1e12) * 1000, 3)}
            for kind in kinds:
                e = engines[kind]

                step_ms(e, piece.text_ids, target, knobs, b, sync)  # warm-up
                ms = min(step_ms(e, piece.text_ids, target, knobs, b, sync) for _ in range(args.repeats))
                row[f"{kind}_step_ms"] = round(ms, 3)
                row[f"{kind}_x_floor"] = round(ms / row["floor_ms"], 2)
                row[f"{kind}_audio_s_per_s"] = round(b * target / FRAME_RATE / (ms * args.num_step / 1000), 1)
            if "graphed" in engines and engines["graphed"].bucketed is not None:
                row["graphed_forward_ms"] = forward_ms(engines["graphed"], b)
            rows.append(row)
            say(f"  {row}")
        return rows

    def forward_ms(e: CanvasEngine, b: int) -> float | None:
        """GPU time of one replay of the graph a b-canvas step runs in (the forward to the final norm)."""
        from chorus.bench.common import replay_ms
        bucket = e.bucketed.buckets.pick(b * (prefix + 2 * target), 2 * b)
        g = e.bucketed.graphs.get(bucket)
        return None if g is None or g.graph is None else round(replay_ms(g.graph, 10), 3)

    stage("step bench", step_bench)

    def profile():
        """Where a graphed step's time goes: GPU time by kernel over 3 steps (graph replays show their
        kernels), and the step's wall time against its GPU time (the host's share)."""
        from collections import defaultdict

        e, b = engines.get("graphed") or engines["eager"], args.profile_batch
        for i in range(b):
            e.start(CanvasSpec(i, np.asarray(piece.text_ids), None, target, knobs, seed=i))
        for k in range(3):
            e.step([(i, k) for i in range(b)])
        sync()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([] if dry else [torch.profiler.ProfilerActivity.CUDA])
        with torch.profiler.profile(activities=activities) as prof:
            t = time.perf_counter()
            for k in range(3, 6):
                e.step([(i, k) for i in range(b)])
            sync()
            wall = (time.perf_counter() - t) * 1000 / 3
        for i in range(b):
            e.release(i)
        by_kernel: dict[str, float] = defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                by_kernel[ev.name[:90]] += (getattr(ev, "device_time", None) or ev.cuda_time) / 1000 / 3
        gpu = sum(by_kernel.values())
        top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:20]
        return {"batch": b, "step_wall_ms": round(wall, 3), "step_gpu_ms": round(gpu, 3),
                "top_kernels_ms_per_step": {k: round(v, 3) for k, v in top}}

    if args.profile_batch and ("graphed" in engines or dry):
        stage("profile of graphed steps", profile)
    report["parity_ok"] = parity_ok
    return finish(report, args.out, write_json)


def finish(report: dict, out: str | None, write_json) -> int:
    ok = not report["failed"] and report.get("parity_ok", False)
    report["ok"] = ok
    print(json.dumps(report, indent=2, default=str), flush=True)
    write_json(out, report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
