"""The worker's engine in-process: batching must not change a seeded request's frames."""

import numpy as np
import pytest

from chorus.prompt import build_prompt_rows
from chorus.tokenizer import load_tokenizer
from chorus.v1 import worker_pb2
from gpu_worker.engine import Engine, StepError
from gpu_worker.loader import build_model
from chorus.wire import rows_matrix
from scheduler_svc.validation import resolve_sampling
from chorus.v1 import tts_pb2


@pytest.fixture(scope="module")
def model():
    return build_model(preset="tiny", dtype="float64", seed=0)


def _sampling(seed: int) -> worker_pb2.SamplingConfig:
    return resolve_sampling(tts_pb2.SamplingParams(seed=seed), min_frames=6)


def record(j: worker_pb2.Journal, live: set[int], out: dict[int, list]) -> None:
    """A journal's frames into out; stopped requests leave `live`."""
    rows = np.frombuffer(j.rows.data, "<i4").reshape(j.rows.rows, j.rows.cols)
    for i, rid in enumerate(j.request_ids):
        if j.stopped[i]:
            live.discard(rid)
        else:
            out[rid].append(rows[i].tolist())


class Driver:
    """A minimal scheduler: whole-prompt prefill, then decode until stop or budget."""

    def __init__(self, model):
        self.engine = Engine(model, num_kv_slots=4096, max_batch=8, max_context=1024)
        self.next_slot = 0
        self.step = 0

    def slots(self, n):
        s = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        return s

    def prefill_plan(self, prompts: dict[int, tuple[np.ndarray, int]]) -> worker_pb2.StepPlan:
        plan = worker_pb2.StepPlan(step_id=0)
        for rid, (rows, seed) in prompts.items():
            it = plan.prefill.add(request_id=rid, first_chunk=True, last_chunk=True, prompt_length=len(rows))
            it.rows.CopyFrom(rows_matrix(rows))
            it.kv_slots.extend(self.slots(len(rows)))
            it.sampling.CopyFrom(_sampling(seed))
        return plan

    def run(self, prompts: dict[int, tuple[np.ndarray, int]], frames: int,
            arrivals: dict[int, dict[int, tuple[np.ndarray, int]]] | None = None) -> dict[int, list]:
        """arrivals: {step: prompts} prefilled in that step beside the decodes (a mixed step)."""
        arrivals = arrivals or {}
        out = {rid: [] for rid in prompts}
        for late in arrivals.values():
            out.update({rid: [] for rid in late})
        plan = self.prefill_plan(prompts)
        live = set(prompts)
        for step in range(1, frames + 1):
            record(self.engine.execute(plan), live, out)
            plan = self.prefill_plan(arrivals.get(step, {}))
            for rid in sorted(live):
                plan.decode.add(request_id=rid, kv_slot=self.slots(1)[0])
            live |= set(arrivals.get(step, {}))
            if not live:
                break
        return out


def test_batched_equals_alone(model):
    tok = load_tokenizer(None)
    texts = {1: ("Hello there.", 7), 2: ("A much longer sentence to say, with commas.", 11), 3: ("Short.", 7)}
    prompts = {rid: (build_prompt_rows(model.cfg, tok, t, language="English"), seed)
               for rid, (t, seed) in texts.items()}
    together = Driver(model).run(prompts, frames=12)
    for rid in prompts:
        alone = Driver(model).run({rid: prompts[rid]}, frames=12)
        assert alone[rid] == together[rid], f"request {rid} changed when batched"
    assert together[1] != together[3]  # same seed, different text: different audio


def test_unknown_request_decode_is_a_step_error(model):
    plan = worker_pb2.StepPlan(step_id=1)
    plan.decode.add(request_id=99, kv_slot=0)
    with pytest.raises(StepError):
        Driver(model).engine.execute(plan)


def test_pipelined_launch_equals_synchronous(model):
    """The server launches step N+1 before reading step N's journal (lookahead): requests
    that stopped in step N are decoded once more and must come back as skipped, and
    every frame must equal the synchronous run's."""
    tok = load_tokenizer(None)
    prompts = {rid: (build_prompt_rows(model.cfg, tok, t, language="English"), seed)
               for rid, t, seed in ((1, "Hello there.", 3), (2, "Another one.", 4), (3, "Third.", 5))}
    want = Driver(model).run(prompts, frames=16)

    d = Driver(model)
    out = {rid: [] for rid in prompts}
    live = set(prompts)
    pending = d.engine.launch(d.prefill_plan(prompts))
    skipped = 0
    for _ in range(16):
        nxt = worker_pb2.StepPlan(step_id=0)  # built before the previous journal is read
        for rid in sorted(live):
            nxt.decode.add(request_id=rid, kv_slot=d.slots(1)[0])
        launched = d.engine.launch(nxt) if live else None
        j = d.engine.finish(pending)
        skipped += len(j.skipped)
        record(j, live, out)
        if launched is None:
            break
        pending = launched
    assert out == want
    assert skipped == len(prompts)  # each stop was followed by one decode the worker dropped


def test_warm_up_leaves_nothing_behind(model):
    d = Driver(model)
    assert d.engine.warm_up() >= 0
    assert len(d.engine.pool) == 0 and d.engine.steps == 0 and d.engine.prefill_rows == 0
    tok = load_tokenizer(None)
    prompts = {1: (build_prompt_rows(model.cfg, tok, "Hello there.", language="English"), 7)}
    assert d.run(prompts, frames=8) == Driver(model).run(prompts, frames=8)


class RerunGraph:
    """A CPU stand-in for a captured CUDA graph: replay reruns the captured function on the static
    buffers and copies its result into the captured output."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        self.out.copy_(self.fn())


@pytest.fixture
def graph_stand_in(monkeypatch):
    """cuda_graphs.capture_graph (used by every graph of the worker) captures a RerunGraph instead."""
    import torch

    from gpu_worker import cuda_graphs

    def capture(fn, pool=None):
        out = fn()
        return RerunGraph(fn, out), out

    monkeypatch.setattr(cuda_graphs, "capture_graph", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def test_first_frame_graph_plumbing_matches_eager(model, graph_stand_in):
    """GraphedDecode.sample (the frame-decode graph for prefills' first frames) with a CPU stand-in
    for CUDA graphs, whose replay reruns the captured function on the static buffers: padding to
    the bucket with the spare row, the static inputs and the output slice give the eager frames."""
    from gpu_worker import cuda_graphs

    tok = load_tokenizer(None)
    prompts = {rid: (build_prompt_rows(model.cfg, tok, t, language="English"), seed)
               for rid, t, seed in ((1, "Hello there.", 3), (2, "Another one.", 4), (3, "Third.", 5))}
    want = Driver(model).run(prompts, frames=10)
    d = Driver(model)
    graphs = cuda_graphs.GraphedDecode(d.engine)
    graphs.fits = lambda n: False  # decode steps take the eager path too, whose frame decode is now the graph
    d.engine.graphs = graphs
    assert d.run(prompts, frames=10) == want
    assert 4 in graphs.frame_graphs  # the 3 first frames ran padded to a bucket of 4


def test_prefill_graph_buckets_and_padding():
    """A prefill of r rows in s sequences takes the smallest (R, S) with a padding sequence (S > s)
    and a row for each padding sequence; padding sequences live on the scratch page."""
    from gpu_worker.attention import SequenceSpan, host_layout
    from gpu_worker.prefill_graphs import ROW_BUCKETS, SEQUENCE_BUCKETS, GraphedPrefill

    class FakeEngine:
        scratch_slot, page_size, max_batch = 4080, 16, 256

    g = GraphedPrefill.__new__(GraphedPrefill)
    g.engine, g.disabled, g.unusable = FakeEngine(), None, {}
    assert g.bucket(45, 1) == (64, 2)
    assert g.bucket(63, 1) == (64, 2) and g.bucket(64, 1) == (128, 2)
    assert g.bucket(400, 10) == (448, 16) and g.bucket(443, 10) == (512, 16)
    assert g.bucket(483, 10) == (512, 16) and g.bucket(512, 11) == (576, 16)
    assert g.bucket(600, 31) == (640, 32) and g.bucket(640, 31) == (704, 32)
    assert g.bucket(767, 31) == (768, 32) and g.bucket(768, 31) == (896, 32) and g.bucket(1000, 31) == (1024, 32)
    assert g.bucket(2048, 60) == (2112, 64) and g.bucket(2110, 60) is None  # too many rows: eager
    assert g.bucket(10, SEQUENCE_BUCKETS[-1]) is None  # too many sequences: eager
    assert g.bucket(ROW_BUCKETS[-1], 1) is None
    # Folded decodes: rows, but not sequences (the decode kernel takes them, up to the decode batch).
    assert g.bucket(450 + 180, 10, 180) == (640, 16)  # W1 c256: ~450 prefill rows beside 180 decodes
    assert g.bucket(2048 + 256, 46, 256) is None  # more rows than the largest bucket: eager
    assert g.bucket(100, 1, 257) is None  # more decodes than the pool holds
    real = [SequenceSpan(np.arange(100, 140), 30), SequenceSpan(np.arange(200, 215), 15)]
    padded = g._padding(real, 64, 4)
    assert [sp.num_new for sp in padded] == [30, 15, 1, 18]
    positions, write_slots, q_indptr, _, _ = host_layout(padded)
    assert q_indptr.tolist() == [0, 30, 45, 46, 64]
    assert positions[:30].tolist() == list(range(10, 40)) and positions[46:].tolist() == list(range(18))
    assert (write_slots[45:] >= 4080).all() and (write_slots[45:] < 4096).all()  # the scratch page only


def test_prefill_graph_plumbing_matches_eager(model, monkeypatch, graph_stand_in):
    """GraphedPrefill with a CPU stand-in for CUDA graphs (replay reruns the captured function on the
    static buffers) and the torch attention backend planned as for an eager step: the padded bucket,
    the static inputs and the output slice give the eager frames."""
    from gpu_worker import cuda_graphs
    from gpu_worker.prefill_graphs import GraphedPrefill

    tok = load_tokenizer(None)
    prompts = {rid: (build_prompt_rows(model.cfg, tok, t, language="English"), seed)
               for rid, t, seed in ((1, "Hello there.", 3), (2, "Another one, a little longer.", 4),
                                    (3, "Third.", 5))}
    want = Driver(model).run(prompts, frames=10)
    d = Driver(model)
    kv = d.engine.kv
    monkeypatch.setattr(kv, "prefill_graph_wrapper", lambda sequences, rows, decodes=0: None, raising=False)
    monkeypatch.setattr(kv, "plan_prefill", lambda wrapper, batch: kv.begin(batch), raising=False)
    graphs = cuda_graphs.GraphedDecode(d.engine)
    graphs.fits = lambda n: False  # decode steps stay eager; the prefill-only first step takes the graph
    d.engine.graphs, d.engine.prefill_graphs = graphs, GraphedPrefill(d.engine)
    assert d.run(prompts, frames=10) == want
    rows = sum(len(r) for r, _ in prompts.values())
    assert list(d.engine.prefill_graphs.graphs) == [d.engine.prefill_graphs.bucket(rows, 3)]


def _graphed_prefill_engine(model, monkeypatch):
    """A Driver whose engine has prefill graphs (a CPU stand-in, with the torch attention backend planned
    as for an eager step) and the frame-decode graphs; decode-only steps stay eager, so only the steps
    with prefill take graphs. Returns the driver and the (decodes, hidden states) of each folded replay."""
    from gpu_worker import cuda_graphs
    from gpu_worker.prefill_graphs import GraphedPrefill

    d = Driver(model)
    kv = d.engine.kv
    monkeypatch.setattr(kv, "prefill_graph_wrapper", lambda sequences, rows, decodes=0: None, raising=False)
    monkeypatch.setattr(kv, "plan_prefill", lambda wrapper, batch: kv.begin(batch), raising=False)
    graphs = cuda_graphs.GraphedDecode(d.engine)
    graphs.fits = lambda n: False
    d.engine.graphs, d.engine.prefill_graphs = graphs, GraphedPrefill(d.engine)
    folded = []
    run_folded = d.engine._folded

    def record(prompt_rows, spans, decode_rows):
        folded.append((len(decode_rows), run_folded(prompt_rows, spans, decode_rows)))
        return folded[-1][1]

    monkeypatch.setattr(d.engine, "_folded", record)
    return d, folded


def _late_arrival(model):
    tok = load_tokenizer(None)
    prompts = {rid: (build_prompt_rows(model.cfg, tok, t, language="English"), seed)
               for rid, t, seed in ((1, "Hello there.", 3), (2, "Another one, a little longer.", 4))}
    late = {3: {5: (build_prompt_rows(model.cfg, tok, "Late.", language="English"), 9)}}
    return prompts, late


def test_folded_decodes_match_eager(model, monkeypatch, graph_stand_in):
    """Folding with a CPU stand-in for CUDA graphs: a step that prefills a late request beside
    decodes runs both in one prefill-graph replay (the decodes as one-row sequences that read their
    feedback embeddings) and samples every frame in one frame-decode replay, with the eager frames."""
    prompts, late = _late_arrival(model)
    want = Driver(model).run(prompts, frames=10, arrivals=late)
    d, folded = _graphed_prefill_engine(model, monkeypatch)
    assert d.run(prompts, frames=10, arrivals=late) == want
    mixed = [hidden for decodes, hidden in folded if decodes]
    assert len(mixed) == 1 and mixed[0] is not None  # the late step, folded
    assert max(d.engine.graphs.frame_buckets) == 8 + 64  # decodes and first frames sample together


def test_mixed_step_that_cannot_fold_runs_eagerly(model, monkeypatch, graph_stand_in):
    """Where the attention backend cannot fold decodes into a prefill graph (the Triton decode kernel
    does not take the model), a step with prefill and decodes runs eagerly, a prefill-only step still
    replays its prefill graph, and the frames equal the eager engine's."""
    prompts, late = _late_arrival(model)
    want = Driver(model).run(prompts, frames=10, arrivals=late)
    d, folded = _graphed_prefill_engine(model, monkeypatch)
    monkeypatch.setattr(d.engine.kv, "folds_decodes", False, raising=False)
    eager = []
    run_eager = d.engine._eager
    monkeypatch.setattr(d.engine, "_eager", lambda *a: eager.append((len(a[0]), len(a[4]))) or run_eager(*a))
    assert d.run(prompts, frames=10, arrivals=late) == want
    assert [decodes for decodes, hidden in folded] == [0] and folded[0][1] is not None  # the first step
    assert (1, 2) in eager  # the late step: one prefill chunk beside the two decodes, eagerly


def test_prefill_graph_failure_falls_back_to_eager(model, monkeypatch):
    """A prefill graph that fails (capture or plan) does not fail the step: that prefill and every
    later one run eagerly, with the same frames."""
    import torch

    from gpu_worker import cuda_graphs
    from gpu_worker.prefill_graphs import GraphedPrefill

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    tok = load_tokenizer(None)
    prompts = {1: (build_prompt_rows(model.cfg, tok, "Hello there.", language="English"), 3)}
    want = Driver(model).run(prompts, frames=6)
    d = Driver(model)

    def broken(sequences, rows, decodes=0):
        raise ValueError("no graph-mode prefill here")

    monkeypatch.setattr(d.engine.kv, "prefill_graph_wrapper", broken, raising=False)
    graphs = cuda_graphs.GraphedDecode(d.engine)
    graphs.fits = lambda n: False
    graphs.frame_buckets = []  # first frames eagerly too: only the prefill graph is under test
    d.engine.graphs, d.engine.prefill_graphs = graphs, GraphedPrefill(d.engine)
    assert d.run(prompts, frames=6) == want
    assert "no graph-mode prefill here" in d.engine.prefill_graphs.disabled
    assert d.engine.prefill_graphs.bucket(10, 1) is None


def test_prefill_bucket_flashinfer_refuses_runs_eagerly(model, monkeypatch, graph_stand_in):
    """A bucket whose plan flashinfer refuses (say, a workspace too small for its rows) is left out:
    its prefills run eagerly with the same frames, and the other buckets keep their graphs."""
    from gpu_worker import cuda_graphs
    from gpu_worker.prefill_graphs import GraphedPrefill

    tok = load_tokenizer(None)
    prompts = {1: (build_prompt_rows(model.cfg, tok, "Hello there.", language="English"), 3)}
    want = Driver(model).run(prompts, frames=6)
    d = Driver(model)
    kv = d.engine.kv

    def plan(wrapper, batch):
        if wrapper == ("big",):
            raise ValueError("workspace too small")
        kv.begin(batch)

    monkeypatch.setattr(kv, "prefill_graph_wrapper", lambda sequences, rows, decodes=0: ("big",) if rows >= 128 else None,
                        raising=False)
    monkeypatch.setattr(kv, "plan_prefill", plan, raising=False)
    graphs = cuda_graphs.GraphedDecode(d.engine)
    graphs.fits = lambda n: False
    graphs.frame_buckets = []
    d.engine.graphs, d.engine.prefill_graphs = graphs, GraphedPrefill(d.engine)
    prefill = d.engine.prefill_graphs
    prefill.capture_all()
    assert prefill.disabled is None and prefill.unusable and all(r >= 128 for r, _ in prefill.unusable)
    assert prefill.graphs and all(r < 128 for r, _ in prefill.graphs)
    assert prefill.bucket(100, 1) is None and prefill.bucket(40, 1) == (64, 2)
    assert d.run(prompts, frames=6) == want
