"""OmniVoice's canvases through the real services (frontend, core, worker, codec vocoder): what
the worker's engine gives in-process (whose tokens equal the reference package's:
test_omnivoice_model.py), and the same tokens whatever else shares the packed steps."""

import threading
import time
import urllib.request

import numpy as np
import pytest

from chorus.client import channel, synthesize
from chorus.omnivoice.knobs import UnmaskKnobs
from chorus.omnivoice.prompt import plan_pieces
from chorus.omnivoice.tokenizer import load_omnivoice_tokenizer
from chorus.v1 import tts_pb2, tts_pb2_grpc
from gpu_worker.omnivoice.engine import CanvasEngine, CanvasSpec
from gpu_worker.omnivoice.loader import build_omnivoice

MODEL = "omnivoice-tiny"


@pytest.fixture(scope="module")
def stub(omnivoice_cluster):
    return tts_pb2_grpc.TextToSpeechStub(channel(omnivoice_cluster.address))


def request(text: str, seed: int, **knobs) -> tts_pb2.SynthesizeRequest:
    req = tts_pb2.SynthesizeRequest(text=text, model=MODEL, language="en", return_codes=True)
    req.sampling.seed = seed
    for k, v in knobs.items():
        setattr(req.omnivoice, k, v)
    return req


def lookahead_steps(cluster) -> float:
    """The core's OmniVoice steps sent before the previous journal returned."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f'chorus_canvas_lookahead_steps_total{{model="{MODEL}"}} '):
                return float(line.split()[-1])
    return 0.0


def test_the_served_canvas_is_the_engines_canvas(stub):
    text, knobs = "A greedy canvas through every service.", dict(num_step=6, position_temperature=0.0)
    served = synthesize(stub, request(text, 5, **knobs), timeout=300).code_frames()
    piece = plan_pieces(load_omnivoice_tokenizer(None), text, language="en")[0]
    engine = CanvasEngine(build_omnivoice(preset="tiny", dtype="float32"))
    engine.start(CanvasSpec(1, np.asarray(piece.text_ids), None, piece.target_frames, UnmaskKnobs(**knobs), seed=0))
    for k in range(knobs["num_step"]):
        (outcome,) = engine.step([(1, k)])
    assert np.array_equal(served, outcome.codes)


def test_a_request_gets_the_same_tokens_alone_and_packed_beside_others(stub, omnivoice_cluster):
    """Seeded noise (position and class temperature on): the same canvas alone and joining two
    requests mid-way, one without guidance and one with other knobs, so it runs at other step
    indices beside documents of other shapes; the core keeps two steps in flight (lookahead) all
    along, and the tokens equal the engine's own, one step at a time (the first test)."""
    before = lookahead_steps(omnivoice_cluster)
    mine = request("Packing must not change a single token.", 77, num_step=8, class_temperature=0.7)
    alone = synthesize(stub, mine, timeout=300).code_frames()
    others = [request("A neighbour without guidance that runs for a while longer.", 1, num_step=24,
                      guidance_scale=0.0),
              request("Another neighbour, guided harder.", 2, num_step=16, guidance_scale=3.5, t_shift=0.5)]
    threads = [threading.Thread(target=synthesize, args=(stub, r), kwargs={"timeout": 300}) for r in others]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the neighbours are a few steps in when this one joins
    packed = synthesize(stub, mine, timeout=300).code_frames()
    for t in threads:
        t.join()
    assert np.array_equal(packed, alone)
    assert lookahead_steps(omnivoice_cluster) > before
    other_seed = synthesize(stub, request("Packing must not change a single token.", 78, num_step=8,
                                          class_temperature=0.7), timeout=300).code_frames()
    assert not np.array_equal(other_seed, alone)
