"""OmniVoice's GPU step machinery: buckets and filler (CPU, bit-exact), the attention backend
choice, and, with CUDA, flashinfer against the torch reference and graphed against eager steps."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import pytest
import torch

from chorus.omnivoice.config import tiny_config
from chorus.omnivoice.knobs import UnmaskKnobs
from gpu_worker.model import init_random_weights
from gpu_worker.omnivoice.attention import TorchDocuments, make_document_attention
from gpu_worker.omnivoice.buckets import Bucket, Buckets, filler_lens, padded_layout
from gpu_worker.omnivoice.engine import CanvasEngine, CanvasSpec
from gpu_worker.omnivoice.loader import build_omnivoice
from gpu_worker.omnivoice.model import OmniVoiceModel
from gpu_worker.omnivoice.packing import Document, layout

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()
FLASHINFER = CUDA and importlib.util.find_spec("flashinfer") is not None
# conftest.py turns the Triton interpreter on where triton is installed; on a GPU,
# python -m chorus.bench.omnivoice_gpu_check runs these checks with the kernels compiled
COMPILED_TRITON = (CUDA and importlib.util.find_spec("triton") is not None
                   and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))


def test_buckets_hold_every_step_with_one_filler_document_at_least():
    b = Buckets(max_packed_rows=24576, max_batch=64)
    assert b.docs == [4, 16, 64, 129] and b.rows[0] == 256 and b.rows[-1] >= 24576 + 129
    assert b.pick(460, 2) == Bucket(512, 4)
    assert b.pick(510, 3) == Bucket(512, 4) and b.pick(511, 2) == Bucket(640, 4)  # a filler row each
    assert b.pick(340, 2) == Bucket(384, 4)  # one O1 canvas with guidance
    assert b.pick(14720, 64) == Bucket(14848, 129)
    assert b.pick(24576, 128) == Bucket(b.rows[-1], 129)
    assert b.pick(100, 129) is None                # more documents than any bucket holds
    assert all(s <= r for r, s in ((x.rows, x.docs) for x in b.all()))
    assert b.all()[0].rows == b.rows[-1]


def test_filler_shares_the_rows_left_over():
    assert filler_lens(460, 2, Bucket(512, 4)) == [26, 26]
    assert filler_lens(10, 1, Bucket(16, 4)) == [2, 2, 2]
    assert filler_lens(0, 0, Bucket(256, 4)) == [64, 64, 64, 64]
    with pytest.raises(ValueError, match="do not fit"):
        filler_lens(254, 1, Bucket(256, 4))
    docs, pos = padded_layout([3, 2], np.array([0, 1, 2, 0, 1]), Bucket(16, 4))
    assert docs == [3, 2, 6, 5] and pos.tolist() == [0, 1, 2, 0, 1, *range(6), *range(5)]


def test_a_step_padded_to_its_bucket_equals_the_unpadded_step():
    """What a graph replays (the step padded with filler documents), run eagerly on the CPU: the
    real rows' logits are bit-identical to the unpadded step's."""
    model = build_omnivoice(preset="tiny", dtype="float64", seed=3)
    g = torch.Generator().manual_seed(0)
    docs = [Document(7, 12, True), Document(5, 9, False), Document(3, 20, True)]
    lay = layout(docs)
    ids = torch.randint(0, 1024, (8, lay.rows), generator=g)
    mask = torch.ones(lay.rows, dtype=torch.bool)
    at = 0
    for d in docs:
        ids[:, at:at + d.prefix] = torch.randint(100, 5000, (1, d.prefix), generator=g)
        mask[at:at + d.prefix] = False
        at += d.prefix + d.target + (d.target if d.guided else 0)
    with torch.no_grad():
        plain = model(ids, mask, lay.positions, lay.doc_lens, lay.gather)
        bucket = Buckets(max_packed_rows=400, max_batch=4).pick(lay.rows, len(lay.doc_lens))
        doc_lens, pos = padded_layout(lay.doc_lens, lay.positions.numpy(), bucket)
        fill = bucket.rows - lay.rows
        padded_ids = torch.cat([ids, torch.full((8, fill), model.cfg.audio_mask_id)], dim=1)
        padded_mask = torch.cat([mask, torch.ones(fill, dtype=torch.bool)])
        padded = model(padded_ids, padded_mask, torch.from_numpy(pos), doc_lens, lay.gather)
    assert bucket.rows > lay.rows and len(doc_lens) > len(lay.doc_lens)
    assert torch.equal(plain, padded)


def test_attention_backend_choice():
    cfg = build_omnivoice(preset="tiny").cfg
    assert isinstance(make_document_attention("auto", cfg, torch.float32, torch.device("cpu")), TorchDocuments)
    with pytest.raises(ValueError, match="runs on CUDA"):
        make_document_attention("flashinfer", cfg, torch.float16, torch.device("cpu"))
    with pytest.raises(ValueError, match="attention triton runs on CUDA"):
        make_document_attention("triton", cfg, torch.float16, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa'"):
        make_document_attention("sdpa", cfg, torch.float32, torch.device("cpu"))
    engine = CanvasEngine(build_omnivoice(preset="tiny"), attention="auto", cuda_graphs=True)
    assert engine.attention.name == "torch" and engine.bucketed is None


def gpu_model(dtype: torch.dtype = torch.float16, seed: int = 5) -> OmniVoiceModel:
    """The tiny structure with head dim 128 (flashinfer's kernels are built for 64/128/256)."""
    cfg = dataclasses.replace(tiny_config(), hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                              head_dim=128)
    with torch.device("meta"):
        model = OmniVoiceModel(cfg)
    model = model.to(dtype=dtype).to_empty(device=torch.device("cuda"))
    init_random_weights(model, seed)
    return model.eval()


def _run(engine: CanvasEngine, batch: int, num_step: int = 4, frames: int = 40) -> list[np.ndarray]:
    """Every step of `batch` canvases (half guided), their final codes in request order."""
    text = np.arange(200, 230, dtype=np.int64)
    for i in range(batch):
        knobs = UnmaskKnobs(num_step=num_step, guidance_scale=2.0 if i % 2 == 0 else 0.0)
        engine.start(CanvasSpec(i, text[:10 + i % 7], None, frames + 3 * i, knobs, seed=i))
    codes = {}
    for k in range(num_step):
        for o in engine.step([(i, k) for i in range(batch)]):
            if o.finished:
                codes[o.request_id] = o.codes
    return [codes[i] for i in range(batch)]


DOC_LENS = [248, 212, 7, 1, 300]


def _attention_case(backend) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """backend's attention over DOC_LENS on random fp16 q/k/v, the fp32 reference's, and q/k/v."""
    from gpu_worker.omnivoice.model import document_attention

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(sum(DOC_LENS), 16, 128, device=dev, dtype=torch.float16, generator=g)
    k, v = (torch.randn(sum(DOC_LENS), 8, 128, device=dev, dtype=torch.float16, generator=g) for _ in range(2))
    return backend.plan(DOC_LENS)(q, k, v), document_attention(q.float(), k.float(), v.float(), DOC_LENS), (q, k, v)


@pytest.mark.skipif(not FLASHINFER, reason="needs CUDA and flashinfer")
def test_flashinfer_attention_matches_the_reference():
    from gpu_worker.omnivoice.attention import FlashInferDocuments

    got, want, _ = _attention_case(FlashInferDocuments(16, 8, 128, torch.float16, torch.device("cuda")))
    assert (got.float() - want).abs().max().item() < 2e-3


@pytest.mark.skipif(not COMPILED_TRITON, reason="needs CUDA and compiled triton")
def test_triton_attention_matches_the_reference_and_packs_invariantly():
    from gpu_worker.omnivoice.attention import TritonDocuments

    tr = TritonDocuments(16, 8, 128, torch.float16, torch.device("cuda"))
    got, want, (q, k, v) = _attention_case(tr)
    assert (got.float() - want).abs().max().item() < 2e-3
    alone = tr.plan([212])(q[248:460], k[248:460], v[248:460])
    assert torch.equal(got[248:460], alone)


@pytest.mark.skipif(not FLASHINFER, reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("attention", ["flashinfer", pytest.param("triton", marks=pytest.mark.skipif(
    not COMPILED_TRITON, reason="needs CUDA and compiled triton"))])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graphed_steps_equal_eager_steps(batch, attention):
    model = gpu_model()
    graphed = CanvasEngine(model, max_batch=8, max_packed_rows=2048, cuda_graphs=True, attention=attention)
    eager = CanvasEngine(model, max_batch=8, max_packed_rows=2048, cuda_graphs=False, attention=attention)
    assert graphed.bucketed.replay and not eager.bucketed.replay
    got, want = _run(graphed, batch), _run(eager, batch)
    assert graphed.bucketed.runs == eager.bucketed.runs == 4 and not graphed.bucketed.disabled
    assert len(graphed.bucketed.graphs) and all(g.graph is None for g in eager.bucketed.graphs.values())
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_step_is_reported_once_the_gpu_starts_it_unless_it_brings_codes():
    """A step that finishes no canvas can be reported once the device has reached it (the steps
    before it are done); one that finishes canvases only once its codes are on the host."""
    engine = CanvasEngine(gpu_model(), max_batch=2, attention="torch")
    # A first run of the same shapes: a kernel's first use loads its module (or compiles it), which
    # waits for the device and would hide what the events say.
    for rid in (1, 0):
        engine.start(CanvasSpec(rid, np.arange(200, 210), None, 20, UnmaskKnobs(num_step=2), seed=0))
    for step in (0, 1):
        engine.finish(engine.launch([(1, step)]))
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # ~0.5 s of GPU time ahead of each step
    first = engine.launch([(0, 0)])
    torch.cuda._sleep(1 << 30)
    last = engine.launch([(0, 1)])
    assert not first.ready() and not last.ready()
    first.started.synchronize()  # the device is at the first step; the second waits behind a sleep
    assert first.ready() and last.codes is not None and not last.ready()
    [outcome] = engine.finish(last)
    assert last.ready() and outcome.finished and outcome.codes.shape == (20, 8)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_batched_unmask_equals_the_per_canvas_reference(dtype):
    """Canvases of several lengths and knobs (guided or not, noisy or greedy reveal, penalties, one
    with class noise that keeps the reference path) step together: the same tokens as one by one."""
    model = build_omnivoice(preset="tiny", dtype=dtype, seed=7)
    knobs = [UnmaskKnobs(num_step=6), UnmaskKnobs(num_step=6, guidance_scale=0.0),
             UnmaskKnobs(num_step=6, position_temperature=0.0, layer_penalty_factor=2.0),
             UnmaskKnobs(num_step=6, guidance_scale=3.5, position_temperature=1.5, t_shift=0.5),
             UnmaskKnobs(num_step=6, class_temperature=0.7)]
    results = []
    for batched in (False, True):
        engine = CanvasEngine(model, max_batch=8, batched_unmask=batched)
        text = np.arange(300, 340, dtype=np.int64)
        for i, k in enumerate(knobs):
            engine.start(CanvasSpec(i, text[:6 + 3 * i], None, 9 + 5 * i, k, seed=40 + i))
        codes = {}
        for step in range(6):
            for o in engine.step([(i, step) for i in range(len(knobs))]):
                if o.finished:
                    codes[o.request_id] = o.codes
        results.append([codes[i] for i in range(len(knobs))])
    assert all(np.array_equal(a, b) for a, b in zip(*results))
    assert all((c != 1024).all() for c in results[1])


@pytest.mark.skipif(not COMPILED_TRITON, reason="needs CUDA and compiled triton")
def test_fused_kernels_match_the_torch_ops(monkeypatch):
    from gpu_worker.omnivoice import model as model_module

    model = gpu_model()
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = 96
    ids = torch.randint(0, 1024, (8, rows), device="cuda", generator=g)
    mask = torch.arange(rows, device="cuda") >= 16
    positions = torch.cat([torch.arange(64), torch.arange(32)]).cuda()
    with torch.inference_mode():
        fused = model(ids, mask, positions, [64, 32], torch.arange(16, rows, device="cuda"))
        monkeypatch.setattr(model_module, "KERNELS", "torch")
        plain = model(ids, mask, positions, [64, 32], torch.arange(16, rows, device="cuda"))
    assert (fused - plain).abs().max().item() < 0.05 * plain.abs().max().item()
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean().item() > 0.95


def test_batched_unmask_takes_rows_anywhere_in_the_logits():
    """Items whose rows are not laid out in the engine's order (gathered, not sliced) reveal the
    same cells as the reference."""
    from gpu_worker.omnivoice.batched_unmask import Item, unmask_batch
    from gpu_worker.omnivoice.unmask import step_generator, unmask_step

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 40, 1025, generator=g)
    canvas = [torch.full((8, 7), 1024), torch.full((8, 5), 1024)]
    canvas[0][:, :2] = 3
    knobs = [UnmaskKnobs(), UnmaskKnobs(guidance_scale=0.0, position_temperature=0.0)]
    items = [Item(canvas[0], 20, 3, knobs[0], 9, step_generator(1, 2)), Item(canvas[1], 10, None, knobs[1], 6, None)]
    got = unmask_batch(logits, items, 1024)
    want = [unmask_step(canvas[0], logits[:, 20:27], logits[:, 3:10], knobs[0], 9, 1024, step_generator(1, 2)),
            unmask_step(canvas[1], logits[:, 10:15], None, knobs[1], 6, 1024)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_batched_unmask_of_guided_canvases_only():
    from gpu_worker.omnivoice.batched_unmask import Item, unmask_batch
    from gpu_worker.omnivoice.unmask import step_generator, unmask_step

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 24, 1025, generator=g)  # cond 0:7, 7:12, then uncond 12:19, 19:24
    canvas = [torch.full((8, 7), 1024), torch.full((8, 5), 1024)]
    knobs = [UnmaskKnobs(), UnmaskKnobs(guidance_scale=3.0, layer_penalty_factor=1.0)]
    items = [Item(canvas[0], 0, 12, knobs[0], 11, step_generator(5, 0)),
             Item(canvas[1], 7, 19, knobs[1], 4, step_generator(6, 0))]
    got = unmask_batch(logits, items, 1024)
    want = [unmask_step(canvas[0], logits[:, 0:7], logits[:, 12:19], knobs[0], 11, 1024, step_generator(5, 0)),
            unmask_step(canvas[1], logits[:, 7:12], logits[:, 19:24], knobs[1], 4, 1024, step_generator(6, 0))]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


class _ReferenceInBuckets(TorchDocuments):
    """The torch reference behind flashinfer's bucketed interface (a wrapper of a fixed document
    count, planned per step), so the bucketed forward's buffers and filler run on the CPU."""

    bucketed = True

    def graph_wrapper(self, docs: int) -> dict:
        return {"docs": docs, "lens": None}

    def plan_wrapper(self, wrapper: dict, doc_lens) -> None:
        assert len(doc_lens) == wrapper["docs"]
        wrapper["lens"] = [int(n) for n in doc_lens]

    def attend(self, wrapper: dict):
        from gpu_worker.omnivoice.model import document_attention
        return lambda q, k, v: document_attention(q, k, v, wrapper["lens"])


def test_bucketed_steps_equal_unbucketed_steps_on_the_cpu():
    """Whole generations through the bucketed forward (static buffers reused across steps and
    batches, filler documents) equal the unpadded engine's, bit for bit."""
    from gpu_worker.omnivoice.graphs import BucketedForward

    model = build_omnivoice(preset="tiny", dtype="float64", seed=9)
    plain = CanvasEngine(model, max_batch=8, max_packed_rows=2048)
    bucketed = CanvasEngine(model, max_batch=8, max_packed_rows=2048)
    bucketed.attention = _ReferenceInBuckets()
    bucketed.bucketed = BucketedForward(model, bucketed.attention, 2048, 8, replay=False)
    for batch in (3, 1, 5):
        want, got = _run(plain, batch, frames=12), _run(bucketed, batch, frames=12)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert bucketed.bucketed.runs == 12 and len(bucketed.bucketed.graphs) >= 2


def test_canvases_joining_and_leaving_step_as_they_would_alone():
    """What a step's canvases fix (layout, tables, the bucket's plan, positions and mask) is built
    once and reused while the same canvases step together: canvases that join, finish and leave
    between steps, in buckets and unmasked together, still get each one's codes alone."""
    from gpu_worker.omnivoice.graphs import BucketedForward

    model = build_omnivoice(preset="tiny", dtype="float64", seed=9)

    def engine(bucketed: bool) -> CanvasEngine:
        e = CanvasEngine(model, max_batch=8, max_packed_rows=2048, batched_unmask=True)
        if bucketed:
            e.attention = _ReferenceInBuckets()
            e.bucketed = BucketedForward(model, e.attention, 2048, 8, replay=False)
        return e

    text = np.arange(200, 230, dtype=np.int64)
    specs = [CanvasSpec(i, text[:8 + 3 * i], None, 14 + 5 * i,
                        UnmaskKnobs(num_step=(6, 4, 8)[i], guidance_scale=(2.0, 0.0, 3.0)[i]), seed=30 + i)
             for i in range(3)]
    alone = {}
    for spec in specs:
        e = engine(False)
        e.start(spec)
        for k in range(spec.knobs.num_step):
            (o,) = e.step([(spec.request_id, k)])
        alone[spec.request_id] = o.codes
    e = engine(True)
    joins = {0: specs[0], 2: specs[1], 3: specs[2]}  # step index -> the canvas that starts before it
    got, t = {}, 0
    while len(got) < len(specs):
        if t in joins:
            e.start(joins[t])
        for o in e.step([(rid, c.steps_done) for rid, c in e.canvases.items()]):
            if o.finished:
                got[o.request_id] = o.codes
        t += 1
    assert all(np.array_equal(got[i], alone[i]) for i in alone)
    assert e._packs < t  # some steps reused the step before's tables
    assert len(e) == 0 and e._packed is None
