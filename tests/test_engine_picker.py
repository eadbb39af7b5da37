"""The engine picker's policy: rendezvous ranking per key, bounded by load."""

from collections import Counter

from scheduler_svc.engine_picker import load_bound, pick, rank

KEYS = [f"voice-{i}".encode() for i in range(2000)]


def idle(*names: str) -> dict[str, float]:
    return {n: 0.0 for n in names}


def test_assignment_is_stable_and_order_free():
    a = idle("tcp://10.0.0.1:5570", "tcp://10.0.0.2:5570", "tcp://10.0.0.3:5570")
    b = dict(reversed(list(a.items())))
    assert [pick(k, a) for k in KEYS] == [pick(k, b) for k in KEYS] == [pick(k, dict(a)) for k in KEYS]


def test_keys_spread_over_engines():
    engines = idle("e0", "e1", "e2", "e3")
    counts = Counter(pick(k, engines) for k in KEYS)
    assert set(counts) == set(engines)
    assert min(counts.values()) > len(KEYS) / len(engines) * 0.8


def test_a_joining_engine_takes_keys_only_from_the_others():
    before = idle("e0", "e1", "e2", "e3")
    after = {**before, "e4": 0.0}
    moved = [k for k in KEYS if pick(k, before) != pick(k, after)]
    assert all(pick(k, after) == "e4" for k in moved)  # nothing moves between the old engines
    assert 0.12 < len(moved) / len(KEYS) < 0.28          # about 1/5 of the keys


def test_a_leaving_engine_moves_only_its_own_keys():
    before = idle("e0", "e1", "e2", "e3")
    after = idle("e0", "e1", "e3")
    for k in KEYS:
        if pick(k, before) != "e2":
            assert pick(k, after) == pick(k, before)
        else:
            assert pick(k, after) == rank(k, before)[1]  # the next ranked engine


def test_a_loaded_engine_sheds_to_the_next_ranked():
    key = b"hot voice"
    first, second, third = rank(key, ["e0", "e1", "e2"])
    loads = {first: 10.0, second: 0.0, third: 0.0}
    assert load_bound(loads, 0.25, 2.0) < 10
    assert pick(key, loads, slack=0.25, margin=2.0) == second
    loads = {first: 4.0, second: 4.0, third: 4.0}  # even load: affinity holds
    assert pick(key, loads) == first
    assert pick(key, {first: 3.0, second: 1.0, third: 1.0}, slack=0.0, margin=0.0) == second


def test_without_a_key_the_least_loaded_serves():
    assert pick(None, {"e0": 3.0, "e1": 1.0, "e2": 2.0}) == "e1"
    assert pick(None, idle("e1", "e0")) == "e0"  # ties: by name, the same on every frontend


def test_no_live_engine():
    assert pick(b"k", {}) is None
    assert pick(None, {}) is None


# ---- what the pool hands the picker ----------------------------------------------------------------

def test_affinity_keys():
    from chorus.v1 import common_pb2, tts_pb2
    from scheduler_svc.engine_pool import affinity_key

    def req(**ref):
        r = tts_pb2.SynthesizeRequest(text="hi")
        r.references.add(**ref)
        return r

    assert affinity_key(tts_pb2.SynthesizeRequest(text="hi")) is None  # no prefix to share: least loaded
    assert affinity_key(req(voice_id="v")) == affinity_key(req(voice_id="v"))
    assert affinity_key(req(voice_id="v"), "alice") != affinity_key(req(voice_id="v"), "bob")  # each owner's own
    clip = common_pb2.AudioData(data=b"RIFF....")
    assert affinity_key(req(audio=clip)) == affinity_key(req(audio=clip)) != affinity_key(req(voice_id="v"))


def test_engines_resolve_by_dns():
    from scheduler_svc.engine_pool import resolve

    assert resolve("tcp://10.0.0.7:5570") == {"tcp://10.0.0.7:5570"}
    assert "tcp://127.0.0.1:5570" in resolve("dns:///localhost:5570")
