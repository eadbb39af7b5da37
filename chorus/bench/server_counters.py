"""What the services' Prometheus counters say about a level: the scheduler's steps (rate, round
trip, frames a step, the worker's own step times) and the vocoders' decode steps, as differences of
the counters read before and after the level."""

from __future__ import annotations

from chorus.processes import read_metrics

STEP_COUNTERS = {"chorus_step_seconds_count": "steps", "chorus_step_seconds_sum": "step_seconds",
                  "chorus_lookahead_steps_total": "lookahead_steps", "chorus_frames_generated_total": "frames",
                  "chorus_worker_decode_step_ms_count": "decode_steps", "chorus_worker_decode_step_ms_sum": "decode_ms",
                  "chorus_worker_prefill_step_ms_count": "prefill_steps",
                  "chorus_worker_prefill_step_ms_sum": "prefill_ms", "chorus_prefill_rows_total": "prefill_rows",
                  "chorus_scheduler_turnaround_ms_count": "turnarounds",
                  "chorus_scheduler_turnaround_ms_sum": "turnaround_ms",
                  # OmniVoice's canvas steps (labelled by model: summed over the models)
                  "chorus_canvas_steps_total": "canvas_steps",
                  "chorus_canvas_lookahead_steps_total": "canvas_lookahead_steps",
                  "chorus_canvas_step_ms_count": "canvas_timed_steps", "chorus_canvas_step_ms_sum": "canvas_step_ms",
                  "chorus_canvas_packed_rows_sum": "canvas_rows", "chorus_canvases_total": "canvases",
                  "chorus_canvas_turnaround_ms_count": "canvas_turnarounds",
                  "chorus_canvas_turnaround_ms_sum": "canvas_turnaround_ms"}


def scheduler_counters(port: int | None) -> dict[str, float] | None:
    """The scheduler's step counters from its Prometheus endpoint (None when there is none)."""
    if port is None:
        return None
    try:
        samples = read_metrics(port, timeout=2, labelled=True)
    except OSError:
        return None
    return {key: samples[name] for name, key in STEP_COUNTERS.items() if name in samples}


VOCODER_COUNTERS = {"chorus_vocoder_decode_step_ms_count": "steps", "chorus_vocoder_decode_step_ms_sum": "step_ms",
                     "chorus_vocoder_decode_batch_streams_sum": "streams",
                     "chorus_vocoder_audio_seconds_total": "audio_s",
                     "chorus_vocoder_decode_step_frames_sum": "frames",
                     "chorus_vocoder_queue_wait_ms_sum": "queue_wait_ms",
                     "chorus_vocoder_steps_launched_ahead_total": "launched_ahead",
                     # whole clips (OmniVoice's codec)
                     "chorus_vocoder_clips_total": "clips", "chorus_vocoder_clip_decode_ms_count": "clip_batches",
                     "chorus_vocoder_clip_decode_ms_sum": "clip_batch_ms",
                     "chorus_vocoder_clip_forwards_total": "clip_forwards",
                     "chorus_vocoder_clip_finish_ms_sum": "clip_finish_ms",
                     "chorus_vocoder_clip_finish_ms_count": "clip_finishes"}


def vocoder_counters(ports: list[int] | None) -> dict[str, float] | None:
    """The vocoders' step counters, summed over the replicas (None when there are none)."""
    if not ports:
        return None
    out = dict.fromkeys(VOCODER_COUNTERS.values(), 0.0)
    for port in ports:
        try:
            samples = read_metrics(port, timeout=2)
        except OSError:
            return None
        for name, key in VOCODER_COUNTERS.items():
            out[key] += samples.get(name, 0.0)
    return out


def vocoder_stats(before: dict[str, float] | None, after: dict[str, float] | None, wall: float) -> dict | None:
    """What the vocoders' decode steps did over a level, all replicas together: steps per second,
    streams per step and the mean step time from launch to PCM (a step launched while the previous
    one runs includes that wait)."""
    if not before or not after or wall <= 0:
        return None
    d = {k: after[k] - before[k] for k in VOCODER_COUNTERS.values()}
    steps = d["steps"]
    if not steps and not d["clips"]:
        return None
    return {"steps_per_s": steps / wall, "streams_per_step": d["streams"] / steps if steps else None,
            "step_ms": d["step_ms"] / steps if steps else None, "audio_s_per_s": d["audio_s"] / wall,
            # frames per stream in a step, and how long a step's oldest chunk waited for it
            "frames_per_step": d["frames"] / steps if steps else None,
            "queue_wait_ms": d["queue_wait_ms"] / steps if steps else None,
            # the share of steps launched while the one before still ran
            "launched_ahead_share": d["launched_ahead"] / steps if steps else None,
            # whole clips: how many a second, how many a batch, forwards a batch, a batch's wall time on
            # the decode thread, and a clip's post-processing (off that thread)
            "clips_per_s": d["clips"] / wall,
            "clips_per_batch": d["clips"] / d["clip_batches"] if d["clip_batches"] else None,
            "forwards_per_batch": d["clip_forwards"] / d["clip_batches"] if d["clip_batches"] else None,
            "clip_batch_ms": d["clip_batch_ms"] / d["clip_batches"] if d["clip_batches"] else None,
            "clip_finish_ms": d["clip_finish_ms"] / d["clip_finishes"] if d["clip_finishes"] else None}


def step_stats(before: dict[str, float] | None, after: dict[str, float] | None, wall: float) -> dict | None:
    """What the scheduler's steps did over a level: how many per second, the mean time the core
    waited for the oldest journal in flight ("round trip"; with lookahead less than a plan's whole
    round trip), the core's mean turnaround (a journal in to the next plan out), frames per step
    and the share sent by lookahead."""
    if not before or not after or wall <= 0:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in STEP_COUNTERS.values()}
    steps = d["steps"]
    per = lambda a, b: d[a] / d[b] if d[b] else None  # noqa: E731
    return {"steps_per_s": steps / wall, "round_trip_ms": 1e3 * d["step_seconds"] / steps if steps else None,
            "frames_per_step": d["frames"] / steps if steps else None,
            "lookahead_share": d["lookahead_steps"] / steps if steps else None,
            "core_turnaround_ms": per("turnaround_ms", "turnarounds"),
            # the worker's own time per step (launch to journal), decode-only steps and steps with prefill
            "worker_decode_step_ms": per("decode_ms", "decode_steps"),
            "worker_prefill_step_ms": per("prefill_ms", "prefill_steps"),
            "prefill_step_share": d["prefill_steps"] / steps if steps else None,
            "prefill_rows_per_prefill_step": per("prefill_rows", "prefill_steps")}


def canvas_stats(before: dict[str, float] | None, after: dict[str, float] | None, wall: float) -> dict | None:
    """What OmniVoice's canvas steps did over a level (None when none ran): steps per second, packed
    rows a step, the worker's time a step (launch to journal), the share sent before the previous
    journal returned, the core's mean turnaround (a journal in to the next plan out), and canvases
    ended per second."""
    if not before or not after or wall <= 0:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in STEP_COUNTERS.values() if k.startswith("canvas")}
    steps = d["canvas_steps"]
    if not steps:
        return None
    return {"steps_per_s": steps / wall, "packed_rows_per_step": d["canvas_rows"] / steps,
            "worker_step_ms": d["canvas_step_ms"] / d["canvas_timed_steps"] if d["canvas_timed_steps"] else None,
            "lookahead_share": d["canvas_lookahead_steps"] / steps, "canvases_per_s": d["canvases"] / wall,
            "core_turnaround_ms": (d["canvas_turnaround_ms"] / d["canvas_turnarounds"]
                                   if d["canvas_turnarounds"] else None)}
