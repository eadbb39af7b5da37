"""chorus bench's numbers: per-level statistics, the console table and the plot."""

from __future__ import annotations

import sys
from typing import Any

def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(values: list[float], qs=(50, 95, 99)) -> dict[str, float | None]:
    out = {f"p{q}": percentile(values, q) for q in qs}
    out["mean"] = sum(values) / len(values) if values else None
    out["max"] = max(values) if values else None
    return out


def level_metrics(records: list[dict], window: tuple[float, float]) -> dict[str, Any]:
    """Metrics of one level from its records (times in seconds since the run
    started; each record keeps its audio chunks as `_chunks` [(t, samples)])."""
    ws, we = window
    span = we - ws
    measured = [r for r in records if r["measured"]]
    ok = [r for r in measured if r["error"] is None]
    errs = [r for r in measured if r["error"] is not None]
    warm_errs = [r for r in records if not r["measured"] and r["error"] is not None]
    audio_s = frames = 0.0
    for r in records:
        sr, spf = r.get("sample_rate") or 0, r.get("samples_per_frame") or 0
        for t, n in r["_chunks"]:
            if ws <= t <= we:
                audio_s += n / sr if sr else 0.0
                frames += n / spf if spf else 0.0
    done = sum(1 for r in records if r["error"] is None and ws <= r["t_end_s"] <= we)
    gaps = [g for r in ok for g in r["gaps_ms"]]
    max_gaps = [r["max_gap_ms"] for r in ok if r["max_gap_ms"] is not None]
    cached = [r["cached_prompt_rows"] for r in ok]
    first_error = (errs or warm_errs or [{"error": None}])[0]["error"]
    return {
        "window_s": span,
        "requests": len(measured),
        "completed": len(ok),
        "errors": len(errs),
        "warmup_requests": len(records) - len(measured),
        "warmup_errors": len(warm_errs),
        "first_error": first_error,
        "req_per_s": done / span if span > 0 else None,
        "audio_s_per_s": audio_s / span if span > 0 else None,
        "frames_per_s": frames / span if span > 0 else None,
        "ttfa_ms": _stats([r["ttfa_ms"] for r in ok]),
        "total_ms": _stats([r["total_ms"] for r in ok]),
        "rtf": _stats([r["rtf"] for r in ok]),
        "chunk_gap_ms": _stats(gaps),
        "max_gap_ms": _stats(max_gaps),
        "server_queue_ms": _stats([r["server_queue_ms"] for r in ok]),
        "server_first_audio_ms": _stats([r["server_first_audio_ms"] for r in ok]),
        # a server may leave these summary fields out
        "server_first_frame_ms": _stats([r["server_first_frame_ms"] for r in ok
                                         if r.get("server_first_frame_ms") is not None]),
        "server_first_chunk_frames_ms": _stats([r["server_first_chunk_frames_ms"] for r in ok
                                                if r.get("server_first_chunk_frames_ms") is not None]),
        # the end of a request: its last frame, and the wait from there to the summary (the last audio)
        "server_last_frame_ms": _stats([r["server_last_frame_ms"] for r in ok if r.get("server_last_frame_ms")]),
        "server_tail_ms": _stats([r["server_total_ms"] - r["server_last_frame_ms"] for r in ok
                                  if r.get("server_last_frame_ms") and r.get("server_total_ms")]),
        "server_max_audio_lag_ms": _stats([r["server_max_audio_lag_ms"] for r in ok
                                           if r.get("server_max_audio_lag_ms") is not None]),
        "prompt_rows_mean": sum(r["prompt_rows"] for r in ok) / len(ok) if ok else None,
        "cached_prompt_rows": {"mean": sum(cached) / len(cached) if cached else None, "total": sum(cached)},
    }


_TABLE_COLS = (("workload", 8), ("level", 10), ("reqs", 5), ("err", 4), ("req/s", 7), ("audio-s/s", 9),
               ("frames/s", 9), ("TTFA p50", 9), ("p95", 8), ("p99", 8), ("RTF p50", 8), ("p99", 7),
               ("gap p99", 8), ("cached", 7))


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table_header() -> str:
    head = " ".join(name.rjust(w) for name, w in _TABLE_COLS)
    return head + "\n" + " ".join("-" * w for _, w in _TABLE_COLS) + "\n" + \
        "(latencies in ms; TTFA = send to first audio chunk; gap = between audio chunks; cached = mean " \
        "cached prompt rows)"


def table_row(lv: dict) -> str:
    label = f"c={lv['concurrency']}" if lv["mode"] == "closed" else f"rate={lv['rate']:g}"
    vals = (lv["workload"], label, str(lv["requests"]), str(lv["errors"]), _fmt(lv["req_per_s"], ".2f"),
            _fmt(lv["audio_s_per_s"], ".2f"), _fmt(lv["frames_per_s"], ".1f"), _fmt(lv["ttfa_ms"]["p50"], ".0f"),
            _fmt(lv["ttfa_ms"]["p95"], ".0f"), _fmt(lv["ttfa_ms"]["p99"], ".0f"), _fmt(lv["rtf"]["p50"], ".3f"),
            _fmt(lv["rtf"]["p99"], ".3f"), _fmt(lv["chunk_gap_ms"]["p99"], ".0f"),
            _fmt(lv["cached_prompt_rows"]["mean"], ".0f"))
    return " ".join(v.rjust(w) for v, (_, w) in zip(vals, _TABLE_COLS))


def readme_rows(levels: list[dict]) -> str:
    """The levels as rows of benchmarks/README.md's one-table-per-layout form."""
    out = ["| workload | concurrency | audio s/s | TTFA p50 / p99 (ms) | requests | errors |",
           "|---|---|---|---|---|---|"]
    for lv in levels:
        label = str(lv["concurrency"]) if lv["mode"] == "closed" else f"rate {lv['rate']:g}/s"
        out.append(f"| {lv['workload']} | {label} | {_fmt(lv['audio_s_per_s'], ',.1f')} | "
                   f"{_fmt(lv['ttfa_ms']['p50'], '.0f')} / {_fmt(lv['ttfa_ms']['p99'], '.0f')} | "
                   f"{lv['requests']} | {lv['errors']} |")
    return "\n".join(out)


def ttfa_breakdown(lv: dict) -> str | None:
    """Where TTFA goes, p50 of the server's own timestamps (ms from the request's arrival): queue
    (to its first prefill planned), first frame, the first chunk's frames all generated, first audio
    sent. None when the server reported none of them."""
    parts = [(name, lv.get(key, {}).get("p50")) for name, key in (
        ("queue", "server_queue_ms"), ("first frame", "server_first_frame_ms"),
        ("first chunk's frames", "server_first_chunk_frames_ms"), ("first audio", "server_first_audio_ms"))]
    if all(v is None for _, v in parts):
        return None
    line = "TTFA p50 on the server: " + ", ".join(f"{name} {_fmt(v, '.0f')}" for name, v in parts) + " ms"
    last, tail, lag = (lv.get(k, {}).get("p50") for k in ("server_last_frame_ms", "server_tail_ms",
                                                          "server_max_audio_lag_ms"))
    if last is not None:
        line += (f"\n           end p50: last frame {last:.0f}, then last audio {_fmt(tail, '.0f')} ms later; "
                 f"a chunk's longest wait for its audio {_fmt(lag, '.0f')} ms")
    return line


def server_lines(lv: dict) -> list[str]:
    """What the launched services did over a level, as console lines: cores each kept busy, the
    scheduler's steps, the worker's step times, the vocoders' decode steps (each only when known)."""
    lines = []
    if any(v is not None for v in lv["server_cpu"].values()):
        lines.append("server CPU (cores busy): " + ", ".join(
            f"{name} {v:.2f}" for name, v in lv["server_cpu"].items() if v is not None))
    st = lv["scheduler_steps"]
    if st and st["round_trip_ms"] is not None:
        turnaround = st.get("core_turnaround_ms")
        lines.append(f"scheduler steps: {st['steps_per_s']:.0f}/s, round trip {st['round_trip_ms']:.1f} ms, "
                     f"{st['frames_per_step']:.1f} frames/step, lookahead {100 * st['lookahead_share']:.0f}%"
                     + (f", core turnaround {turnaround:.1f} ms" if turnaround is not None else ""))
        if st.get("worker_prefill_step_ms") is not None and st.get("worker_decode_step_ms") is not None:
            lines.append(f"worker: decode steps {st['worker_decode_step_ms']:.1f} ms, steps with prefill "
                         f"{st['worker_prefill_step_ms']:.1f} ms ({100 * st['prefill_step_share']:.0f}% of steps, "
                         f"{st['prefill_rows_per_prefill_step']:.0f} rows each)")
    cs = lv.get("canvas_steps")  # results files of an older chorus have none
    if cs:
        worker = f", worker {cs['worker_step_ms']:.1f} ms a step" if cs["worker_step_ms"] is not None else ""
        turnaround = cs.get("core_turnaround_ms")  # results files of an older chorus have none
        core = f", core turnaround {turnaround:.2f} ms" if turnaround is not None else ""
        lines.append(f"canvas steps: {cs['steps_per_s']:.0f}/s, {cs['packed_rows_per_step']:.0f} packed rows a step"
                     f"{worker}{core}, lookahead {100 * cs['lookahead_share']:.0f}%, "
                     f"{cs['canvases_per_s']:.1f} canvases ended a second")
    vs = lv["vocoder_steps"]
    if vs and vs["step_ms"] is not None:
        lines.append(f"vocoder steps: {vs['steps_per_s']:.0f}/s, {vs['streams_per_step']:.1f} streams/step, "
                     f"{vs['step_ms']:.1f} ms launch to PCM, {vs['audio_s_per_s']:.0f} s of audio per s"
                     + (f"; {vs['frames_per_step']:.1f} frames a stream, oldest chunk waited "
                        f"{vs['queue_wait_ms']:.1f} ms" if vs.get("frames_per_step") else "")
                     + (f", {100 * vs['launched_ahead_share']:.0f}% launched ahead"
                        if vs.get("launched_ahead_share") is not None else ""))
    if vs and vs.get("clip_batch_ms") is not None:
        forwards = f" in {vs['forwards_per_batch']:.1f} forwards" if vs.get("forwards_per_batch") is not None else ""
        finish = (f"; post-processing {vs['clip_finish_ms']:.1f} ms a clip" if vs.get("clip_finish_ms") is not None
                  else "")
        lines.append(f"codec clips: {vs['clips_per_s']:.1f}/s, {vs['clips_per_batch']:.1f} a batch{forwards}, "
                     f"{vs['clip_batch_ms']:.1f} ms a batch{finish}")
    return lines


def plot(results: dict[str, Any], path: str) -> bool:
    """Throughput and TTFA p50/p99 against concurrency (or offered rate), one
    line per workload. Returns False (with a warning) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed, skipping the plot (pip install -e '.[bench]')",
              file=sys.stderr)
        return False
    levels = results["levels"]
    open_loop = any(lv["mode"] == "open" for lv in levels)
    xkey, xlabel = ("rate", "offered load (req/s)") if open_loop else ("concurrency", "concurrent streams")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for w in dict.fromkeys(lv["workload"] for lv in levels):
        pts = sorted((lv[xkey], lv) for lv in levels if lv["workload"] == w)
        xs = [x for x, _ in pts]
        ax1.plot(xs, [lv["audio_s_per_s"] for _, lv in pts], "o-", label=w)
        line, = ax2.plot(xs, [lv["ttfa_ms"]["p50"] for _, lv in pts], "o-", label=f"{w} p50")
        ax2.plot(xs, [lv["ttfa_ms"]["p99"] for _, lv in pts], "s--", color=line.get_color(), label=f"{w} p99")
    ticks = sorted({lv[xkey] for lv in levels})
    for ax in (ax1, ax2):
        ax.set_xlabel(xlabel)
        if not open_loop:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("audio seconds / second")
    ax1.set_title("throughput")
    ax1.set_ylim(bottom=0)
    ax2.set_ylabel("ms")
    ax2.set_title("time to first audio")
    ax2.set_ylim(bottom=0)
    git = results.get("git") or {}
    rev = git.get("revision")
    rev = f"rev {rev[:10]}{' (dirty)' if git.get('dirty') else ''}" if rev else None
    title = " | ".join(x for x in ("chorus bench", results.get("device_note"), rev) if x)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return True
