"""Host syncs on the launch paths, found on the GPU: with torch's sync debug mode on, launch the
worker's steps and the vocoder's decode steps while the step before each is still queued, and
report every synchronizing call with the Python stack that made it; OmniVoice's engine likewise.

A launch that syncs waits for the step launched before it, and the GPU then idles while the host
launches this one. The worker's `finish` and the vocoder's `result()` wait on purpose and are not
audited. On the CPU (tiny presets) it runs the same steps and finds nothing: torch's debug mode is
CUDA-only.

    python -m chorus.bench.sync_audit --device cuda --out sync_audit.json
"""

from __future__ import annotations

import argparse
import contextlib
import traceback
import warnings

import numpy as np
import torch

from chorus.v1 import worker_pb2
from chorus.bench.common import write_json
from chorus.bench.worker import Bench, add_arguments
from chorus.wire import rows_matrix
from vocoder_svc.codec import full_v2, tiny_v2
from vocoder_svc.codec_checkpoint import build_codec
from vocoder_svc.slot_decoder import SlotDecoder


@contextlib.contextmanager
def audit(name: str, found: list[dict], device: torch.device):
    """Record each synchronizing CUDA call inside the block (its message and Python stack)."""
    if device.type != "cuda":
        yield
        return
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message) and "debug mode is a prototype" not in str(message):
            # (the second: torch's notice when the mode is switched on, not a sync)
            found.append({"step": name, "message": str(message),
                          "stack": [s.strip() for s in traceback.format_stack(limit=14)[:-1]]})
        else:
            previous(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = previous


def worker_steps(args: argparse.Namespace, found: list[dict]) -> None:
    bench = Bench(args)
    engine, device = bench.engine, bench.device
    if engine.prefill_graphs is not None:
        engine.prefill_graphs.capture_all()
    ids = list(range(1, 9))
    bench.prefill(ids, 64)
    for _ in range(3):
        engine.execute(bench._decode_plan(ids))
    sampling = worker_pb2.SamplingConfig(text_temperature=1, text_top_p=1, text_top_k=50, audio_temperature=1.7,
                                         audio_top_p=0.8, audio_top_k=25, audio_repetition_penalty=1.1, seed=3,
                                         min_frames=1 << 30)

    def mixed_plan() -> worker_pb2.StepPlan:
        plan = bench._decode_plan(ids)
        for rid in (101, 102):
            rows = np.empty((40, bench.cfg.row_width), dtype=np.int32)
            rows[:, 0] = bench.rng.integers(0, 151000, 40)
            rows[:, 1:] = bench.rng.integers(0, bench.cfg.audio_vocab_size, (40, bench.cfg.n_vq))
            item = plan.prefill.add(request_id=rid, first_chunk=True, last_chunk=True, prompt_length=40)
            item.rows.CopyFrom(rows_matrix(rows))
            item.kv_slots.extend(bench._slots(rid, 40))
            item.sampling.CopyFrom(sampling)
        return plan

    for name, make in (("worker decode step", lambda: bench._decode_plan(ids)), ("worker mixed step", mixed_plan),
                       ("worker decode step after a mixed one", lambda: bench._decode_plan(ids + [101, 102])),
                       ("worker release step", lambda: worker_pb2.StepPlan(step_id=0, release=[101, 102]))):
        before = engine.launch(bench._decode_plan(ids if name != "worker decode step after a mixed one"
                                                  else ids + [101, 102]))
        plan = make()
        with audit(name, found, device):
            launched = engine.launch(plan)
        engine.finish(before)
        engine.finish(launched)
        print(f"{name}: {sum(f['step'] == name for f in found)} syncs", flush=True)


def vocoder_steps(args: argparse.Namespace, found: list[dict]) -> None:
    device = torch.device(args.device)
    full = device.type == "cuda" and args.preset == "full"
    codec = build_codec(full_v2() if full else tiny_v2(), seed=0, dtype=torch.float32, device=args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else None
    decoder = SlotDecoder(codec, slots=8, n_q=12, compute_dtype=dtype, graph_frames=[5, 25])
    decoder.capture()
    slots = [decoder.acquire() for _ in range(4)]
    rng = np.random.default_rng(0)

    def codes(t: int) -> dict[int, torch.Tensor]:
        return {s: torch.from_numpy(rng.integers(0, 1024, (12, t))) for s in slots}

    decoder.launch_pcm(codes(5), int16=slots).result()
    for name, t in (("vocoder steady step", 25), ("vocoder 5-frame step", 5)):
        before = decoder.launch_pcm(codes(25), int16=slots)
        step = codes(t)
        with audit(name, found, device):
            launched = decoder.launch_pcm(step, int16=slots)
        before.result()
        launched.result()
        print(f"{name}: {sum(f['step'] == name for f in found)} syncs", flush=True)


def omnivoice_steps(args: argparse.Namespace, found: list[dict]) -> None:
    """OmniVoice's engine as the worker drives it under lookahead: canvases started and steps
    launched while the step before is queued, the last step's codes queued to the host included."""
    from chorus.omnivoice.knobs import UnmaskKnobs
    from gpu_worker.omnivoice.engine import CanvasEngine, CanvasSpec
    from gpu_worker.omnivoice.loader import build_omnivoice

    device = torch.device(args.device)
    full = device.type == "cuda" and args.preset == "full"
    model = build_omnivoice(preset="full" if full else "tiny", load_format="dummy",
                            dtype="float16" if device.type == "cuda" else "float32", device=args.device)
    engine = CanvasEngine(model, max_batch=8, max_packed_rows=4096)
    engine.warm_up()
    text = np.arange(200, 236, dtype=np.int64)
    num_step = 4

    def start(ids) -> None:
        for i in ids:
            engine.start(CanvasSpec(i, text, None, 150, UnmaskKnobs(num_step=num_step,
                                                                   guidance_scale=2.0 if i % 2 else 0.0), seed=i))

    start(range(4))
    before = engine.launch([(i, 0) for i in range(4)])
    for k in range(1, num_step):
        name = "omnivoice step" if k < num_step - 1 else "omnivoice last step (codes queued to the host)"
        with audit(name, found, device):
            if k == 1:
                start(range(4, 6))  # canvases joining mid-flight, as a plan's canvas_start does
            launched = engine.launch([(i, k) for i in range(4)] + ([(i, k - 1) for i in range(4, 6)]))
        engine.finish(before)
        before = launched
        print(f"{name}: {sum(f['step'] == name for f in found)} syncs", flush=True)
    engine.finish(before)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)  # the worker bench's flags: --device, --preset, --dtype, --page-size, ...
    p.add_argument("--parts", default="worker,vocoder,omnivoice",
                   help="launch paths to audit: worker (MOSS), vocoder (MOSS's codec), omnivoice (its engine)")
    p.set_defaults(batches="16", contexts="64", steps=2, warmup=1, prefill_requests=8)
    args = p.parse_args()
    if args.device == "cpu" and args.dtype == "bfloat16":
        args.dtype, args.preset = "float32", "tiny"
    found: list[dict] = []
    parts = {"worker": worker_steps, "vocoder": vocoder_steps, "omnivoice": omnivoice_steps}
    for part in args.parts.split(","):
        parts[part](args, found)
    print(f"{len(found)} synchronizing calls on the launch paths" + (":" if found else ""))
    for f in found:
        print(f"- {f['step']}: {f['message']}\n    " + "\n    ".join(f["stack"][-4:]))
    write_json(args.out, {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                          "syncs": found}, indent=1)


if __name__ == "__main__":
    main()
