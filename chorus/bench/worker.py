"""`chorus bench worker`: in-process microbenchmark of the gpu_worker engine.

Drives the real Engine with real StepPlans (no sockets): prefill time per
row, then decode-step time (backbone + frame decode, graphed on CUDA) against
batch size and context length, and frame decode alone. Step time is measured
pipelined, as the worker serves under the scheduler's lookahead (step N+1
launched before step N's journal is read), and also synchronously (one step,
plan in to journal out). Each point is printed beside its physical floor on
the device: bytes moved over memory bandwidth and FLOPs over tensor
throughput (defaults: an H200's 4.3 TB/s and 790 TFLOP/s).

    chorus bench worker --device cuda --preset full --batches 1,32,64,256 --contexts 300,1000
    chorus bench worker --preset tiny --device cpu --batches 1,4 --contexts 64 --steps 5   # smoke run
    chorus bench worker --batches 160 --contexts 300 --mixed-batch 160   # + prefill gathered every k-th step
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from chorus.v1 import worker_pb2
from chorus.bench.common import device_name, write_json
from chorus.provenance import git_revision
from gpu_worker.engine import Engine, PendingStep
from gpu_worker.state_pool import sample_and_commit
from gpu_worker.loader import DTYPES, build_model
from chorus.wire import rows_matrix


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="checkpoint dir (its config.json sets the shapes)")
    p.add_argument("--preset", default="full", choices=["tiny", "full"], help="shapes when --model is not given")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"], help="dummy = random weights")
    p.add_argument("--device", default="cuda", help="torch device")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weights and activations")
    p.add_argument("--attention", default="auto", choices=["auto", "torch", "flashinfer"],
                   help="as gpu_worker --attention")
    p.add_argument("--page-size", type=int, default=16, help="KV rows per page (as gpu_worker --page-size)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run every step eagerly")
    p.add_argument("--decode-split-kv", action=argparse.BooleanOptionalAction, default=True,
                   help="as gpu_worker --decode-split-kv")
    p.add_argument("--decode-kernel", default="auto", choices=["auto", "flashinfer", "triton"],
                   help="as gpu_worker --decode-kernel")
    p.add_argument("--batches", default="1,8,32,64,128,256", help="comma-separated decode batch sizes")
    p.add_argument("--contexts", default="300,1000", help="comma-separated context lengths (rows)")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per point")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps per point")
    p.add_argument("--prefill-requests", type=int, default=16, help="requests per prefill step")
    p.add_argument("--mixed-batch", type=int, default=0, metavar="B",
                   help="also time B requests' decode steps carrying new requests' prefill every k-th step "
                        "(0 = off)")
    p.add_argument("--mixed-intervals", default="1,2,4", help="the k of --mixed-batch, comma-separated")
    p.add_argument("--mixed-rows", type=int, default=100, help="prefill rows a step on average")
    p.add_argument("--mixed-request-rows", type=int, default=40, help="new rows of each prefilled request")
    p.add_argument("--launch-phases", action="store_true",
                   help="with --mixed-batch: host time of each part of a launch, prefill steps and others apart")
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="memory bandwidth floor, bytes/s")
    p.add_argument("--flops", type=float, default=790e12, help="tensor throughput floor, FLOP/s")
    p.add_argument("--out", metavar="JSON", help="write the results here")


class LaunchPhases:
    """Host seconds in named parts of Engine.launch, step by step (--launch-phases). A launch that
    waits on the GPU (a plan waiting for its previous copy, a staging copy) shows up in one part."""

    PARTS = {"folded step": ("engine", "_folded"),      # the prefill graph with the decodes folded in
             "frame sampling": ("engine", "_sample"),    # the frame-decode pass after a folded or eager step
             "prefill graph": ("prefill_graphs", "run"),  # inside both: plan, staging, replay
             "decode graph": ("graphs", "run"),         # decode graph: plan, staging, replay
             "attention plans": ("kv", "_plan"),        # inside both: flashinfer plan + wait for the last copy
             "journal copy": ("engine", "_to_host")}

    def __init__(self, engine: Engine):
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        owners = {"engine": engine, "graphs": engine.graphs, "kv": engine.kv, "prefill_graphs": engine.prefill_graphs}
        for name, (owner, attr) in self.PARTS.items():
            obj = owners[owner]
            if obj is not None and hasattr(obj, attr):  # the torch backend has no plans, CPU no graphs
                setattr(obj, attr, self._timed(name, getattr(obj, attr)))  # shadows the method

    def _timed(self, name: str, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - t0
        return timed

    def reset(self) -> None:
        self.current, self.steps = {}, []

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = {}

    def mean_ms(self, steps: list[dict[str, float]]) -> dict[str, float]:
        return {name: 1e3 * float(np.mean([s.get(name, 0.0) for s in steps])) for name in self.PARTS} if steps else {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.batches = [int(x) for x in args.batches.split(",")]
        self.contexts = [int(x) for x in args.contexts.split(",")]
        t0 = time.perf_counter()
        if torch.device(args.device).index is not None:
            torch.cuda.set_device(torch.device(args.device))  # Triton launches on the current device
        self.model = build_model(model_dir=args.model, preset=args.preset, load_format=args.load_format,
                                 dtype=args.dtype, device=args.device, seed=0)
        self.cfg = self.model.cfg
        max_b = max(self.batches)
        # every request holds its context plus one row per decode step of every point it joins
        growth = (2 * args.steps + args.warmup + 1) * len(self.batches)
        P = args.page_size
        slots = max_b * (-(-(max(self.contexts) + growth + 1) // P) + 1) * P + 2 * P
        pool = max_b
        if args.mixed_batch:
            intervals = [int(x) for x in args.mixed_intervals.split(",")]
            if args.mixed_batch > max_b:
                raise SystemExit(f"--mixed-batch {args.mixed_batch}: at most the largest of --batches ({max_b})")
            newest = max(1, round(max(intervals) * args.mixed_rows / args.mixed_request_rows))
            pool += newest
            # the mixed points' decode rows, and every prefilled request's pages (kept until the end)
            steps = (max(args.steps, 2 * max(intervals)) + 2 * max(intervals)) * len(intervals)
            requests = sum(max(1, round(k * args.mixed_rows / args.mixed_request_rows)) * (steps // k + 1)
                           for k in intervals)
            slots += args.mixed_batch * (steps + args.steps + args.warmup + P) + requests * (
                -(-args.mixed_request_rows // P) + 1) * P
        self.engine = Engine(self.model, num_kv_slots=slots, max_batch=pool, max_context=1 << 20,
                             attention=args.attention, cuda_graphs=args.cuda_graphs, page_size=P,
                             decode_split_kv=args.decode_split_kv, decode_kernel=args.decode_kernel)
        self.device = self.engine.device
        self.launch_times: list[float] = []  # each step's host seconds in Engine.launch, last _pipelined run
        self.phases: LaunchPhases | None = None  # --launch-phases, set for the mixed points
        self.next_page = 0
        self.rows: dict[int, list[int]] = {}  # request id -> its KV slots, page-aligned like the scheduler's
        self.step_id = 0
        self.rng = np.random.default_rng(0)
        print(f"model {self.cfg.name} built in {time.perf_counter() - t0:.1f}s on {self.device} "
              f"({args.dtype}, attention {type(self.engine.kv).__name__}, graphs {self.engine.graphs is not None})",
              flush=True)

    # ---- floors ----------------------------------------------------------------
    def weight_elements(self) -> int:
        """Weights a decode step must read (elements): every weight but the text embedding table, and
        the local transformer's once per local position (n_vq per frame: each position depends on
        the code sampled at the one before, and its 150 MB do not stay in L2), except the first
        block's c_attn at the n_vq - 1 fed-back positions, whose output the model gathers from
        precompute_code_qkv's table. The matmul FLOPs of a row are twice this."""
        lt = self.model.local_transformer
        skip = self.model.transformer.embed_tokens.weight
        local = sum(p.numel() for p in lt.parameters())
        other = sum(p.numel() for p in self.model.parameters() if p is not skip) - local
        c_attn = lt.h[0].attn.c_attn
        gathered = c_attn.weight.numel() + c_attn.bias.numel() if lt.code_qkv is not None else 0
        return other + (local * self.cfg.n_vq - gathered * (self.cfg.n_vq - 1))

    def weight_bytes(self) -> int:
        return self.weight_elements() * (torch.finfo(self.engine.dtype).bits // 8)

    def step_floor(self, bs: int, ctx: float) -> tuple[float, float]:
        """(bytes floor, FLOPs floor) in seconds for a decode step of bs requests at context ctx."""
        bb = self.cfg.backbone
        elem = torch.finfo(self.engine.dtype).bits // 8
        kv_bytes = bs * ctx * bb.num_hidden_layers * 2 * bb.num_key_value_heads * bb.head_dim * elem
        flops = 2 * bs * self.weight_elements() + 4 * bs * ctx * bb.num_hidden_layers * bb.num_attention_heads * bb.head_dim
        return (self.weight_bytes() + kv_bytes) / self.args.bandwidth, flops / self.args.flops

    # ---- plans -----------------------------------------------------------------
    def _slots(self, rid: int, n: int) -> list[int]:
        """The next n slots of request rid: its last page's free rows, then fresh pages."""
        P = self.engine.page_size
        held = self.rows.setdefault(rid, [])
        out = []
        for pos in range(len(held), len(held) + n):
            if pos % P == 0:
                page = self.next_page
                self.next_page += 1
            else:
                page = (out[-1] if out else held[-1]) // P
            out.append(page * P + pos % P)
        held.extend(out)
        return out

    def _plan(self) -> worker_pb2.StepPlan:
        self.step_id += 1
        return worker_pb2.StepPlan(step_id=self.step_id)

    SAMPLING = worker_pb2.SamplingConfig(text_temperature=1, text_top_p=1, text_top_k=50, audio_temperature=1.7,
                                         audio_top_p=0.8, audio_top_k=25, audio_repetition_penalty=1.0, seed=7,
                                         min_frames=1 << 30)

    def _add_prefill(self, plan: worker_pb2.StepPlan, rid: int, ctx: int) -> None:
        """A whole random ctx-row prompt of request rid into plan."""
        rows = np.empty((ctx, self.cfg.row_width), dtype=np.int32)
        rows[:, 0] = self.rng.integers(0, 151000, ctx)
        rows[:, 1:] = self.rng.integers(0, self.cfg.audio_vocab_size, (ctx, self.cfg.n_vq))
        item = plan.prefill.add(request_id=rid, first_chunk=True, last_chunk=True, prompt_length=ctx)
        item.rows.CopyFrom(rows_matrix(rows))
        item.kv_slots.extend(self._slots(rid, ctx))
        item.sampling.CopyFrom(self.SAMPLING)

    def prefill(self, ids: list[int], ctx: int) -> float:
        """Prefill `ids` with random ctx-row prompts; returns seconds per row."""
        t = 0.0
        for i in range(0, len(ids), self.args.prefill_requests):
            plan = self._plan()
            for rid in ids[i:i + self.args.prefill_requests]:
                self._add_prefill(plan, rid, ctx)
            _sync(self.device)
            t0 = time.perf_counter()
            self.engine.execute(plan)
            _sync(self.device)
            t += time.perf_counter() - t0
        return t / (len(ids) * ctx)

    def _decode_plan(self, ids: list[int]) -> worker_pb2.StepPlan:
        plan = self._plan()
        for rid in ids:
            plan.decode.add(request_id=rid, kv_slot=self._slots(rid, 1)[0])
        return plan

    def _check(self, journal: worker_pb2.Journal, n: int) -> None:
        if len(journal.request_ids) != n:
            raise RuntimeError(f"expected {n} frames, got {len(journal.request_ids)}")

    def decode(self, ids: list[int]) -> tuple[float, float]:
        """Seconds per decode step for these requests: (pipelined, synchronous).

        Pipelined is how the worker serves with the scheduler's lookahead: step N+1 is
        launched before step N's journal is read, so host work hides behind the GPU
        (mean over the timed steps, journals included). Synchronous is one step alone,
        plan in to journal out (median)."""
        for _ in range(self.args.warmup):
            self._check(self.engine.execute(self._decode_plan(ids)), len(ids))
        times = []
        for _ in range(self.args.steps):
            plan = self._decode_plan(ids)
            t0 = time.perf_counter()
            self._check(self.engine.execute(plan), len(ids))
            times.append(time.perf_counter() - t0)
        pipelined = self._pipelined([self._decode_plan(ids) for _ in range(self.args.steps + 1)], len(ids))
        return pipelined, float(np.median(times))

    def _pipelined(self, plans: list[worker_pb2.StepPlan], frames: int | None = None) -> float:
        """Mean seconds a step, run as the worker serves under lookahead: step N+1 launched before step
        N's journal is read. frames: the frames every journal must carry (None: not checked)."""
        self.launch_times = []
        if self.phases is not None:
            self.phases.reset()

        def launch(plan: worker_pb2.StepPlan) -> PendingStep:
            t1 = time.perf_counter()
            pending = self.engine.launch(plan)
            self.launch_times.append(time.perf_counter() - t1)
            if self.phases is not None:
                self.phases.end_step()
            return pending

        _sync(self.device)
        t0 = time.perf_counter()
        prev = launch(plans[0])
        for plan in plans[1:] + [None]:
            nxt = launch(plan) if plan is not None else None
            journal = self.engine.finish(prev)
            if frames is not None:
                self._check(journal, frames)
            prev = nxt
        return (time.perf_counter() - t0) / len(plans)

    def mixed(self, ids: list[int], interval: int, rows_per_step: int, request_rows: int) -> float:
        """Mean pipelined step time of decode steps for `ids` where every `interval`-th step also
        prefills new requests (interval * rows_per_step rows in request_rows-row prompts), as the
        scheduler's --prefill-interval gathers them. Each prefilled request is released in the next
        prefill step (its decode state and KV go back), so the decode batch stays len(ids)."""
        per_step = max(1, round(interval * rows_per_step / request_rows))
        next_id = max(self.rows) + 1
        newest: list[int] = []

        def plan_for(k: int) -> worker_pb2.StepPlan:
            nonlocal next_id, newest
            plan = self._decode_plan(ids)
            if k % interval == 0:
                plan.release.extend(newest)
                for rid in newest:
                    self.rows.pop(rid)  # its pages are not reused (the KV was sized for every request)
                newest = list(range(next_id, next_id + per_step))
                next_id += per_step
                for rid in newest:
                    self._add_prefill(plan, rid, request_rows)
            return plan

        steps = max(self.args.steps, 2 * interval) // interval * interval  # whole prefill periods
        for k in range(interval):
            self._check(self.engine.execute(plan_for(k)), len(ids) + (per_step if k % interval == 0 else 0))
        elapsed = self._pipelined([plan_for(k) for k in range(steps + 1)])
        self.engine.execute(self._release_plan(newest))
        for rid in newest:
            self.rows.pop(rid)
        return elapsed

    def _release_plan(self, ids: list[int]) -> worker_pb2.StepPlan:
        plan = self._plan()
        plan.release.extend(ids)
        return plan

    def frame_decode(self, bs: int) -> float:
        """Frame decode alone (12 local steps + 13 samples + commit), graphed on CUDA."""
        rows = torch.arange(bs, device=self.device)
        hidden = torch.randn(bs, self.cfg.hidden_size, device=self.device, dtype=self.engine.dtype)
        fn = lambda: sample_and_commit(self.model, self.engine.pool, hidden, rows, True)  # noqa: E731
        with torch.inference_mode():
            for _ in range(2):
                fn()
            if self.device.type == "cuda" and self.args.cuda_graphs:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                fn = g.replay
            _sync(self.device)
            t0 = time.perf_counter()
            for _ in range(self.args.steps):
                fn()
            _sync(self.device)
        return (time.perf_counter() - t0) / self.args.steps

    def context(self, ids: list[int]) -> float:
        """The mean context of these requests now (rows in their KV). A point's nominal context is its
        prompt length; every point adds a row a step to the requests it decodes, and they carry those
        rows into the later points of that context."""
        return float(np.mean([len(self.rows[rid]) for rid in ids]))

    def release(self, ids: list[int]) -> None:
        self.engine.execute(self._release_plan(ids))
        for rid in ids:
            self.rows.pop(rid, None)
        if not self.rows:
            self.next_page = 0

    def mixed_points(self, ids: list[int], ctx: int, result: dict) -> None:
        """Decode alone, then with prefill gathered into every k-th step (--mixed-intervals)."""
        a = self.args
        before = self.context(ids)
        decode_only, _ = self.decode(ids)
        if a.launch_phases:
            self.phases = LaunchPhases(self.engine)
        run_ctx = (before + self.context(ids)) / 2
        result["mixed"] = {"batch": len(ids), "context": ctx, "rows_per_step": a.mixed_rows,
                           "request_rows": a.mixed_request_rows, "decode_step_ms": decode_only * 1e3,
                           "decode_context_mean": run_ctx, "points": []}
        print(f"mixed: bs {len(ids)} ctx {ctx}, {a.mixed_rows} prefill rows a step on average in "
              f"{a.mixed_request_rows}-row requests; decode alone {decode_only * 1e3:.2f} ms a step (contexts "
              f"{run_ctx:.0f} rows on average)", flush=True)
        for k in (int(x) for x in a.mixed_intervals.split(",")):
            before = self.context(ids)
            step = self.mixed(ids, k, a.mixed_rows, a.mixed_request_rows)
            run_ctx = (before + self.context(ids)) / 2
            per_row = (step - decode_only) / a.mixed_rows
            # host time in launch: steps that prefill (every k-th, from the first) and the others
            launches = np.asarray(self.launch_times) * 1e3
            prefills = np.arange(len(launches)) % k == 0
            with_prefill, others = launches[prefills], launches[~prefills]
            result["mixed"]["points"].append({
                "interval": k, "step_ms": step * 1e3, "decode_context_mean": run_ctx,
                "prefill_us_per_row": per_row * 1e6,
                "host_launch_ms_prefill_steps": float(with_prefill.mean()),
                "host_launch_ms_other_steps": float(others.mean()) if others.size else None})
            print(f"  prefill every {k} steps ({k * a.mixed_rows} rows): {step * 1e3:.2f} ms a step (decode "
                  f"contexts {run_ctx:.0f}), prefill {per_row * 1e6:.1f} us a row beyond decode; host launch {with_prefill.mean():.2f} ms a "
                  f"prefill step" + (f", {others.mean():.2f} others" if others.size else ""), flush=True)
            if self.phases is not None:
                steps = self.phases.steps
                parts = {"prefill_steps": self.phases.mean_ms([x for x, p in zip(steps, prefills) if p]),
                         "other_steps": self.phases.mean_ms([x for x, p in zip(steps, prefills) if not p])}
                result["mixed"]["points"][-1]["host_launch_parts_ms"] = parts
                for which, ms in parts.items():
                    if ms:
                        print(f"    {which}: " + ", ".join(f"{n} {v:.2f} ms" for n, v in ms.items()), flush=True)

    def run(self) -> dict:
        max_b = max(self.batches)
        result = {"points": [], "frame_decode": [], "prefill": []}
        print(f"weights read per step: {self.weight_bytes() / 1e9:.2f} GB", flush=True)
        if self.engine.graphs is not None:
            t0 = time.perf_counter()
            self.engine.graphs.capture_all(self.batches)
            self.engine.prefill_graphs.capture_all()  # a prefill step that fits a bucket replays its graph
            print(f"captured decode graphs for {self.batches} and {len(self.engine.prefill_graphs.graphs)} prefill "
                  f"graphs in {time.perf_counter() - t0:.1f}s", flush=True)
        for ctx in self.contexts:
            ids = list(range(1, max_b + 1))
            per_row = self.prefill(ids, ctx)
            result["prefill"].append({"context": ctx, "requests": max_b, "ms_per_row": per_row * 1e3,
                                      "rows_per_s": 1 / per_row})
            print(f"prefill ctx {ctx}: {per_row * 1e6:.1f} us/row ({1 / per_row:,.0f} rows/s)", flush=True)
            print(f"{'bs':>5} {'ctx':>5} {'step ms':>8} {'frames/s':>10} {'floor ms':>9} {'ratio':>6} "
                  f"{'sync ms':>8} {'launch ms':>9} {'ctx run':>7}", flush=True)
            for bs in self.batches:
                before = self.context(ids[:bs])
                step, sync = self.decode(ids[:bs])
                run_ctx = (before + self.context(ids[:bs])) / 2
                mem, comp = self.step_floor(bs, run_ctx)  # the KV the steps read, not the nominal context
                floor = max(mem, comp)
                point = {"batch": bs, "context": ctx, "step_ms": step * 1e3, "frames_per_s": bs / step,
                         "sync_step_ms": sync * 1e3, "floor_ms": floor * 1e3, "floor_bytes_ms": mem * 1e3,
                         "floor_flops_ms": comp * 1e3, "ratio_to_floor": step / floor,
                         "host_launch_ms": float(np.mean(self.launch_times)) * 1e3, "decode_context_mean": run_ctx}
                result["points"].append(point)
                print(f"{bs:>5} {ctx:>5} {step * 1e3:>8.2f} {bs / step:>10,.0f} {floor * 1e3:>9.2f} "
                      f"{step / floor:>6.2f} {sync * 1e3:>8.2f} {point['host_launch_ms']:>9.2f} {run_ctx:>7.0f}",
                      flush=True)
            if ctx == self.contexts[0] and self.args.mixed_batch:
                self.mixed_points(ids[:self.args.mixed_batch], ctx, result)
            self.release(ids)
        for bs in self.batches:
            t = self.frame_decode(bs)
            result["frame_decode"].append({"batch": bs, "ms": t * 1e3})
            print(f"frame decode bs {bs}: {t * 1e3:.3f} ms", flush=True)
        return result


def run(args: argparse.Namespace) -> None:
    bench = Bench(args)
    results = bench.run()
    device = device_name(bench.device)
    report = {"benchmark": "worker", "command": " ".join(sys.argv),
              "git_revision": git_revision()["revision"] or "unknown",
              "device": device, "torch": torch.__version__, "dtype": args.dtype,
              "attention": type(bench.engine.kv).__name__, "decode_kernel": args.decode_kernel,
              "cuda_graphs": bench.engine.graphs is not None,
              "floor": {"bandwidth_bytes_per_s": args.bandwidth, "flops_per_s": args.flops,
                        "weight_bytes_per_step": bench.weight_bytes()},
              **results}
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="chorus bench worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
