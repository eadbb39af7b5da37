"""Prometheus metrics of the vocoder service (one CollectorRegistry per service instance)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class StepReport:
    """What the slot decoder thread tells the metrics: slot gauges, and after a step what it did."""

    free_slots: int
    waiting_streams: int
    step_ms: float | None = None  # None: no step (a gauge update only)
    step_streams: int = 0
    graphed: bool = False
    step_frames: int = 0          # frames per stream in the step
    queue_wait_ms: float = 0.0    # from the step's oldest job's submit to the step's launch
    launched_ahead: bool = False  # launched while the step before it still ran on the device


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.active_streams = Gauge("chorus_vocoder_active_streams", "Decode streams currently open", registry=r)
        self.decode_step_ms = Histogram(
            "chorus_vocoder_decode_step_ms", "Wall time of one codec decode step (all streams in it), from "
            "launch to PCM on the host; the slots engine launches a step while the previous one runs, "
            "so under load this includes that wait",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000), registry=r)
        self.decode_batch_streams = Histogram(
            "chorus_vocoder_decode_batch_streams", "Streams decoded together in one step",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256), registry=r)
        # audio-s/s is the rate of this counter: rate(chorus_vocoder_audio_seconds_total[1m])
        self.audio_seconds = Counter("chorus_vocoder_audio_seconds", "Seconds of audio decoded", registry=r)
        self.encode_cache_hits = Counter("chorus_vocoder_encode_cache_hits", "Encode requests served from cache",
                                         registry=r)
        self.encode_cache_misses = Counter("chorus_vocoder_encode_cache_misses", "Encode requests computed",
                                           registry=r)
        # Whole clips (a replica serving OmniVoice's codec).
        self.clips = Counter("chorus_vocoder_clips", "DecodeClip clips decoded and post-processed", registry=r)
        self.clip_decode_ms = Histogram(
            "chorus_vocoder_clip_decode_ms", "Wall time of one DecodeClip batch on the decode thread: the codec's "
            "forwards for every clip taken together, up to their samples on the host",
            buckets=(5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000), registry=r)
        self.clip_finish_ms = Histogram(
            "chorus_vocoder_clip_finish_ms", "Post-processing of one decoded clip (silence trimming, levelling, "
            "fades, PCM encoding), off the decode thread", buckets=(0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500),
            registry=r)
        self.clip_forwards = Counter("chorus_vocoder_clip_forwards", "Codec forwards run for DecodeClip (equal-length "
                                     "clips share one where the replica measured that exact)", registry=r)
        # Slots engine only.
        self.free_slots = Gauge("chorus_vocoder_free_slots", "Free SlotDecoder slots",
                                        registry=r)
        self.waiting_streams = Gauge(
            "chorus_vocoder_waiting_streams", "Streams with a due step waiting for a free slot decoder slot",
            registry=r)
        self.slot_kernels = Gauge(
            "chorus_vocoder_slot_kernels", "Implementation the slot decoder runs, per part (1 = in use): "
            "attention and glue are 'triton' or 'torch' (a glue self-test failure shows as torch)",
            ["part", "impl"], registry=r)
        self.decode_step_frames = Histogram(
            "chorus_vocoder_decode_step_frames", "Frames per stream in one decoder step",
            buckets=(1, 5, 10, 15, 20, 25, 50), registry=r)
        self.queue_wait_ms = Histogram(
            "chorus_vocoder_queue_wait_ms", "How long a decoder step's oldest chunk waited from its arrival to "
            "the step's launch: above a step's time, the decoder is behind its streams",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)
        self.slot_steps = Counter("chorus_vocoder_slot_steps", "SlotDecoder steps by path (graph, eager)",
                                     ["path"], registry=r)
        self.launched_ahead = Counter(
            "chorus_vocoder_steps_launched_ahead", "Decoder steps launched while the step before them still ran on "
            "the device (--launch-ahead-streams): a share well under 1 under load means the device idles "
            "between steps unless another replica fills it", registry=r)


    def record_clips(self, decode_ms: float, clips: int, forwards: int) -> None:
        """One DecodeClip batch: its forwards' wall time, its clips and forwards (here or in a hosted codec)."""
        self.clip_decode_ms.observe(decode_ms)
        self.clips.inc(clips)
        self.clip_forwards.inc(forwards)

    def record_step(self, report: StepReport) -> None:
        """A SlotWorker's report (vocoder_svc/slot_worker.py): slot gauges, and a step's figures."""
        self.free_slots.set(report.free_slots)
        self.waiting_streams.set(report.waiting_streams)
        if report.step_ms is not None:
            self.decode_step_ms.observe(report.step_ms)
            self.decode_batch_streams.observe(report.step_streams)
            self.decode_step_frames.observe(report.step_frames)
            self.queue_wait_ms.observe(report.queue_wait_ms)
            self.slot_steps.labels("graph" if report.graphed else "eager").inc()
            if report.launched_ahead:
                self.launched_ahead.inc()
