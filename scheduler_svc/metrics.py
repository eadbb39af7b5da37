"""Prometheus metrics of the scheduler (served on --metrics-port)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()

QUEUE_DEPTH = Gauge("chorus_queue_depth", "Requests waiting for admission", registry=REGISTRY)
RUNNING = Gauge("chorus_running_requests", "Requests admitted (prefilling or decoding)", registry=REGISTRY)
KV_USED = Gauge("chorus_kv_slots_used", "KV slots held by running requests (not the cache)", registry=REGISTRY)
KV_TOTAL = Gauge("chorus_kv_slots_total", "KV slot capacity of the worker", registry=REGISTRY)
FRAMES = Counter("chorus_frames_generated", "Audio frames generated", registry=REGISTRY)
REQUESTS = Counter("chorus_requests", "Synthesize calls by outcome", ["outcome"], registry=REGISTRY)
ABORTED = Counter("chorus_requests_aborted", "Requests dropped because the client went away", registry=REGISTRY)
STEP_SECONDS = Histogram("chorus_step_seconds", "Worker step round-trip time", registry=REGISTRY,
                         buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5))
TTFA_SECONDS = Histogram("chorus_time_to_first_audio_seconds", "Accepted to first audio chunk sent",
                         registry=REGISTRY, buckets=(.02, .05, .1, .2, .3, .5, 1, 2, 5, 10))
ACTIVE_STREAMS = Gauge("chorus_active_streams", "Synthesize calls in progress", registry=REGISTRY)
KV_CACHED = Gauge("chorus_kv_slots_cached", "KV slots held by the radix cache", registry=REGISTRY)
KV_FREE = Gauge("chorus_kv_slots_free", "KV slots free", registry=REGISTRY)
# The admission estimate (scheduler_svc/admission.py) for a request arriving now: the autoscaler's
# signal. 0 until a request has finished (no lifetime measured yet) while every place is taken.
EXPECTED_WAIT = Gauge("chorus_expected_wait_seconds", "Expected queue wait of a request arriving now (s)",
                      registry=REGISTRY)
ADMISSIONS = Counter("chorus_admissions", "New requests by admission decision: admit (expected time to first "
                     "frame within the objective), queue (beyond it), refuse (expected wait past the bound, or "
                     "the queue full)", ["decision"], registry=REGISTRY)
RADIX_HIT_ROWS = Counter("chorus_radix_hit_rows", "Prompt rows served from the radix cache", registry=REGISTRY)
RADIX_HIT_RATE = Gauge("chorus_radix_hit_rate", "Radix cache hit rate (rows hit / rows queried)",
                       registry=REGISTRY)
RETRACTIONS = Counter("chorus_retractions", "Requests retracted to re-prefill later (KV pressure, worker restart)",
                      registry=REGISTRY)
WORKER_RESTARTS = Counter("chorus_worker_restarts", "Journals from a new worker process: its KV was lost and the "
                          "running requests re-prefilled", registry=REGISTRY)
# The worker's own time per step (Journal.step_ms: launch to journal ready), apart for steps that
# carry prefill rows (run eagerly beside the decode graph) and decode-only steps.
_STEP_MS_BUCKETS = (2, 4, 6, 8, 10, 12, 15, 20, 30, 50, 80, 120, 200, 500)
WORKER_DECODE_STEP_MS = Histogram("chorus_worker_decode_step_ms", "Worker time of decode-only steps (ms)",
                                  registry=REGISTRY, buckets=_STEP_MS_BUCKETS)
WORKER_MIXED_STEP_MS = Histogram("chorus_worker_prefill_step_ms", "Worker time of steps with prefill rows (ms)",
                                 registry=REGISTRY, buckets=_STEP_MS_BUCKETS)
PREFILL_ROWS = Counter("chorus_prefill_rows", "Prompt rows sent to the worker for prefill", registry=REGISTRY)
# The core's own time per step: a journal in, to the next plan out (applying the journal, the frames'
# events to the frontends, building the plan). With lookahead the worker runs the steps already sent
# meanwhile; when this approaches the worker's step time, the GPU waits for plans.
TURNAROUND_MS = Histogram("chorus_scheduler_turnaround_ms", "Journal received to the next plan sent (ms)",
                          registry=REGISTRY, buckets=(0.5, 1, 2, 3, 5, 8, 12, 20, 50, 100))
LOOKAHEAD_STEPS = Counter("chorus_lookahead_steps", "Steps sent before the previous journal returned",
                          registry=REGISTRY)
# Calls a frontend refused for their caller's limits (chorus/caller_limits.py), by the config key; no
# owner label (owners are unbounded): the frontend's log line names the owner.
CALLER_REFUSALS = Counter("chorus_caller_refusals", "Calls refused by their API key owner's limit, before any work: "
                          "max_calls_per_owner or calls_per_minute_per_owner", ["limit"], registry=REGISTRY)
# OmniVoice: one series per OmniVoice worker, labelled by its model name.
CANVAS_QUEUE_DEPTH = Gauge("chorus_canvas_queue_depth", "OmniVoice canvases waiting for admission", ["model"],
                           registry=REGISTRY)
CANVAS_RUNNING = Gauge("chorus_canvas_running", "OmniVoice canvases being unmasked", ["model"], registry=REGISTRY)
CANVAS_ROWS_USED = Gauge("chorus_canvas_rows_used", "Packed rows the running OmniVoice canvases take per step",
                         ["model"], registry=REGISTRY)
CANVAS_PACKED_ROWS = Histogram("chorus_canvas_packed_rows", "Packed rows of each OmniVoice step", ["model"],
                               registry=REGISTRY, buckets=(64, 256, 1024, 2048, 4096, 8192, 12288, 16384, 24576,
                                                           32768))
CANVAS_STEPS = Counter("chorus_canvas_steps", "OmniVoice unmasking steps run (each over all running canvases)",
                       ["model"], registry=REGISTRY)
CANVAS_LOOKAHEAD_STEPS = Counter("chorus_canvas_lookahead_steps", "OmniVoice steps sent before the previous "
                                "journal returned", ["model"], registry=REGISTRY)
CANVAS_STEP_MS = Histogram("chorus_canvas_step_ms", "Worker time of OmniVoice steps (ms)", ["model"],
                           registry=REGISTRY, buckets=(5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000))
# As TURNAROUND_MS, for the canvas scheduler: with lookahead the worker launches the plans already
# sent meanwhile, and when this plus the two hops over ZeroMQ approaches a step, the GPU waits.
CANVAS_TURNAROUND_MS = Histogram("chorus_canvas_turnaround_ms", "OmniVoice journal received to the next plan "
                                 "sent (ms)", ["model"], registry=REGISTRY,
                                 buckets=(0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100))
CANVASES = Counter("chorus_canvases", "OmniVoice canvases ended, by outcome (ok, error, cancelled)",
                   ["model", "outcome"], registry=REGISTRY)

# A frontend tier process's own (`chorus frontend --metrics-port`): what it sees of the calls it serves
# and where it sends them. The engines count the same calls under the names above; names of their own
# keep a sum over all pods from counting each call twice.
FRONTEND_REGISTRY = CollectorRegistry()
FRONTEND_REQUESTS = Counter("chorus_frontend_requests", "Calls this frontend ended, by outcome (ok, invalid, failed, "
                            "cancelled)", ["outcome"], registry=FRONTEND_REGISTRY)
FRONTEND_ACTIVE_STREAMS = Gauge("chorus_frontend_active_streams", "Calls this frontend serves now",
                                registry=FRONTEND_REGISTRY)
FRONTEND_TTFA_SECONDS = Histogram("chorus_frontend_time_to_first_audio_seconds", "Accepted to first audio chunk sent",
                                  registry=FRONTEND_REGISTRY, buckets=(.02, .05, .1, .2, .3, .5, 1, 2, 5, 10))
FRONTEND_ENGINE_PICKS = Counter("chorus_frontend_engine_picks", "Requests placed on each engine (its frontend-link "
                                "endpoint)", ["engine"], registry=FRONTEND_REGISTRY)
FRONTEND_ENGINES = Gauge("chorus_frontend_engines", "Engines that take requests from this frontend",
                         registry=FRONTEND_REGISTRY)
