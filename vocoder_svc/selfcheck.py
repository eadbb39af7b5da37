"""Startup self-checks of the decode engines on the serving device and dtype: batch invariance of
the stream engine's batched decode, and the byte-identity facts of a SlotDecoder."""

from __future__ import annotations

import numpy as np
import torch

from vocoder_svc.codec import MossAudioTokenizer
from vocoder_svc.codec_config import DEFAULT_CODEBOOKS
from vocoder_svc.slot_decoder import SlotDecoder


def check_batch_invariance(codec: MossAudioTokenizer, first_chunk: int, chunk: int, streams: int = 3,
                           seed: int = 0) -> str | None:
    """Decode a few streams alone and batched (batch-invariant mode, the chunk
    sizes this service uses, a 1-frame and a 3-frame tail) and compare bytes.
    None when every batched row equals its solo run; otherwise what differed."""
    n_q = min(DEFAULT_CODEBOOKS, codec.num_codebooks)
    pattern = [first_chunk, chunk, 1, 3]
    rng = np.random.default_rng(seed)
    codes = torch.from_numpy(rng.integers(0, codec.codebook_size, size=(n_q, streams, sum(pattern))))

    def run(rows: slice) -> list[torch.Tensor]:
        """The streams `rows` decoded together, step by step."""
        states = [codec.new_stream() for _ in range(rows.stop - rows.start)]
        outs, i = [], 0
        for n in pattern:
            outs.append(codec.decode_step(states, codes[:, rows, i:i + n], batch_invariant=True).cpu())
            i += n
        return outs

    solo = [run(slice(b, b + 1)) for b in range(streams)]
    for batch in sorted({2, streams}):
        for step, out in enumerate(run(slice(0, batch))):
            for b in range(batch):
                if not torch.equal(out[b:b + 1], solo[b][step]):
                    diff = (out[b:b + 1].float() - solo[b][step].float()).abs().max().item()
                    return (f"stream {b} of {batch}, step {step} ({pattern[step]} frames) differs from its solo "
                            f"decode by up to {diff:.3g}")
    return None


def check_slot_decoder(slot_decoder: SlotDecoder, frames: int, seed: int = 0) -> dict:
    """Byte-identity facts of this slot decoder on its device, from a few streams of `frames`-frame steps:
    neighbours_bitwise (a stream next to other streams in one bucket equals itself next to other
    codes), graph_vs_eager_bitwise (when the step ran from a graph) and cross_bucket_max_abs_diff
    (the stream alone, in bucket_for(1), vs in the batch's bucket). Needs min(3, slots) free slots."""
    n = min(3, slot_decoder.slots)
    rng = np.random.default_rng(seed)
    size = (slot_decoder.n_q, n, frames)
    x = torch.from_numpy(rng.integers(0, slot_decoder.config.quantizer.codebook_size, size=size))
    y = torch.from_numpy(rng.integers(0, slot_decoder.config.quantizer.codebook_size, size=size))
    slots = [slot_decoder.acquire() for _ in range(n)]

    def fresh(*which: int) -> None:
        for i in which or range(n):
            slot_decoder.reset(slots[i])

    try:
        res: dict = {"bucket": slot_decoder.bucket_for(n), "streams": n, "frames": frames}
        a = slot_decoder.step({s: x[:, i] for i, s in enumerate(slots)}, to_cpu=True)
        res["graphed"] = slot_decoder.last_step_graphed
        if n > 1:
            fresh()
            b = slot_decoder.step({s: (x if i == 0 else y)[:, i] for i, s in enumerate(slots)}, to_cpu=True)
            res["neighbours_bitwise"] = bool(torch.equal(a[slots[0]], b[slots[0]]))
        if res["graphed"]:
            fresh()
            e = slot_decoder.step({s: x[:, i] for i, s in enumerate(slots)}, to_cpu=True, eager=True)
            res["graph_vs_eager_bitwise"] = all(torch.equal(a[s], e[s]) for s in slots)
        fresh(0)
        alone = slot_decoder.step({slots[0]: x[:, 0]}, to_cpu=True)[slots[0]]
        res["alone_bucket"] = slot_decoder.bucket_for(1)
        res["cross_bucket_max_abs_diff"] = (alone.double() - a[slots[0]].double()).abs().max().item()
    finally:
        for s in slots:
            slot_decoder.release(s)
    return res


def describe_slot_check(r: dict) -> str:
    parts = []
    if "neighbours_bitwise" in r:
        parts.append(f"within bucket {r['bucket']} a stream's PCM is "
                     + ("bitwise independent of its neighbours" if r["neighbours_bitwise"]
                        else "NOT bitwise independent of its neighbours (unexpected)"))
    if "graph_vs_eager_bitwise" in r:
        parts.append("graph == eager bitwise" if r["graph_vs_eager_bitwise"] else "graph != eager (unexpected)")
    if r["streams"] > 1:
        d = r["cross_bucket_max_abs_diff"]
        parts.append(f"alone (bucket {r['alone_bucket']}) vs {r['streams']} together (bucket {r['bucket']}): " + (
            "bitwise equal" if d == 0 else f"max abs diff {d:.3g}, so bytes depend on the bucket (a failover "
                                           f"replay may differ; --buckets with one bucket avoids it)"))
    return f"vocoder: slot decoder self-check ({r['frames']}-frame steps): " + "; ".join(parts or ["ok"])

