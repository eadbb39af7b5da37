"""Where a decode step's time goes, on CUDA: each part captured in its own CUDA graph and timed,
plus the kernels of one eager step.

    python -m chorus.bench.profile_step --batch 1 --context 300 --out profile.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np
import torch

from chorus.v1 import worker_pb2
from gpu_worker.attention import AttentionBatch
from gpu_worker.engine import Engine
from gpu_worker.state_pool import sample_and_commit
from gpu_worker.loader import build_model
from gpu_worker.linears import fused_linear
from gpu_worker.sampler import sample
from chorus.bench.common import cuda_kernels, graph_time, replay_ms, write_json
from chorus.wire import rows_matrix


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1, help="requests in the decode step")
    p.add_argument("--context", type=int, default=300, help="prompt rows of each request")
    p.add_argument("--page-size", type=int, default=16, help="KV rows per page (as gpu_worker --page-size)")
    p.add_argument("--out", metavar="JSON", help="write the results here")
    args = p.parse_args()
    b, ctx = args.batch, args.context
    stride = -(-(ctx + 200) // args.page_size) * args.page_size  # each request's slots start on a page
    model = build_model(preset="full", load_format="dummy", dtype="bfloat16", device="cuda")
    engine = Engine(model, num_kv_slots=(b + 1) * stride, max_batch=max(b, 1), max_context=ctx + 200,
                    page_size=args.page_size)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    plan = worker_pb2.StepPlan(step_id=1)
    for rid in range(1, b + 1):
        rows = np.concatenate([rng.integers(0, 151000, (ctx, 1)), rng.integers(0, 1024, (ctx, 12))], 1)
        item = plan.prefill.add(request_id=rid, first_chunk=True, last_chunk=True, prompt_length=ctx)
        item.rows.CopyFrom(rows_matrix(rows.astype(np.int32)))
        item.kv_slots.extend(range((rid - 1) * stride, (rid - 1) * stride + ctx))
        item.sampling.CopyFrom(worker_pb2.SamplingConfig(
            text_temperature=1, text_top_p=1, text_top_k=50, audio_temperature=1.7, audio_top_p=0.8,
            audio_top_k=25, audio_repetition_penalty=1.0, seed=rid, min_frames=1 << 30))
    report = {"batch": b, "context": ctx, "page_size": args.page_size, "device": torch.cuda.get_device_name()}
    with torch.inference_mode():
        engine.execute(plan)
        # the whole graphed step, through the engine (host work included)
        import time
        times = []
        for step in range(25):
            plan = worker_pb2.StepPlan(step_id=step + 2)
            for rid in range(1, b + 1):
                plan.decode.add(request_id=rid, kv_slot=(rid - 1) * stride + ctx + step)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.execute(plan)
            times.append(time.perf_counter() - t0)
        report["engine_step_ms"] = float(np.median(times[5:]) * 1e3)
        g = engine.graphs._get(engine.graphs.bucket(b))
        report["decode_graph_replay_ms"] = replay_ms(g.graph, 20)

        rows = torch.arange(b, device="cuda")
        hidden = torch.randn(b, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        report["frame_decode_ms"] = graph_time(lambda: sample_and_commit(model, engine.pool, hidden, rows, True))
        lt = model.local_transformer

        fed_back = torch.randint(0, 1024, (cfg.n_vq - 1, b), device="cuda")

        def local_only():  # as decode_frame: the hidden state at position 0, then 11 fed-back codes
            cache = lt.new_cache(b, hidden.dtype, hidden.device)
            x = lt.step(hidden, 0, cache)
            for k in range(cfg.n_vq - 1):
                x = lt.step_codes(k, model.audio_embeddings[k].weight, fed_back[k], k + 1, cache)
            return x
        report["local_transformer_12_steps_ms"] = graph_time(local_only)
        logits = torch.randn(b, 1024, device="cuda")
        t = torch.full((b,), 1.7, device="cuda")
        k = torch.full((b,), 25, device="cuda", dtype=torch.int64)
        tp = torch.full((b,), 0.8, device="cuda")
        seed = torch.arange(b, device="cuda")
        report["sample_x13_ms"] = graph_time(lambda: [sample(logits, t, k, tp, seed, seed + i) for i in range(13)])
        heads = torch.stack([e.weight for e in model.audio_embeddings])
        report["audio_heads_x12_ms"] = graph_time(lambda: [hidden @ heads[i].T for i in range(12)])

        wrapper = g.wrapper
        positions = torch.full((b,), ctx, device="cuda")
        batch = AttentionBatch(positions=positions, write_slots=g.write_slots, qo_indptr=None, kv_indptr=None,
                               kv_indices=None)

        def backbone_only():
            engine.kv.active = wrapper
            return model.backbone(hidden, batch, engine.kv)
        report["backbone_ms"] = graph_time(backbone_only)
        layer = model.transformer.layers[0]
        norm = layer.input_layernorm
        report["rmsnorm_x73_ms"] = graph_time(lambda: [norm(hidden) for _ in range(73)])
        mlp = layer.mlp
        report["mlp_x36_ms"] = graph_time(lambda: [mlp(hidden) for _ in range(36)])
        attn = layer.self_attn
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        report["qkv_proj_x36_ms"] = graph_time(lambda: [fused_linear(hidden, projections) for _ in range(36)])

        # kernel census of one eager decode step
        engine_eager = engine
        engine_eager.graphs, saved = None, engine.graphs
        plan = worker_pb2.StepPlan(step_id=999)
        for rid in range(1, b + 1):
            plan.decode.add(request_id=rid, kv_slot=(rid - 1) * stride + ctx + 25)
        kernels = cuda_kernels(lambda: engine_eager.execute(plan))
        engine.graphs = saved
        report["eager_step_kernels"] = len(kernels)
        census = Counter(name[:80] for name, _ in kernels)
        report["top_kernels"] = census.most_common(25)
        busy: Counter = Counter()
        for name, us in kernels:
            busy[name[:80]] += us
        report["eager_kernel_busy_ms"] = sum(busy.values()) / 1e3
        report["top_kernels_by_time_us"] = [(n, round(t, 1), census[n]) for n, t in busy.most_common(25)]
    print(json.dumps(report, indent=2))
    write_json(args.out, report)


if __name__ == "__main__":
    main()
