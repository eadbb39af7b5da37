"""Paged decode attention at the worker's shapes (32 q heads, 8 KV heads, head dim 128, bf16):
flashinfer's tensor-core and CUDA-core paths and the Triton kernel of gpu_worker/decode_attention.py,
over page sizes, contexts and batches, each against the KV-bytes floor.

The KV is laid out as the worker's slot cache (K and V apart, [slots, Hkv, D]). Each of a graph's
36 calls reads its own layer's KV, as in the model: one layer's KV read 36 times would partly stay
in L2 and flatter the kernels.

    python -m chorus.bench.decode_attention_bench --out decode_attention.json
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

from chorus.bench.common import replay_ms, write_json
from chorus.provenance import git_revision
from gpu_worker.decode_attention import paged_decode_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="64,180,256", help="decode batch sizes, comma-separated")
    ap.add_argument("--contexts", default="150,300,1000", help="context rows of each request, comma-separated")
    ap.add_argument("--page-sizes", default="16,32,64", help="KV rows per page, comma-separated")
    ap.add_argument("--layout", default="random", choices=["random", "contiguous"],
                    help="requests' pages scattered over the pool, or each request's pages in one run (as "
                         "chorus bench worker lays them out)")
    ap.add_argument("--iters", type=int, default=20, help="graph replays (36 calls each) a point")
    ap.add_argument("--triton-configs", default="64:4:2,32:4:2,64:4:3,128:8:2,32:2:3",
                    help="BLOCK_N:num_warps:num_stages of the Triton kernel, comma-separated ('' for none)")
    ap.add_argument("--baseline", metavar="FILE",
                    help="a decode_attention.py of another tree (git show REV:gpu_worker/decode_attention.py > "
                         "FILE): its kernel at its default config is timed too, as 'baseline_us'")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="memory bandwidth floor, bytes/s")
    ap.add_argument("--out", metavar="JSON", help="write the results here")
    args = ap.parse_args()
    import flashinfer

    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_decode_attention", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)

    qo_heads, kv_heads, dim, dev = 32, 8, 128, torch.device("cuda")
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    results = {"device": torch.cuda.get_device_name(), "revision": git_revision(), "layout": args.layout,
               "points": []}
    for page in (int(x) for x in args.page_sizes.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            for bs in (int(x) for x in args.batches.split(",")):
                pages_per = -(-ctx // page)
                # one K and one V per layer: L2 must not carry a layer's KV to the next
                caches = [(torch.randn(bs * pages_per * page, kv_heads, dim, dtype=torch.bfloat16, device=dev),
                           torch.randn(bs * pages_per * page, kv_heads, dim, dtype=torch.bfloat16, device=dev))
                          for _ in range(36)]
                paged = [(k.view(-1, page, kv_heads, dim), v.view(-1, page, kv_heads, dim)) for k, v in caches]
                indptr = torch.arange(bs + 1, dtype=torch.int32) * pages_per
                # requests' pages scattered over the pool, as the allocator leaves them
                indices = (torch.randperm(bs * pages_per, dtype=torch.int32) if args.layout == "random"
                           else torch.arange(bs * pages_per, dtype=torch.int32)).to(dev)
                last = torch.full((bs,), ctx - (pages_per - 1) * page, dtype=torch.int32)
                q = torch.randn(bs, qo_heads, dim, dtype=torch.bfloat16, device=dev)
                floor_us = bs * ctx * kv_heads * dim * 2 * 2 / args.bandwidth * 1e6
                point = {"page_size": page, "context": ctx, "batch": bs, "bytes_floor_us": floor_us}
                for name, tc in (("tensor_cores", True), ("cuda_cores", False)):
                    # as the worker's decode graphs: a CUDA-graph wrapper, 36 calls (one per layer) a replay
                    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
                        paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
                        paged_kv_indices_buffer=torch.zeros(indices.numel(), dtype=torch.int32, device=dev),
                        paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=dev))
                    w.plan(indptr, indices, last, qo_heads, kv_heads, dim, page, q_data_type=torch.bfloat16,
                           kv_data_type=torch.bfloat16)
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        ref = w.run(q, paged[0])
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for cache in paged:
                            w.run(q, cache)
                    point[name + "_us"] = replay_ms(g, args.iters) * 1e3 / 36
                table = (indptr.to(dev), indices, last.to(dev))
                point["triton_us"] = {}
                for cfg in (tuple(int(x) for x in c.split(":")) for c in args.triton_configs.split(",") if c):
                    try:
                        out = paged_decode_attention(q, *caches[0], *table, page, impl="triton", config=cfg)
                        point.setdefault("triton_max_abs_diff_vs_flashinfer", {})[str(cfg)] = \
                            (out.float() - ref.float()).abs().max().item()
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            for k, v in caches:
                                paged_decode_attention(q, k, v, *table, page, impl="triton", config=cfg)
                        point["triton_us"][str(cfg)] = replay_ms(g, args.iters) * 1e3 / 36
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
                        print(f"triton {cfg}: failed ({type(e).__name__}: {e})", flush=True)
                if baseline is not None:
                    g = torch.cuda.CUDAGraph()
                    baseline.paged_decode_attention(q, *caches[0], *table, page, impl="triton")
                    with torch.cuda.graph(g):
                        for k, v in caches:
                            baseline.paged_decode_attention(q, k, v, *table, page, impl="triton")
                    point["baseline_us"] = replay_ms(g, args.iters) * 1e3 / 36
                    print(f"baseline {baseline.KERNEL_CONFIG}: {point['baseline_us']:7.1f} us", flush=True)
                results["points"].append(point)
                best = min(point["triton_us"].items(), key=lambda kv: kv[1], default=("-", float("nan")))
                print(f"page {page:3d} ctx {ctx:5d} bs {bs:4d}: tensor cores {point['tensor_cores_us']:7.1f} us, "
                      f"CUDA cores {point['cuda_cores_us']:7.1f} us, triton {best[1]:7.1f} us {best[0]}, "
                      f"bytes floor {floor_us:6.1f} us", flush=True)
    write_json(args.out, results, indent=1)


if __name__ == "__main__":
    main()
