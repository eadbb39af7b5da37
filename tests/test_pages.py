"""KV pages: the worker declares a page size, the scheduler allocates whole pages, and the
attention backends turn slot lists into page tables (flashinfer reads pages of 16 rows)."""

import numpy as np
import pytest

from chorus.prompt import build_prompt_rows
from chorus.tokenizer import load_tokenizer
from chorus.v1 import worker_pb2
from gpu_worker.attention import page_table
from gpu_worker.engine import Engine
from gpu_worker.loader import build_model
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.config import SchedulerConfig
from chorus.wire import rows_matrix
from scheduler_svc.validation import resolve_sampling
from chorus.v1 import tts_pb2


def csr(seqs):
    indptr = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    return indptr, np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])


def test_page_table_of_aligned_sequences():
    # P=4: sequence 0 fills page 5 then two rows of page 2; sequence 1 one row of page 0; sequence 2 page 7
    seqs = [list(range(20, 24)) + [8, 9], [0], list(range(28, 32))]
    indptr, pages, last = page_table(*csr(seqs), page_size=4)
    assert indptr.tolist() == [0, 2, 3, 4]
    assert pages.tolist() == [5, 2, 0, 7]
    assert last.tolist() == [2, 1, 4]
    assert pages.dtype == np.int32 and indptr.dtype == np.int32


def test_page_size_one_is_the_slot_list():
    seqs = [[3, 9, 4], [7]]
    indptr, pages, last = page_table(*csr(seqs), page_size=1)
    assert indptr.tolist() == [0, 3, 4] and pages.tolist() == [3, 9, 4, 7] and last.tolist() == [1, 1]


@pytest.mark.parametrize("seqs", [
    [[1, 2, 3]],                 # does not start on a page boundary
    [[0, 1, 2, 3, 9]],           # the fifth row is not the first row of its page
    [[0, 1, 3]],                 # a skipped row shows at the sequence's end
])
def test_misaligned_slots_are_refused(seqs):
    with pytest.raises(ValueError, match="whole pages of 4"):
        page_table(*csr(seqs), page_size=4)


@pytest.fixture(scope="module")
def model():
    return build_model(preset="tiny", dtype="float64", seed=0)


def run(engine: Engine, prompts: dict, frames: int, page: int) -> dict:
    """Whole-prompt prefill then decodes; request r owns slots [r*512, (r+1)*512)."""
    held = {rid: 0 for rid in prompts}

    def slots(rid, n):
        first = rid * 512 + held[rid]
        held[rid] += n
        return list(range(first, first + n))

    out = {rid: [] for rid in prompts}
    plan = worker_pb2.StepPlan(step_id=0)
    for rid, rows in prompts.items():
        it = plan.prefill.add(request_id=rid, first_chunk=True, last_chunk=True, prompt_length=len(rows))
        it.rows.CopyFrom(rows_matrix(rows))
        it.kv_slots.extend(slots(rid, len(rows)))
        it.sampling.CopyFrom(resolve_sampling(tts_pb2.SamplingParams(seed=rid), min_frames=frames))
    for _ in range(frames):
        j = engine.execute(plan)
        rows = np.frombuffer(j.rows.data, "<i4").reshape(j.rows.rows, j.rows.cols)
        for i, rid in enumerate(j.request_ids):
            out[rid].append(rows[i].tolist())
        plan = worker_pb2.StepPlan(step_id=0)
        for rid in prompts:
            plan.decode.add(request_id=rid, kv_slot=slots(rid, 1)[0])
    return out


def test_engine_page_size_changes_no_frame(model):
    tok = load_tokenizer(None)
    prompts = {1: build_prompt_rows(model.cfg, tok, "Hello there.", language="English"),
               2: build_prompt_rows(model.cfg, tok, "Another, longer one.", language="English")}
    small = Engine(model, num_kv_slots=2048, max_batch=4, max_context=512, page_size=1)
    paged = Engine(model, num_kv_slots=2048 + 5, max_batch=4, max_context=512, page_size=16)
    assert paged.kv_capacity == 2048 - 16 and paged.scratch_slot == 2032  # last whole page is scratch
    assert paged.warm_up() >= 0
    assert run(small, prompts, 6, 1) == run(paged, prompts, 6, 16)


def test_engine_refuses_slots_off_the_pages(model):
    engine = Engine(model, num_kv_slots=256, max_batch=2, max_context=64, page_size=16)
    rows = build_prompt_rows(model.cfg, load_tokenizer(None), "Hi.", language="English")
    plan = worker_pb2.StepPlan(step_id=0)
    it = plan.prefill.add(request_id=1, first_chunk=True, last_chunk=True, prompt_length=len(rows))
    it.rows.CopyFrom(rows_matrix(rows))
    it.kv_slots.extend(range(3, 3 + len(rows)))
    it.sampling.CopyFrom(resolve_sampling(tts_pb2.SamplingParams(seed=1), min_frames=1))
    with pytest.raises(ValueError, match="whole pages of 16"):
        engine.execute(plan)


def test_scheduler_takes_the_workers_page_size():
    hello = worker_pb2.Hello(kv_slots=1024, max_batch=8, max_context=512, page_size=16)
    assert Scheduler(None, hello, SchedulerConfig()).kv.page_size == 16
    assert Scheduler(None, hello, SchedulerConfig(page_size=32)).kv.page_size == 32
    assert Scheduler(None, worker_pb2.Hello(kv_slots=64, max_batch=8), SchedulerConfig()).kv.page_size == 1
    with pytest.raises(ValueError, match="not a multiple of the worker's page size 16"):
        Scheduler(None, hello, SchedulerConfig(page_size=8))
