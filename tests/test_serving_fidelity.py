"""The serving path — several requests batched in the worker, through the real
services — produces exactly the reference generator's frames, in float32."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from chorus.client import channel, synthesize
from chorus.prompt import build_prompt_rows
from chorus.tokenizer import load_tokenizer
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc
from gpu_worker.loader import build_model
from gpu_worker.reference import generate_reference
from scheduler_svc.validation import resolve_sampling

VOICE = np.random.default_rng(3).integers(0, 1024, size=(9, 12), dtype=np.int32)
CASES = [  # text, seed, reference?, min_frames, max_frames
    ("Reference generator, meet the serving path.", 5, False, 4, 18),
    ("A cloned voice says this.", 6, True, 6, 16),
    ("Greedy or not, the frames must agree.", 7, False, 0, 12),
]


@pytest.fixture(scope="module")
def model():
    return build_model(preset="tiny", dtype="float32", seed=0)  # the cluster worker's weights


def test_services_match_reference_generator(cluster, model):
    stub = tts_pb2_grpc.TextToSpeechStub(channel(cluster.address))
    tok = load_tokenizer(None)
    requests, expected = [], []
    for text, seed, clone, lo, hi in CASES:
        req = tts_pb2.SynthesizeRequest(text=text, language="English", min_frames=lo, max_frames=hi,
                                        return_codes=True)
        req.sampling.seed = seed
        refs = []
        if clone:
            req.references.add(codes=common_pb2.IntMatrix(rows=VOICE.shape[0], cols=12, data=VOICE.tobytes()))
            refs = [VOICE]
        requests.append(req)
        rows = build_prompt_rows(model.cfg, tok, text, language="English", references=refs)
        frames, stopped = generate_reference(model, rows, resolve_sampling(req.sampling, lo), hi)
        expected.append((np.asarray(frames, dtype=np.int32).reshape(-1, 13)[:, 1:], stopped))
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: synthesize(stub, r, timeout=120), requests))
    for (want, stopped), got in zip(expected, results):
        assert np.array_equal(got.code_frames().reshape(-1, 12), want)
        assert got.summary.finish_reason == (tts_pb2.STOP if stopped else tts_pb2.MAX_FRAMES)
