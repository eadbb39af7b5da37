"""Where a prefill step's GPU time goes on CUDA, and what running a step's decode rows inside its
prefill pass (one pass over the weights instead of two) saves.

With the worker's own graphs and kernels it measures:
- prefill graph replay time against rows (requests of `--request-rows` new rows after a
  `--prefix`-row cached prefix each) and the FLOP floor of each point;
- the decode graph (backbone + frame decode) at `--decode-batch`, the frame decode alone, and
  one prefill graph over the prefill rows plus the decode rows (folded, as the worker runs a
  mixed step: the decodes' attention on the Triton decode kernel): what a folded step saves;
- one eager pass of each under the torch profiler, kernels grouped (GEMM, attention, glue);
- bare GEMMs of the backbone's shapes at the step's row counts, in TFLOP/s.

    python -m chorus.bench.prefill_profile --out prefill_profile.json
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

from chorus.provenance import git_revision
from gpu_worker.attention import AttentionBatch, SequenceSpan, host_layout
from gpu_worker.engine import Engine
from gpu_worker.loader import build_model
from chorus.bench.common import cuda_kernels, graph_time, replay_ms, write_json


CATEGORIES = (("gemm", r"gemm|sm90|sm80|cutlass|nvjet|cublas|xmma"),
              ("attention", r"flashinfer|Prefill|Decode|Attention|merge"),
              ("norm/rope/kv store", r"rms|norm|rope|store"),
              ("silu*mul", r"silu"),
              ("embedding", r"embed|index|gather"))


def kernel_census(fn) -> dict:
    """Kernel time of one eager fn() by category (regexes on the kernel name)."""
    fn()
    torch.cuda.synchronize()
    kernels = cuda_kernels(fn)
    by_cat: Counter = Counter()
    by_name: Counter = Counter()
    for name, t in kernels:
        cat = next((c for c, pat in CATEGORIES if re.search(pat, name, re.I)), "other")
        by_cat[cat] += t
        by_name[name[:100]] += t
    return {"kernels": len(kernels), "busy_ms": sum(by_cat.values()) / 1e3,
            "by_category_ms": {c: round(t / 1e3, 3) for c, t in by_cat.most_common()},
            "top": [(n, round(t / 1e3, 3)) for n, t in by_name.most_common(12)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="128,256,448,640,1024", help="prefill rows a step, comma-separated")
    ap.add_argument("--request-rows", type=int, default=45, help="new rows of each prefilled request")
    ap.add_argument("--prefix", type=int, default=51, help="cached prefix rows before each request's new rows")
    ap.add_argument("--decode-batch", type=int, default=180, help="decode rows of the step")
    ap.add_argument("--decode-context", type=int, default=150, help="context rows of each decoding request")
    ap.add_argument("--exact-buckets", action="store_true",
                    help="time each --rows point in a graph of exactly its rows plus one padding sequence (the cost "
                         "curve without the serving buckets' padding) instead of its serving bucket")
    ap.add_argument("--fold-rows", type=int, default=448, help="prefill rows of the folded-step comparison")
    ap.add_argument("--page-size", type=int, default=16, help="KV rows per page (as gpu_worker --page-size)")
    ap.add_argument("--flops", type=float, default=790e12, help="tensor throughput floor, FLOP/s")
    ap.add_argument("--out", metavar="JSON", help="write the results here")
    args = ap.parse_args()
    rows_list = [int(x) for x in args.rows.split(",")]
    B, P = args.decode_batch, args.page_size
    model = build_model(preset="full", load_format="dummy", dtype="bfloat16", device="cuda", seed=0)
    cfg, bb = model.cfg, model.cfg.backbone
    # every prefill request and every decoding request gets its own page-aligned slot range
    span_len = -(-(max(args.prefix + args.request_rows, args.decode_context) + 1) // P) * P
    n_seq = B + max(rows_list + [args.fold_rows]) // args.request_rows + 2
    engine = Engine(model, num_kv_slots=(n_seq + 2) * span_len, max_batch=max(B, 1), max_context=span_len,
                    page_size=P)

    def prefill_spans(rows: int) -> list[SequenceSpan]:
        """rows in requests of --request-rows (the last may be shorter), slots after the decodes'."""
        sizes = [args.request_rows] * (rows // args.request_rows) + ([rows % args.request_rows]
                                                                     if rows % args.request_rows else [])
        return [SequenceSpan(np.arange((B + i) * span_len, (B + i) * span_len + args.prefix + n), n)
                for i, n in enumerate(sizes)]

    decode_spans = [SequenceSpan(np.arange(i * span_len, i * span_len + args.decode_context), 1) for i in range(B)]
    gemm_flops_per_row = 2 * bb.num_hidden_layers * bb.hidden_size * (
        (bb.num_attention_heads + 2 * bb.num_key_value_heads) * bb.head_dim
        + bb.num_attention_heads * bb.head_dim + 3 * bb.intermediate_size)
    report = {"device": torch.cuda.get_device_name(), "revision": git_revision(), "args": vars(args),
              "gemm_gflop_per_row": gemm_flops_per_row / 1e9, "prefill": [], "fold": {}, "census": {},
              "gemm": []}
    prefill = engine.prefill_graphs

    def planned_graph(spans: list[SequenceSpan], rows: int, sequences: int, decodes: list[SequenceSpan] = ()):
        """The (rows, sequences) graph planned for prefill spans and, folded, decode spans after them."""
        g = prefill._get(rows, sequences)
        layout = host_layout(prefill._padding(spans, rows - len(decodes), sequences) + list(decodes))
        prefill._plan(g.wrapper, layout, g.positions, g.write_slots, (rows, sequences), len(decodes))
        g.positions.copy_(torch.from_numpy(layout[0]))
        g.write_slots.copy_(torch.from_numpy(layout[1]))
        return g

    with torch.inference_mode():
        for r in rows_list:
            spans = prefill_spans(r)
            bucket = (r + 1, len(spans) + 1) if args.exact_buckets else prefill.bucket(r, len(spans))
            ms = replay_ms(planned_graph(spans, *bucket).graph, 20)
            floor = r * gemm_flops_per_row / args.flops * 1e3
            report["prefill"].append({"rows": r, "sequences": len(spans), "bucket": list(bucket), "graph_ms": ms,
                                      "us_per_row": ms * 1e3 / r, "gemm_flop_floor_ms": floor})
            print(f"prefill {r} rows in {len(spans)} sequences (bucket {bucket}): {ms:.2f} ms, "
                  f"{ms * 1e3 / r:.1f} us a row; GEMM FLOP floor {floor:.2f} ms", flush=True)

        # decode graph at B (backbone + frame decode), its frame decode alone, and the folded pass
        dg = engine.graphs
        dec = dg._get(dg.bucket(B))
        dg.run(list(range(B)), decode_spans)
        decode_ms = replay_ms(dec.graph)
        frame_ms = replay_ms(dg._frame_graph(dg.bucket(B)).graph)
        spans = prefill_spans(args.fold_rows)
        pre_bucket = prefill.bucket(args.fold_rows, len(spans))
        prefill_ms = replay_ms(planned_graph(spans, *pre_bucket).graph)
        rows_f, seqs_f = args.fold_rows + B + 1, len(spans) + 1  # one padding sequence of one row
        folded_ms = replay_ms(planned_graph(spans, rows_f, seqs_f, decode_spans).graph)
        saved = decode_ms - frame_ms + prefill_ms - folded_ms
        report["fold"] = {"decode_batch": B, "prefill_rows": args.fold_rows, "decode_graph_ms": decode_ms,
                          "frame_decode_ms": frame_ms, "prefill_graph_ms": prefill_ms,
                          "prefill_bucket": list(pre_bucket), "folded_backbone_ms": folded_ms,
                          "folded_rows": rows_f, "folded_sequences": seqs_f, "saved_ms": saved}
        print(f"fold: decode graph bs {B} {decode_ms:.2f} ms (frame decode {frame_ms:.2f}), prefill {args.fold_rows} "
              f"rows {prefill_ms:.2f} ms; one backbone pass over both {folded_ms:.2f} ms: saves {saved:.2f} ms "
              f"a prefill step", flush=True)

        # eager passes under the profiler: where the time goes
        def eager(spans: list[SequenceSpan], decodes: int = 0):
            n = sum(sp.num_new for sp in spans)
            tokens = torch.zeros(n, cfg.row_width, dtype=torch.int64, device="cuda")
            batch = AttentionBatch.build(spans, engine.device, decodes)

            def run():
                engine.kv.begin(batch)
                return model.backbone(model.embed_rows(tokens), batch, engine.kv)
            return run
        # folded: as the worker runs it (decodes on the decode kernel); folded_flashinfer: every row through
        # flashinfer's prefill kernel
        for name, spans, decodes in (("prefill", prefill_spans(args.fold_rows), 0), ("decode", decode_spans, 0),
                                     ("folded", prefill_spans(args.fold_rows) + decode_spans, B),
                                     ("folded_flashinfer", prefill_spans(args.fold_rows) + decode_spans, 0)):
            c = report["census"][name] = kernel_census(eager(spans, decodes))
            print(f"eager {name} ({sum(sp.num_new for sp in spans)} rows): {c['kernels']} kernels, "
                  f"{c['busy_ms']:.2f} ms busy: {c['by_category_ms']}", flush=True)

        # bare GEMMs of the backbone's shapes (the fused q|k|v and gate|up weights), x 36 layers
        shapes = {"qkv": ((bb.num_attention_heads + 2 * bb.num_key_value_heads) * bb.head_dim, bb.hidden_size),
                  "o": (bb.hidden_size, bb.num_attention_heads * bb.head_dim),
                  "gate_up": (2 * bb.intermediate_size, bb.hidden_size),
                  "down": (bb.hidden_size, bb.intermediate_size)}
        for m in sorted({B, args.fold_rows, args.fold_rows + B, 1024, 2048}):
            point = {"rows": m}
            total = 0.0
            for name, (n, k) in shapes.items():
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ms = graph_time(lambda: F.linear(x, w))
                point[name] = {"ms": ms, "tflops": 2 * m * n * k / ms / 1e9}
                total += ms * bb.num_hidden_layers
            point["all_layers_ms"] = total
            point["tflops"] = m * gemm_flops_per_row / total / 1e9
            report["gemm"].append(point)
            print(f"GEMMs at {m} rows: {total:.2f} ms for 36 layers, {point['tflops']:.0f} TFLOP/s "
                  + " ".join(f"{k} {v['tflops']:.0f}" for k, v in point.items() if isinstance(v, dict)), flush=True)
    write_json(args.out, report, indent=1)


if __name__ == "__main__":
    main()
