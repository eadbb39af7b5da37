"""GPU parity checks for the worker: flashinfer against the torch reference backend, and graphed
against eager decode. Not a CI test: CI has no GPU.

1. flashinfer vs the torch reference backend: backbone hidden states of a
   mixed prefill+decode batch agree to bf16 tolerance.
2. Graphed vs eager decode (flashinfer both): the same seeded requests give
   identical frames at equal batch size.

    python -m chorus.bench.gpu_checks --out gpu_checks.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import numpy as np
import torch

from chorus.bench.common import write_json

from chorus.v1 import worker_pb2
from gpu_worker.attention import AttentionBatch, SequenceSpan, FlashInferPagedAttention, TorchPagedAttention
from gpu_worker.engine import Engine
from gpu_worker.loader import build_model
from chorus.wire import matrix_array, rows_matrix


def backend_parity(model, device) -> dict:
    """Both bf16 backends against an fp32 run of the same weights: flashinfer must
    be no further from fp32 than the torch reference is (bf16 rounding is the
    only expected difference)."""
    bb = model.cfg.backbone
    args = (bb.num_hidden_layers, 4096, bb.num_key_value_heads, bb.head_dim)
    ref = TorchPagedAttention(*args, torch.bfloat16, device)
    fi = FlashInferPagedAttention(*args, bb.num_attention_heads, torch.bfloat16, device)
    exact = TorchPagedAttention(*args, torch.float32, device)
    model32 = copy.deepcopy(model).float()
    rng = np.random.default_rng(0)
    out = {}
    for name, spans in {
        "prefill": [SequenceSpan(list(range(0, 300)), 300), SequenceSpan(list(range(300, 400)), 100)],
        "decode": [SequenceSpan(list(range(0, 301)), 1), SequenceSpan(list(range(300, 401)), 1)],
        "mixed": [SequenceSpan(list(range(0, 302)), 1), SequenceSpan(list(range(1000, 1050)), 50)],
    }.items():
        n = sum(s.num_new for s in spans)
        rows = torch.from_numpy(np.concatenate([
            rng.integers(0, 151000, (n, 1)), rng.integers(0, 1024, (n, model.cfg.n_vq))], 1)).to(device)
        batch = AttentionBatch.build(spans, device)
        results = []
        for m, backend in ((model, ref), (model, fi), (model32, exact)):
            backend.begin(batch)
            results.append(m.backbone(m.embed_rows(rows), batch, backend).float())
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
        torch_err, fi_err = rel(results[0], results[2]), rel(results[1], results[2])
        out[name] = {"rel_l2_torch_bf16_vs_fp32": torch_err, "rel_l2_flashinfer_bf16_vs_fp32": fi_err,
                     "rel_l2_flashinfer_vs_torch": rel(results[1], results[0]), "ok": fi_err <= 1.5 * torch_err}
        print(f"backend parity {name}: vs fp32, torch bf16 {torch_err:.3g}, flashinfer bf16 {fi_err:.3g}",
              flush=True)
    return out


def run_requests(engine: Engine, prompts: list[np.ndarray], steps: int, late: np.ndarray | None = None,
                 late_step: int = 5, pipelined: bool = False) -> list[list[list[int]]]:
    """Prefill `prompts` together, decode `steps` steps. `late`: one more prompt prefilled at
    `late_step` beside the decodes (a mixed step). `pipelined`: launch step N+1 before reading
    step N's journal, as the server does under the scheduler's lookahead."""
    sampling = worker_pb2.SamplingConfig(text_temperature=1, text_top_p=1, text_top_k=50, audio_temperature=1.7,
                                         audio_top_p=0.8, audio_top_k=25, audio_repetition_penalty=1.0,
                                         seed=11, min_frames=1 << 30)
    all_prompts = prompts + ([late] if late is not None else [])
    live: list[int] = []
    held = {rid: 0 for rid in range(1, len(all_prompts) + 1)}

    def slots(rid, n):  # request rid owns slots [(rid-1)*1024, rid*1024): page-aligned for any page size
        first = (rid - 1) * 1024 + held[rid]
        held[rid] += n
        return range(first, first + n)

    def prefill(plan, rid):
        rows = all_prompts[rid - 1]
        item = plan.prefill.add(request_id=rid, first_chunk=True, last_chunk=True, prompt_length=len(rows))
        item.rows.CopyFrom(rows_matrix(rows))
        item.kv_slots.extend(slots(rid, len(rows)))
        item.sampling.CopyFrom(sampling)
        item.sampling.seed = 1000 + rid

    def next_plan(step):
        plan = worker_pb2.StepPlan(step_id=step + 1)
        for rid in live:
            plan.decode.add(request_id=rid, kv_slot=slots(rid, 1)[0])
        if step == 0:
            for rid in range(1, len(prompts) + 1):
                prefill(plan, rid)
        if late is not None and step == late_step:
            prefill(plan, len(all_prompts))
        live.extend(it.request_id for it in plan.prefill)
        return plan

    frames = [[] for _ in all_prompts]

    def record(journal):
        rows = matrix_array(journal.rows)
        for i, rid in enumerate(journal.request_ids):
            frames[rid - 1].append(rows[i].tolist())

    if pipelined:
        pending = engine.launch(next_plan(0))
        for step in range(1, steps):
            nxt = engine.launch(next_plan(step))
            record(engine.finish(pending))
            pending = nxt
        record(engine.finish(pending))
    else:
        for step in range(steps):
            record(engine.execute(next_plan(step)))
    engine.execute(worker_pb2.StepPlan(step_id=0, release=range(1, len(all_prompts) + 1)))
    return frames


def graph_parity(model) -> dict:
    rng = np.random.default_rng(1)
    out = {}
    eager = Engine(model, num_kv_slots=8192, max_batch=8, max_context=4096, cuda_graphs=False, page_size=16)
    graphed = Engine(model, num_kv_slots=8192, max_batch=8, max_context=4096, cuda_graphs=True, page_size=16)
    one_row_pages = Engine(model, num_kv_slots=8192, max_batch=8, max_context=4096, cuda_graphs=True, page_size=1)

    def prompt(n):
        return np.concatenate([rng.integers(0, 151000, (n, 1)), np.full((n, 12), 1024)], 1).astype(np.int32)

    def same(a, b):
        return sum(x == y for fa, fb in zip(a, b) for x, y in zip(fa, fb)), sum(len(f) for f in a)

    for bs in (4, 3):
        prompts = [prompt(n) for n in rng.integers(40, 120, bs)]
        a = run_requests(eager, prompts, 24)
        b = run_requests(graphed, prompts, 24)
        n_same, total = same(a, b)
        out[f"bs{bs}"] = {"identical_frames": n_same, "frames": total, "bucket": graphed.graphs.bucket(bs)}
        print(f"graphed vs eager bs {bs} (bucket {graphed.graphs.bucket(bs)}): {n_same}/{total} frames identical",
              flush=True)
    # The server's pipelining (launch N+1 before finish N) and a request prefilled beside graphed
    # decodes (a folded mixed step) must not move the others' frames.
    prompts = [prompt(n) for n in rng.integers(40, 120, 3)]
    base = run_requests(graphed, prompts, 24)
    piped = run_requests(graphed, prompts, 24, pipelined=True)
    mixed = run_requests(graphed, prompts, 24, late=prompt(77), pipelined=True)
    for name, got in (("pipelined_vs_sync", piped), ("late_arrival_mixed_step", mixed[:3])):
        n_same, total = same(base, got)
        out[name] = {"identical_frames": n_same, "frames": total}
        print(f"{name}: {n_same}/{total} frames identical", flush=True)
    out["late_arrival_frames"] = len(mixed[3])
    # First frames (sampled in the prefill step) go through the frame-decode graph in the graphed
    # engine (GraphedDecode.sample) and eagerly in the eager one: a mixed step's late request
    # must come out the same under both.
    late = prompt(77)
    g_late = run_requests(graphed, prompts, 24, late=late, pipelined=True)[3]
    e_late = run_requests(eager, prompts, 24, late=late, pipelined=True)[3]
    n_same, total = same([g_late], [e_late])
    out["late_request_graphed_vs_eager"] = {"identical_frames": n_same, "frames": total}
    print(f"late request, graphed first frame vs eager: {n_same}/{total} frames identical", flush=True)
    # Informational: flashinfer may split a sequence's KV differently for other page sizes.
    n_same, total = same(base, run_requests(one_row_pages, prompts, 24))
    out["page16_vs_page1"] = {"identical_frames": n_same, "frames": total}
    print(f"page size 16 vs 1 (graphed): {n_same}/{total} frames identical", flush=True)
    return out


def first_divergence(a: list[list[list[int]]], b: list[list[list[int]]]) -> list[int | None]:
    """Per request: the index of its first frame that differs between two runs (None: all equal)."""
    return [next((i for i, (x, y) in enumerate(zip(fa, fb)) if x != y),
                 None if len(fa) == len(fb) else min(len(fa), len(fb))) for fa, fb in zip(a, b)]


def quick_graph_parity(model) -> dict:
    """Five comparisons, each per request (the first frame index that differs, None = identical):
    - first_frame_graph: the graphed engine with its frame-decode graphs against itself with them off
      (eager frame sampling), a late request prefilled beside decodes included: only that path
      differs, so every frame must match;
    - prefill_graph_vs_eager_prefill: the graphed engine against itself without prefill graphs (its
      mixed and prefill steps then run eagerly); the bucket's padding changes the GEMM shapes, so in
      bf16 a first frame may move (informational);
    - together: graphed vs eager engine, 3 requests prefilled together (bucket padding 3 -> 4);
    - late: graphed vs eager with a late request. The graphed engine folds that mixed step (one
      prefill-graph pass over prefill and decode rows, the eager layout and kernels): only the
      bucket's padding differs from the eager forward;
    - together_triton_decode: as together, both engines decoding with the Triton kernel (the worker's
      decode attention for large batches; --decode-kernel triton here, so small batches take it)."""
    rng = np.random.default_rng(2)
    eager = Engine(model, num_kv_slots=4096, max_batch=4, max_context=2048, cuda_graphs=False, page_size=16)
    graphed = Engine(model, num_kv_slots=4096, max_batch=4, max_context=2048, cuda_graphs=True, page_size=16)
    prompts = [np.concatenate([rng.integers(0, 151000, (n, 1)), np.full((n, 12), 1024)], 1).astype(np.int32)
               for n in (40, 52, 33, 61)]
    out = {}
    g_late = run_requests(graphed, prompts[:3], 12, late=prompts[3], pipelined=True)
    buckets = graphed.graphs.frame_buckets
    graphed.graphs.frame_buckets = []  # GraphedDecode.sample returns None: first frames run eagerly
    g_late_eager_first = run_requests(graphed, prompts[:3], 12, late=prompts[3], pipelined=True)
    graphed.graphs.frame_buckets = buckets
    prefill_graphs, graphed.prefill_graphs = graphed.prefill_graphs, None  # eager prefill
    g_late_eager_prefill = run_requests(graphed, prompts[:3], 12, late=prompts[3], pipelined=True)
    graphed.prefill_graphs = prefill_graphs
    runs = {
        "first_frame_graph": (g_late, g_late_eager_first),
        # informational: the padded bucket changes GEMM shapes, so bf16 rounding may move
        "prefill_graph_vs_eager_prefill": (g_late, g_late_eager_prefill),
        "together": (run_requests(graphed, prompts[:3], 12, pipelined=True),
                     run_requests(eager, prompts[:3], 12, pipelined=True)),
        "late": (g_late, run_requests(eager, prompts[:3], 12, late=prompts[3], pipelined=True)),
        "together_triton_decode": tuple(
            run_requests(Engine(model, num_kv_slots=4096, max_batch=4, max_context=2048, cuda_graphs=graphs,
                                page_size=16, decode_kernel="triton"), prompts[:3], 12, pipelined=True)
            for graphs in (True, False)),
    }
    for name, (a, b) in runs.items():
        same = sum(x == y for fa, fb in zip(a, b) for x, y in zip(fa, fb))
        total = sum(len(f) for f in a)
        div = first_divergence(a, b)
        out[name] = {"identical_frames": same, "frames": total, "first_divergence": div}
        print(f"quick {name}: {same}/{total} frames identical; first differing frame per request {div}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="full", help="model shapes (random weights)")
    p.add_argument("--out", default=None, metavar="JSON", help="write the results here")
    p.add_argument("--quick", action="store_true",
                   help="only graphed vs eager, for requests prefilled together and one beside decodes, "
                        "prompts under 64 rows")
    args = p.parse_args()
    device = torch.device("cuda")
    model = build_model(preset=args.preset, load_format="dummy", dtype="bfloat16", device="cuda")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.quick:
        report["graph_parity_quick"] = quick_graph_parity(model)
    else:
        with torch.inference_mode():
            report["backend_parity"] = backend_parity(model, device)
        report["graph_parity"] = graph_parity(model)
    write_json(args.out, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
