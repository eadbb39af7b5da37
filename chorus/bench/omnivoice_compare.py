"""OmniVoice three ways on one GPU, on the same dummy weights and inputs: the `omnivoice` package's
generate() token generation (a list of 1 and of 16 requests), `omnivoice_triton` on the package
when it imports, and Chorus: its packed step in-process (the same token generation), then O1
through the real services end to end (audio out, codec included) at c1 and c32, and O3 at c32.

    python -m chorus.bench.omnivoice_compare --out benchmarks/results/omnivoice_compare_h200.json

The weights are written once, in the package's Hugging Face layout (config.json +
model.safetensors, float16), under --workdir: the package loads them with from_pretrained, the
Chorus worker with --model. Each engine runs in a process of its own, one after the other, so
none holds GPU memory while another runs. The package is timed on `_generate_iterative`, what
generate() runs between its text preprocessing and the codec (its text goes through Chorus's
tokenizer, as the tests' oracle does; torchaudio is stood in for when it does not import).
Writes one JSON: every number, the matrix-rate floor of the packed step at 32 requests, and each
issue-27 target with its measured value.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEXT = ("The quick brown fox jumps over the lazy dog while the morning sun rises slowly "
        "above the quiet hills and the birds begin to sing their songs.")  # O1: ~25 words
SECONDS = 6.0
FRAMES = 150  # 6 s at 25 frames a second
NUM_STEP, GUIDANCE = 32, 2.0


def say(msg: str) -> None:
    print(f"[omnivoice-compare] {msg}", flush=True)


# ---- the weights ---------------------------------------------------------------------------------

def write_checkpoint(directory: Path, seed: int) -> Path:
    """The full-size model with Chorus's dummy weights, float16, in the package's layout."""
    import torch
    from safetensors.torch import save_file

    from gpu_worker.omnivoice.loader import OFFSETS, build_omnivoice

    if (directory / "model.safetensors").is_file() and (directory / "config.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    model = build_omnivoice(preset="full", load_format="dummy", dtype="float16", device="cuda", seed=seed)
    tensors = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}  # fused views: own storage each
    tensors[OFFSETS] = torch.arange(model.cfg.num_codebooks) * model.cfg.audio_vocab_size
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2))
    return directory


# ---- token generation in a child process: the package, omnivoice_triton, Chorus's engine ----------

def _stand_in_torchaudio() -> None:
    """The package imports torchaudio only to resample reference audio, which it is never given here."""
    import importlib.machinery
    import types
    try:
        import torchaudio  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to load: the stand-in
        def refuse(*_a, **_k):
            raise RuntimeError("torchaudio is not available")
        module = types.ModuleType("torchaudio")
        module.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
        module.functional = types.SimpleNamespace(resample=refuse)
        module.load = refuse
        sys.modules["torchaudio"] = module


class _PackageTokenizer:
    """Chorus's tokenizer in the calling convention the package uses on a Hugging Face one."""

    def __init__(self):
        from chorus.omnivoice.tokenizer import load_omnivoice_tokenizer
        self.tokenizer = load_omnivoice_tokenizer(None)

    def __call__(self, text, add_special_tokens=True, return_tensors=None):
        import types

        import torch
        ids = self.tokenizer.encode(text)
        return types.SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)


def _time(fn, repeats: int) -> float:
    import torch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def package_part(ckpt: Path, batches: list[int], repeats: int, triton: bool, device: str = "cuda",
                 frames: int = FRAMES) -> dict:
    import torch

    _stand_in_torchaudio()
    import omnivoice
    mod = omnivoice.models.omnivoice
    out: dict = {"package_version": getattr(omnivoice, "__version__", None)}
    model = mod.OmniVoice.from_pretrained(str(ckpt), train=True, attn_implementation="sdpa")
    model = model.to(device=device, dtype=torch.float16 if device == "cuda" else torch.float32).eval()
    model.text_tokenizer = _PackageTokenizer()
    if triton:
        import omnivoice_triton
        entry = next((getattr(omnivoice_triton, n) for n in ("apply_triton_kernels", "apply_triton", "patch_model",
                                                             "optimize", "apply") if hasattr(omnivoice_triton, n)), None)
        if entry is None:
            return {"skipped": "omnivoice_triton has no known entry point; it exports "
                               f"{sorted(n for n in dir(omnivoice_triton) if not n.startswith('_'))}"}
        out["entry_point"] = entry.__name__
        model = entry(model) or model
    gen = mod.OmniVoiceGenerationConfig(num_step=NUM_STEP, guidance_scale=GUIDANCE)
    for b in batches:
        task = mod.GenerationTask(batch_size=b, texts=[TEXT] * b, target_lens=[frames] * b, langs=["en"] * b,
                                  instructs=[None] * b, ref_texts=[None] * b, ref_audio_tokens=[None] * b,
                                  ref_rms=[None] * b)

        def run():
            with torch.no_grad():
                model._generate_iterative(task, gen)

        s = _time(run, repeats)
        out[f"batch_{b}"] = {"seconds": round(s, 4), "audio_s_per_s": round(b * frames / 25 / s, 1),
                             "ms_per_request": round(s * 1000 / b, 1)}
        say(f"  {'omnivoice_triton' if triton else 'package'} batch {b}: {out[f'batch_{b}']}")
    return out


def engine_part(ckpt: Path, batches: list[int], repeats: int, peak_tflops: float, device: str = "cuda",
                frames: int = FRAMES) -> dict:
    """Chorus's packed step in-process (flashinfer, CUDA graphs): the package's token generation's
    counterpart, and the step at 32 requests against its floor."""
    import numpy as np
    import torch

    from chorus.bench.omnivoice_step import step_flops
    from chorus.omnivoice.knobs import UnmaskKnobs
    from chorus.omnivoice.prompt import plan_pieces
    from chorus.omnivoice.tokenizer import load_omnivoice_tokenizer
    from gpu_worker.omnivoice.engine import CanvasEngine, CanvasSpec
    from gpu_worker.omnivoice.loader import build_omnivoice

    piece = plan_pieces(load_omnivoice_tokenizer(None), TEXT, language="en")[0]
    model = build_omnivoice(model_dir=ckpt, dtype="float16" if device == "cuda" else "float32", device=device)
    top = max(batches)
    engine = CanvasEngine(model, max_batch=top, max_packed_rows=top * (len(piece.text_ids) + 2 * frames))
    warm = engine.warm_up()
    knobs = UnmaskKnobs(num_step=NUM_STEP, guidance_scale=GUIDANCE)
    b = engine.bucketed
    out: dict = {"attention": engine.attention.name, "graphs": None if b is None else (b.disabled or len(b.graphs)),
                 "warm_up_s": round(warm, 1),
                 "prefix_rows": len(piece.text_ids)}
    for b in batches:
        def run():
            for i in range(b):
                engine.start(CanvasSpec(i, np.asarray(piece.text_ids), None, frames, knobs, seed=i))
            for k in range(NUM_STEP):
                engine.step([(i, k) for i in range(b)])

        s = _time(run, repeats)
        floor = b * step_flops(model.cfg, len(piece.text_ids), frames, True) / (peak_tflops * 1e12)
        out[f"batch_{b}"] = {"seconds": round(s, 4), "audio_s_per_s": round(b * frames / 25 / s, 1),
                             "step_ms": round(s * 1000 / NUM_STEP, 3), "floor_step_ms": round(floor * 1000, 3),
                             "x_floor": round(s / NUM_STEP / floor, 2)}
        say(f"  chorus engine batch {b}: {out[f'batch_{b}']}")
    return out


# ---- Chorus through the real services ------------------------------------------------------------

def services_part(ckpt: Path, duration: float, warmup: float, logs: bool, overrides: dict | None = None,
                  extra: tuple[str, ...] = ()) -> dict:
    """overrides: layout tables on top of o1-1gpu's; extra: more chorus bench flags (both for checks
    of this script on the CPU)."""
    from chorus import bench
    from chorus.bench.layouts import resolve
    from chorus.config import merge
    from chorus.processes import free_ports
    from chorus.layout import build

    named = resolve("o1-1gpu")
    layout = build(merge(merge(named.tables, {"omnivoice_worker": {"model": str(ckpt)}}), overrides or {}))
    layout.scheduler.port = 0
    ports = free_ports(1 + layout.cluster.vocoders)  # distinct
    layout.scheduler.metrics_port = ports[0]
    cluster = layout.cluster_launcher(vocoder_metrics_ports=ports[1:])
    cluster.echo = logs
    out: dict = {}
    say("  starting the services (the OmniVoice worker warms up and captures its graphs)")
    with cluster:
        for workload, levels in (("O1", "1,32"), ("O3", "32")):
            args = bench.parse_args(["--server", cluster.address, "--workload", workload, "--concurrency", levels,
                                     "--duration", str(duration), "--warmup", str(warmup), "--no-progress",
                                     "--seed", "1", *extra])
            results = bench.run_bench(args)
            for lv in results["levels"]:
                key = f"{workload}_c{lv['concurrency']}"
                out[key] = {k: lv.get(k) for k in ("requests", "errors", "first_error", "audio_s_per_s", "req_per_s",
                                                   "ttfa_ms", "server_last_frame_ms", "server_queue_ms", "total_ms")}
                say(f"  {key}: {out[key]['audio_s_per_s']} audio-s/s, TTFA {out[key]['ttfa_ms']}")
    return out


# ---- the run -------------------------------------------------------------------------------------

def _child(part: str, ckpt: Path, args: argparse.Namespace) -> dict:
    """Run one part in a process of its own; its result, or the error that ended it."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    cmd = [sys.executable, "-m", "chorus.bench.omnivoice_compare", "--part", part, "--checkpoint", str(ckpt),
           "--result", str(result), "--repeats", str(args.repeats), "--peak-tflops", str(args.peak_tflops)]
    say(f"{part} ...")
    t = time.perf_counter()
    proc = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 or not result.stat().st_size:
        sys.stderr.write(proc.stderr[-4000:])
        return {"error": f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or ["?"])[-1]}
    data = json.loads(result.read_text())
    result.unlink()
    say(f"{part} done in {time.perf_counter() - t:.0f} s")
    return data


def targets(report: dict) -> dict:
    """Each issue-27 target with its measured value (None where the run did not measure it)."""
    s, e = report.get("chorus_services", {}), report.get("chorus_engine", {})

    def get(d, *keys):
        for k in keys:
            d = d.get(k) if isinstance(d, dict) else None
        return d

    o1, o3 = get(s, "O1_c32", "audio_s_per_s"), get(s, "O3_c32", "audio_s_per_s")
    x = get(e, "batch_32", "x_floor")
    rows = {
        "O1_c32_audio_s_per_s >= 250": o1,
        "O1_c1_accepted_to_canvas_ms_p50 <= 60": get(s, "O1_c1", "server_last_frame_ms", "p50"),
        "O1_c1_ttfa_ms_p50 <= 100": get(s, "O1_c1", "ttfa_ms", "p50"),
        "O3_c32_within_10pct_of_O1_c32 (ratio >= 0.9)": round(o3 / o1, 3) if o1 and o3 else None,
        "step_at_32_x_floor <= 1.5": x,
    }
    limits = {"O1_c32_audio_s_per_s >= 250": lambda v: v >= 250,
              "O1_c1_accepted_to_canvas_ms_p50 <= 60": lambda v: v <= 60,
              "O1_c1_ttfa_ms_p50 <= 100": lambda v: v <= 100,
              "O3_c32_within_10pct_of_O1_c32 (ratio >= 0.9)": lambda v: v >= 0.9,
              "step_at_32_x_floor <= 1.5": lambda v: v <= 1.5}
    return {k: {"measured": v, "met": None if v is None else limits[k](v)} for k, v in rows.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chorus.bench.omnivoice_compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "omnivoice-compare"),
                   help="where the dummy checkpoint is written (and reused when already there)")
    p.add_argument("--seed", type=int, default=0, help="seed of the dummy weights")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each generation after a warm-up run")
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds of each services level")
    p.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds before each services level")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense fp16 matrix rate (H200: 989)")
    p.add_argument("--skip", default="", help="comma list of parts to leave out: package, triton, engine, services")
    p.add_argument("--server-logs", action="store_true", help="relay the launched services' logs")
    p.add_argument("--out", default=None, help="the JSON file to write")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.part:  # a child: one part, its result as JSON in --result
        ckpt = Path(args.checkpoint)
        if args.part in ("package", "triton"):
            data = package_part(ckpt, [1, 16], args.repeats, triton=args.part == "triton")
        elif args.part == "engine":
            data = engine_part(ckpt, [1, 16, 32], args.repeats, args.peak_tflops)
        else:
            raise SystemExit(f"unknown part {args.part!r}")
        Path(args.result).write_text(json.dumps(data))
        return 0

    import importlib.util

    import torch

    from chorus.bench.common import device_name, write_json
    from chorus.provenance import git_revision

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    report: dict = {"bench": "omnivoice_compare", "git": git_revision(), "device": device_name("cuda"),
                    "torch": torch.__version__, "text": TEXT, "seconds": SECONDS, "target_frames": FRAMES,
                    "num_step": NUM_STEP, "guidance_scale": GUIDANCE, "dtype": "float16",
                    "peak_tflops": args.peak_tflops}
    say(f"writing the dummy checkpoint under {args.workdir}")
    ckpt = write_checkpoint(Path(args.workdir) / "omnivoice-dummy", args.seed)
    torch.cuda.empty_cache()
    report["checkpoint"] = str(ckpt)
    if "package" not in skip:
        report["package"] = _child("package", ckpt, args)
    if "triton" not in skip:
        report["omnivoice_triton"] = (_child("triton", ckpt, args) if importlib.util.find_spec("omnivoice_triton")
                                      else {"skipped": "omnivoice_triton does not import here"})
    if "engine" not in skip:
        report["chorus_engine"] = _child("engine", ckpt, args)
    if "services" not in skip:
        say("chorus services ...")
        try:
            report["chorus_services"] = services_part(ckpt, args.duration, args.warmup, args.server_logs)
        except Exception as e:  # noqa: BLE001 - keep what the other parts measured
            report["chorus_services"] = {"error": f"{type(e).__name__}: {e}"}
    floor = report.get("chorus_engine", {}).get("batch_32", {}).get("floor_step_ms")
    report["floor"] = {"step_at_32_requests_ms": floor,
                       "canvas_at_32_requests_ms": None if floor is None else round(floor * NUM_STEP, 2),
                       "audio_s_per_s_at_floor": None if not floor else round(32 * SECONDS / (floor * NUM_STEP / 1000), 1),
                       "note": "matrix FLOPs of the packed step (body GEMMs, attention, audio head) at the dense "
                               "fp16 rate"}
    report["targets"] = targets(report)
    print(json.dumps(report, indent=2, default=str), flush=True)
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
