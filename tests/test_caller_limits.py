"""Per-caller limits (chorus/caller_limits.py): the policy with time passed in, and a real cluster
with two API keys where one key over its cap is refused while the other is served."""

from __future__ import annotations

import os
import queue
import threading
import time

import grpc
import pytest

from chorus.caller_limits import CAP_KEY, RATE_KEY, CallerLimits, Limit

# ---- the policy ------------------------------------------------------------------------------------


def test_no_limits_admit_everything_and_remember_nothing():
    lim = CallerLimits(Limit())
    assert all(lim.admit("a", 0.0) is None for _ in range(1000))
    assert lim.total_open() == 0
    lim.release("a")  # a release without an admit is harmless


def test_the_cap_counts_open_calls_per_owner():
    lim = CallerLimits(Limit(max_calls=2))
    assert lim.admit("a", 0.0) is None and lim.admit("a", 0.0) is None
    refusal = lim.admit("a", 0.0)
    assert refusal.limit == CAP_KEY and refusal.retry_after > 0 and f"{CAP_KEY} = 2" in refusal.message
    assert lim.admit("b", 0.0) is None  # another owner has its own places
    assert lim.open_calls("a") == 2  # the refused call holds none
    lim.release("a")
    assert lim.admit("a", 0.0) is None
    for owner in ("a", "a", "b"):
        lim.release(owner)
    assert lim.total_open() == 0
    lim.release("a")  # more releases than calls: the count stays at 0
    assert lim.open_calls("a") == 0 and lim.admit("a", 0.0) is None


def test_the_bucket_allows_a_burst_then_paces_and_says_when_to_retry():
    lim = CallerLimits(Limit(per_minute=60, burst=3))  # a token a second
    starts = [lim.admit("a", 0.0) for _ in range(4)]
    assert starts[:3] == [None] * 3
    assert starts[3].limit == RATE_KEY and starts[3].retry_after == pytest.approx(1.0)
    for _ in range(3):
        lim.release("a")
    assert lim.admit("b", 0.0) is None  # its own bucket
    refusal = lim.admit("a", 0.25)
    assert refusal.retry_after == pytest.approx(0.75)  # the refused attempt consumed nothing
    assert lim.admit("a", 1.0) is None  # the hint was right
    assert lim.admit("a", 1.0) is not None
    lim.release("a")
    assert [lim.admit("a", 100.0) is None for _ in range(4)] == [True] * 3 + [False]  # refills to burst only


def test_the_cap_refuses_before_the_bucket_spends_a_token():
    lim = CallerLimits(Limit(max_calls=1, per_minute=60, burst=2))
    assert lim.admit("a", 0.0) is None
    assert lim.admit("a", 0.0).limit == CAP_KEY
    lim.release("a")
    assert lim.admit("a", 0.0) is None  # the second token was kept by the cap's refusal


def test_a_rate_below_one_a_minute_still_admits_its_burst():
    lim = CallerLimits(Limit(per_minute=0.5, burst=1))
    assert lim.admit("", 0.0) is None
    assert lim.admit("", 60.0).retry_after == pytest.approx(60.0)


def test_the_gateway_turns_the_hint_into_retry_after():
    from gateway_svc.errors import from_rpc

    err = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                               grpc.aio.Metadata(("retry-after-ms", "2500")), f"over the limit ({CAP_KEY} = 1)")
    resp = from_rpc(err, retry_after=9).response()
    assert (resp.status_code, resp.headers["retry-after"]) == (429, "3")


# ---- a real cluster -------------------------------------------------------------------------------

KEY_A = "caller-a-0123456789abcdef"
KEY_B = "caller-b-0123456789abcdef"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from helpers import make_cluster

    keys = os.path.join(str(tmp_path_factory.mktemp("keys")), "api_keys")
    with open(keys, "w") as fh:
        fh.write(f"alice {KEY_A}\nbob {KEY_B}\n")
    with make_cluster(worker_args=["--max-batch", "4"],
                      scheduler_args=["--api-keys", keys, "--max-calls-per-owner", "1"]) as c:
        yield c


def _metadata(key: str):
    return (("authorization", f"Bearer {key}"),)


def _synthesize(stub, key: str):
    """The call's response count, or its error."""
    from helpers import seeded_request
    try:
        return sum(1 for _ in stub.Synthesize(seeded_request(frames=4), timeout=60, metadata=_metadata(key)))
    except grpc.RpcError as e:
        return e


def _served_within(stub, key: str, seconds: float):
    """The first outcome that is not a cap refusal, retrying those (an ended call's place frees as the
    server sees the end), or the last refusal."""
    deadline = time.monotonic() + seconds
    while True:
        out = _synthesize(stub, key)
        if not isinstance(out, grpc.RpcError) or out.code() != grpc.StatusCode.RESOURCE_EXHAUSTED \
                or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


def test_a_key_over_its_cap_is_refused_while_another_is_served_and_no_place_leaks(cluster):
    from chorus.client import channel
    from chorus.retry_hint import retry_hint
    from chorus.v1 import tts_pb2, tts_pb2_grpc
    from helpers import metric, seeded_request

    stub = tts_pb2_grpc.TextToSpeechStub(channel(cluster.address))
    # alice holds her one place with a SynthesizeStream session that waits for more text
    feed: queue.Queue = queue.Queue()
    config = seeded_request(text="", frames=4)
    for m in (tts_pb2.SynthesizeStreamRequest(config=config), tts_pb2.SynthesizeStreamRequest(text="Hello there."),
              tts_pb2.SynthesizeStreamRequest(signal=tts_pb2.FLUSH)):
        feed.put(m)
    session = stub.SynthesizeStream(iter(feed.get, None), timeout=60, metadata=_metadata(KEY_A))
    next(session)  # the session is admitted and running

    refused = _synthesize(stub, KEY_A)
    assert isinstance(refused, grpc.RpcError), refused
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and CAP_KEY in refused.details()
    assert retry_hint(refused) > 0
    assert isinstance(_synthesize(stub, KEY_B), int)  # bob is served meanwhile

    feed.put(tts_pb2.SynthesizeStreamRequest(signal=tts_pb2.END))
    feed.put(None)
    list(session)
    assert isinstance(_served_within(stub, KEY_A, 5), int)

    # a storm of calls cancelled at every stage (before, while and after being admitted) leaves no place held
    def storm(i: int) -> None:
        call = stub.Synthesize(seeded_request(frames=40), timeout=60, metadata=_metadata(KEY_A if i % 3 else KEY_B))
        try:
            for _ in range(i % 4):
                next(call)
        except (grpc.RpcError, StopIteration):
            pass
        call.cancel()

    threads = [threading.Thread(target=storm, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key in (KEY_A, KEY_B):
        assert isinstance(_served_within(stub, key, 10), int)
    deadline = time.monotonic() + 10
    while metric(cluster, "chorus_active_streams") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(cluster, "chorus_active_streams") == 0

    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert f'chorus_caller_refusals_total{{limit="{CAP_KEY}"}}' in text
