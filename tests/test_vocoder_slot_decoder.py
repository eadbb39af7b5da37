"""SlotDecoder (vocoder_svc/slot_decoder.py): slot-based batched streaming decode.

Tiny random-weight codecs on CPU. The slot decoder runs the same step function
that CUDA graphs capture on GPU; here it runs eagerly, and the graph
bookkeeping (static buffers, scratch-row warm-up, replay) runs in "emulate"
mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vocoder_svc.codec import rope_cos_sin, tiny_v2, window_mask
from vocoder_svc.codec_checkpoint import build_codec
from vocoder_svc.slot_decoder import SlotDecoder, default_buckets
from vocoder_svc.slot_plan import rope_freq
from vocoder_svc.window_attention import chunk_window_mask

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)

# Chunk partitions of 30 frames. Tiny windows: 10 tokens at stage 0 (0.8 s), 20 at every faster
# stage, and one frame is 32 tokens at the top stage, so every chunk there is longer than W and
# the stream is longer than every window.
PARTS = [[30], [5, 25], [1, 1, 1, 1, 1, 25], [2, 3, 5, 13, 7], [12, 1, 17]]



@pytest.fixture(scope="module")
def v2_32():
    return build_codec(tiny_v2(), seed=1, dtype=torch.float32)


def codes_for(t, n_q=32, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1024, (n_q, b, t), generator=g)


def bound(ref, rel):
    return rel * max(1.0, ref.abs().max().item())


def state_snapshot(s: SlotDecoder):
    return [s._frames.clone()] + [t.clone() for kind, st in s._plan if kind == "stage" for t in (*st.k, *st.v)]


# ---- equivalence with the codec -----------------------------------------------------------------------

def test_rope_freq_matches_codec():
    pos = torch.tensor([0, 1, 1000, 123_457])
    cos, sin = rope_cos_sin(pos, 64, 10000.0)
    angle = pos.to(torch.float32).unsqueeze(-1) * rope_freq(64, 10000.0, torch.device("cpu"))
    assert torch.equal(torch.cos(angle), cos) and torch.equal(torch.sin(angle), sin)


def test_chunk_mask_equals_codec_window_mask():
    offset = torch.tensor([0, 1, 3, 7, 10, 11, 500])
    for w, tk in [(3, 1), (3, 5), (10, 4), (20, 64), (1, 3)]:
        pos = offset.unsqueeze(1) + torch.arange(-w, tk)  # cache positions (negative = empty), then chunk
        assert torch.equal(chunk_window_mask(offset, w, tk), window_mask(pos[:, w:], pos, w))


@pytest.mark.parametrize("which", ["v2", "v1"])
def test_slot_decoder_equals_offline_float64(which, v2_64, v1_64):
    codec = v2_64 if which == "v2" else v1_64
    codes = codes_for(30, seed=3)
    ref = codec.decode(codes)[0]
    s = SlotDecoder(codec, slots=2)
    for parts in PARTS:
        out = s.decode_stream(codes[:, 0], parts)
        assert out.shape == ref.shape and out.dtype == F64
        assert (out - ref).abs().max().item() <= bound(ref, 1e-9), parts
    assert s.free_slots == 2


def test_slot_decoder_equals_offline_float32_and_codec_stream(v2_32):
    codes = codes_for(30, n_q=12, seed=4)
    ref = v2_32.decode(codes)[0]
    s = SlotDecoder(v2_32, slots=2, n_q=12)
    assert (s.attention_path, s.glue_impl, s.glue_fallback) == ("torch", "torch", None)  # auto on the CPU
    for parts in PARTS:
        out = s.decode_stream(codes[:, 0], parts)
        assert (out - ref).abs().max().item() <= bound(ref, 4e-6), parts
    # and the codec's own streaming decode with the same chunks
    state, outs, i = v2_32.new_stream(), [], 0
    for n in PARTS[3]:
        outs.append(v2_32.decode_step(state, codes[:, :, i:i + n])[0])
        i += n
    out = s.decode_stream(codes[:, 0], PARTS[3])
    assert (out - torch.cat(outs, -1)).abs().max().item() <= bound(ref, 4e-6)


def test_bf16_compute_is_close_and_finite(v2_32):
    codes = codes_for(12, n_q=12, seed=5)
    ref = v2_32.decode(codes)[0]
    s = SlotDecoder(v2_32, slots=1, n_q=12, compute_dtype=torch.bfloat16)
    assert s.residual_dtype == torch.float32
    assert all(t.dtype == torch.bfloat16 for kind, st in s._plan if kind == "stage" for t in st.k)
    out = s.decode_stream(codes[:, 0], [5, 7])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    assert err < 0.1, err  # bf16 GEMMs on a random-weight toy: a few 1e-3 typically
    assert (out - ref).norm() / ref.norm() < 0.05


# ---- batching ------------------------------------------------------------------------------------------

def run_streams(s: SlotDecoder, codes, parts, together: bool, eager: bool = False):
    """Decode streams codes[:, b] with the same chunk sizes; together in one step each, or one by one."""
    n = codes.shape[1]
    slots = [s.acquire() for _ in range(n)]
    outs = {b: [] for b in range(n)}
    i = 0
    for p in parts:
        groups = [list(range(n))] if together else [[b] for b in range(n)]
        for g in groups:
            res = s.step({slots[b]: codes[:, b, i:i + p] for b in g}, eager=eager)
            for b in g:
                outs[b].append(res[slots[b]])
        i += p
    for sl in slots:
        s.release(sl)
    return [torch.cat(outs[b], -1) for b in range(n)]


def test_batch_independence_same_bucket_is_bitwise(v2_64, v2_32):
    parts = [5, 25, 3]
    for codec in (v2_64, v2_32):
        codes = codes_for(33, n_q=12, b=3, seed=6)
        s = SlotDecoder(codec, slots=4, n_q=12, buckets=[4])  # alone or three together: both bucket 4
        together = run_streams(s, codes, parts, together=True)
        alone = run_streams(s, codes, parts, together=False)
        for a, b in zip(together, alone):
            assert torch.equal(a, b)
        ref = codec.decode(codes)
        for b in range(3):
            assert (together[b] - ref[b]).abs().max().item() <= bound(ref, 1e-9 if codec is v2_64 else 4e-6)


def test_batch_independence_across_buckets_float64(v2_64):
    codes = codes_for(31, n_q=12, b=5, seed=7)
    s = SlotDecoder(v2_64, slots=8, n_q=12)
    assert s.buckets == (1, 2, 4, 8)
    together = run_streams(s, codes, [6, 25], together=True)  # bucket 8 (3 scratch rows)
    alone = run_streams(s, codes, [6, 25], together=False)  # bucket 1
    for a, b in zip(together, alone):
        assert (a - b).abs().max().item() <= bound(b, 1e-12)


def test_slots_interleaved_and_scratch_rows_leave_state_alone(v2_64):
    """Stream A stepped between other streams' steps (padded with scratch rows, graph warm-ups on
    scratch rows) gives the same bytes as A alone; a step changes only its participants' rows."""
    codes = codes_for(30, n_q=12, b=3, seed=8)
    ref_s = SlotDecoder(v2_64, slots=4, n_q=12)
    ref = ref_s.decode_stream(codes[:, 0], [5, 10, 15])

    s = SlotDecoder(v2_64, slots=4, n_q=12, graphs="emulate", graph_frames=[3])
    a, b, c, d = s.acquire(), s.acquire(), s.acquire(), s.acquire()
    outs, i = [], 0
    for p in [5, 10, 15]:
        s.step({b: codes[:, 1, :3]})  # bucket 1, emulated graph (captured lazily: warm-up on scratch rows)
        s.step({b: codes[:, 1, :2], c: codes[:, 2, :2]})  # bucket 2
        s.step({c: codes[:, 2, :4], b: codes[:, 1, :4], d: codes[:, 0, :4]})  # bucket 4: one scratch row
        before = state_snapshot(s)
        outs.append(s.step({a: codes[:, 0, i:i + p]})[a])  # bucket 1, eager
        after = state_snapshot(s)
        others = [r for r in range(s.slots) if r != a]  # every other slot is bit-identical
        for x, y in zip(before, after):
            assert torch.equal(x[others], y[others])
        i += p
    assert torch.equal(torch.cat(outs, -1), ref)
    s.capture(buckets=[4], frames=[2, 7])  # capturing while streams are live changes no slot
    assert s.captured == [(1, 3), (4, 2), (4, 7)]
    for x, y in zip(state_snapshot(s), after):
        assert torch.equal(x[:s.slots], y[:s.slots])


def test_padding_rows_pure_and_scratch_step_isolated(v2_64):
    """A padded step leaves every other slot bit-identical, even with garbage in the scratch rows."""
    s = SlotDecoder(v2_64, slots=4, n_q=12)
    x, y = s.acquire(), s.acquire()
    s.step({x: codes_for(4, 12, seed=9)[:, 0], y: codes_for(4, 12, seed=10)[:, 0]})
    with torch.inference_mode():  # scribble over every scratch row: positions and K/V
        s._frames[s.slots:] = 12345
        for kind, st in s._plan:
            if kind == "stage":
                for t in (*st.k, *st.v):
                    t[s.slots:] = 1e6
    before = state_snapshot(s)
    out1 = s.step({x: codes_for(3, 12, seed=11)[:, 0], y: codes_for(3, 12, seed=12)[:, 0]})  # bucket 2
    s2 = SlotDecoder(v2_64, slots=4, n_q=12)
    x2, y2 = s2.acquire(), s2.acquire()
    s2.step({x2: codes_for(4, 12, seed=9)[:, 0], y2: codes_for(4, 12, seed=10)[:, 0]})
    z = s.acquire()  # a third stream forces bucket 4 with one scratch row
    out2 = s.step({x: codes_for(2, 12, seed=13)[:, 0], y: codes_for(2, 12, seed=14)[:, 0],
                   z: codes_for(2, 12, seed=15)[:, 0]})
    ref1 = s2.step({x2: codes_for(3, 12, seed=11)[:, 0], y2: codes_for(3, 12, seed=12)[:, 0]})
    z2 = s2.acquire()
    ref2 = s2.step({x2: codes_for(2, 12, seed=13)[:, 0], y2: codes_for(2, 12, seed=14)[:, 0],
                    z2: codes_for(2, 12, seed=15)[:, 0]})
    assert torch.equal(out1[x], ref1[x2]) and torch.equal(out1[y], ref1[y2])
    assert torch.equal(out2[x], ref2[x2]) and torch.equal(out2[z], ref2[z2])
    after = state_snapshot(s)
    # slot 3 (never used) is untouched through both steps
    for a, b in zip(before, after):
        assert torch.equal(a[3], b[3])


def test_release_then_acquire_is_a_fresh_stream(v2_64):
    s = SlotDecoder(v2_64, slots=1, n_q=12)
    codes = codes_for(20, n_q=12, b=2, seed=16)
    slot = s.acquire()
    s.step({slot: codes[:, 0, :13]})
    assert s.frames_decoded(slot) == 13
    s.release(slot)
    slot2 = s.acquire()
    assert slot2 == slot and s.frames_decoded(slot2) == 0
    out = torch.cat([s.step({slot2: codes[:, 1, :7]})[slot2], s.step({slot2: codes[:, 1, 7:]})[slot2]], -1)
    fresh = SlotDecoder(v2_64, slots=1, n_q=12).decode_stream(codes[:, 1], [7, 13])
    assert torch.equal(out, fresh)
    s.reset(slot2)
    assert torch.equal(s.step({slot2: codes[:, 1, :7]})[slot2], fresh[:, :7 * s.hop])


def test_emulated_graphs_bitwise_equal_eager(v1_64):
    codes = codes_for(26, n_q=32, b=3, seed=17)
    eager = SlotDecoder(v1_64, slots=4, graphs=False)
    graphed = SlotDecoder(v1_64, slots=4, graphs="emulate", graph_frames=[1, 25])
    graphed.capture(buckets=[4], frames=[25])
    a = run_streams(eager, codes, [1, 25], together=True)
    b = run_streams(graphed, codes, [1, 25], together=True)
    assert graphed.captured == [(4, 1), (4, 25)] and graphed.last_step_graphed
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    c = run_streams(graphed, codes, [1, 25], together=True, eager=True)
    assert not graphed.last_step_graphed
    for x, y in zip(a, c):
        assert torch.equal(x, y)
    out = graphed.decode_stream(codes[:, 0], [25, 1])
    ref = v1_64.decode(codes[:, :1])[0]
    assert (out - ref).abs().max().item() <= bound(ref, 1e-9)


def test_api_errors_and_facts(v2_64):
    assert default_buckets(1) == (1,) and default_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert default_buckets(60) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 60)
    assert default_buckets(6) == (1, 2, 4, 6)
    s = SlotDecoder(v2_64, slots=2, n_q=12)
    assert s.bucket_for(1) == 1 and s.bucket_for(2) == 2 and s.scratch == 2 and s.rows == 4
    a, b = s.acquire(), s.acquire()
    with pytest.raises(RuntimeError):
        s.acquire()
    with pytest.raises(ValueError, match="same codes shape"):
        s.step({a: torch.zeros(12, 3, dtype=torch.long), b: torch.zeros(12, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match="n_q=12"):
        s.step({a: torch.zeros(11, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"\[0, 1024\)"):
        s.step({a: torch.full((12, 3), 1024)})
    with pytest.raises(ValueError, match="at least one frame"):
        s.step({a: torch.zeros(12, 0, dtype=torch.long)})
    s.release(b)
    with pytest.raises(ValueError, match="not acquired"):
        s.step({b: torch.zeros(12, 3, dtype=torch.long)})
    with pytest.raises(ValueError):
        SlotDecoder(v2_64, slots=4, buckets=[1, 2])
    with pytest.raises(ValueError):
        SlotDecoder(v2_64, slots=1, graphs=True)  # no CUDA here
    assert s.state_nbytes() > 0
    assert s.step({}) == {}
    out = s.step({a: torch.zeros(12, 2, dtype=torch.long)}, to_cpu=True)[a]
    assert out.shape == (2, 2 * 3840) and out.device.type == "cpu"


def test_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "chorus.bench.vocoder_bench", "--preset", "tiny",
                           "--device", "cpu", "--dtype", "float32", "--streams", "1,2", "--iters", "1",
                           "--offline-frames", "8", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["status"] == "ok" and res["torch"] == torch.__version__
    assert {"streaming", "first_chunk", "offline", "checks", "floor"} <= res.keys()
    assert res["checks"]["slots_vs_offline"]["rel_max_abs_diff"] < 1e-4


def test_results_never_alias_graph_memory(v2_32):
    """to_cpu on a CPU slot decoder with emulated graphs still hands back fresh tensors: a later replay of
    the same graph must not change an earlier result."""
    s = SlotDecoder(v2_32, slots=2, n_q=12, graphs="emulate", graph_frames=[3])
    a, b = s.acquire(), s.acquire()
    codes = codes_for(6, n_q=12, b=2, seed=18)
    for to_cpu in (True, False):
        first = s.step({a: codes[:, 0, :3], b: codes[:, 1, :3]}, to_cpu=to_cpu)
        assert s.last_step_graphed
        keep = {k: v.clone() for k, v in first.items()}
        s.step({a: codes[:, 0, 3:], b: codes[:, 1, 3:]}, to_cpu=to_cpu)  # same graph, other codes
        assert all(torch.equal(first[k], keep[k]) for k in first)
        s.reset(a), s.reset(b)


def test_forced_bucket_and_stream_limit(v2_32):
    """step(bucket=B) pads a lone stream to bucket B: bitwise what it gets next to others in B."""
    codes = codes_for(8, n_q=12, b=3, seed=19)
    s = SlotDecoder(v2_32, slots=4, n_q=12)
    x, y, z = s.acquire(), s.acquire(), s.acquire()
    together = s.step({x: codes[:, 0], y: codes[:, 1], z: codes[:, 2]})  # bucket 4
    s.reset(x)
    padded = s.step({x: codes[:, 0]}, bucket=3)  # smallest bucket >= 3: 4
    s.reset(x)
    alone = s.step({x: codes[:, 0]})  # bucket 1
    assert torch.equal(padded[x], together[x])
    assert (alone[x] - together[x]).abs().max().item() <= bound(alone[x], 4e-6)
    assert s.max_stream_frames == (1 << 24) // 7680  # 2184 frames (~175 s) for the v2 hop
    with pytest.raises(ValueError, match="2184 frames"):
        s.step({y: torch.zeros(12, s.max_stream_frames, dtype=torch.long)})


def test_step_pcm_is_the_wire_encoding_of_step(v2_32):
    """step_pcm's bytes are exactly what the service built from step's tensors before: encode_pcm16 of the
    interleaved audio for int16 slots, little-endian float32 for the others, both kinds in one step."""
    import numpy as np

    from chorus.audio import encode_pcm16

    codes = codes_for(10, n_q=12, b=3, seed=21)
    ref = SlotDecoder(v2_32, slots=3, n_q=12, graphs="emulate", graph_frames=[5])
    got = SlotDecoder(v2_32, slots=3, n_q=12, graphs="emulate", graph_frames=[5])
    slots = [ref.acquire() for _ in range(3)]
    assert [got.acquire() for _ in range(3)] == slots
    for t in (0, 5):
        chunk = {s: codes[:, i, t:t + 5] for i, s in enumerate(slots)}
        want = ref.step(chunk, to_cpu=True)
        pcm = got.step_pcm(chunk, int16=[slots[0], slots[2]])
        for s in slots:
            wav = want[s].numpy().T  # [T*hop, C]
            expect = encode_pcm16(wav) if s != slots[1] else np.ascontiguousarray(wav).astype("<f4").tobytes()
            assert pcm[s] == expect
    assert got.step_pcm({}) == {}


def test_launch_pcm_runs_ahead_of_results(v2_32):
    """launch_pcm queues steps without waiting for their PCM: two steps of the same streams launched
    back to back give step_pcm's bytes; a third launch waits until the oldest result is read (one
    pinned staging buffer per unread step)."""
    import threading

    from vocoder_svc.slot_pcm import STAGING_BUFFERS

    codes = codes_for(15, n_q=12, b=2, seed=22)
    ref = SlotDecoder(v2_32, slots=2, n_q=12)
    got = SlotDecoder(v2_32, slots=2, n_q=12)
    slots = [ref.acquire() for _ in range(2)]
    assert [got.acquire() for _ in range(2)] == slots
    chunks = [{s: codes[:, i, t:t + 5] for i, s in enumerate(slots)} for t in (0, 5, 10)]
    want = [ref.step_pcm(c, int16=[slots[1]]) for c in chunks]
    assert STAGING_BUFFERS == 2
    first, second = (got.launch_pcm(c, int16=[slots[1]]) for c in chunks[:2])
    third: list = []
    blocked = threading.Thread(target=lambda: third.append(got.launch_pcm(chunks[2], int16=[slots[1]])))
    blocked.start()
    blocked.join(timeout=0.5)
    assert blocked.is_alive()  # both staging buffers hold unread steps
    assert first.result() == want[0]
    blocked.join(timeout=30)
    assert not blocked.is_alive()
    assert second.result() == want[1] and third[0].result() == want[2]
    with pytest.raises(RuntimeError, match="twice"):
        first.result()


def test_priority_frames_steps_give_the_same_bytes(v2_32):
    """priority_frames: steps of those sizes take the high-priority path (on CUDA: their graphs' own
    stream and pool; here the emulated graphs) and give the same PCM as a slot decoder without it; a
    released slot's next stream starts fresh without a device write (valid=False reads frames as 0)."""
    codes = codes_for(40, n_q=12, b=2, seed=24)
    plain = SlotDecoder(v2_32, slots=2, n_q=12, graphs="emulate", graph_frames=[5, 25])
    fast = SlotDecoder(v2_32, slots=2, n_q=12, graphs="emulate", graph_frames=[5, 25], priority_frames=[5])
    assert fast.uses_priority_stream(5) and not fast.uses_priority_stream(25) and not plain.uses_priority_stream(5)
    for rnd in range(2):  # the second round reuses released slots
        want, got = [], []
        for s in (plain, fast):
            slots = [s.acquire() for _ in range(2)]
            out = want if s is plain else got
            for a, t in ((0, 5), (5, 25), (30, 10)):
                out.append(s.launch_pcm({sl: codes[:, i, a:a + t] for i, sl in enumerate(slots)},
                                        int16=[slots[0]]).result())
                if s is fast:
                    assert s.last_step_priority == (t == 5)
            for sl in slots:
                s.release(sl)
        assert got == want, f"round {rnd}"
