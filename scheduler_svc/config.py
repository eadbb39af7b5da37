"""The scheduler's settings: its policy knobs and its process's flags, one field each (chorus.config
turns them into flags, a TOML [scheduler] table and the chorus.v1.SchedulerConfig message)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from chorus.config import ConfigError, setting
from chorus.voice_store import check_url
from scheduler_svc.validation import MAX_CHUNK_FRAMES


@dataclass
class SchedulerConfig:
    TABLE: ClassVar[str] = "scheduler"

    # ---- policy
    max_queue: int = setting(256, "waiting requests beyond this get RESOURCE_EXHAUSTED", minimum=0)
    max_running: int = setting(0, "requests decoding at once (0 = the worker's max batch)", minimum=0)
    prefill_chunk: int = setting(512, "prompt rows prefilled per step over all requests (0 = whole prompts)",
                                 minimum=0)
    page_size: int = setting(0, "KV rows per allocator page (0 = the worker's; else a multiple of it)", minimum=0)
    radix_cache: bool = setting(True, "reuse the KV of shared prefixes (voice references, retracted requests)")
    lookahead: bool = setting(True, "send the next step before the previous step's journal is back")
    lookahead_depth: int = setting(2, "steps in flight with lookahead", minimum=1)
    lookahead_max_batch: int = setting(256, "decode batches larger than this wait for their journal", minimum=0)
    prefill_interval: int = setting(1, "while requests decode, prefill only every n-th step", minimum=1)
    loaded_prefill_interval: int = setting(4, "while loaded_batch or more requests decode, prefill only every "
                                           "n-th step (1 = every step)", flag="--prefill-interval-loaded",
                                           metavar="N", minimum=1)
    loaded_batch: int = setting(64, "running requests from which the loaded_* settings apply (0 = never)",
                                metavar="B", minimum=0)
    cache_key: str = setting("", "model identity: requests under other keys never share KV", internal=True)
    step_timeout: float = setting(300.0, "seconds without a step's journal before the step is given up",
                                  flag="--step-timeout-s", metavar="S", minimum=0)
    worker_probe: float = setting(5.0, "seconds without a step's journal before asking whether the worker "
                                  "restarted (0 = off)", flag="--worker-probe-s", metavar="S", minimum=0)
    restart_wait: float = setting(30.0, "seconds a restarted worker may take to answer hello before its "
                                  "requests end UNAVAILABLE", flag="--restart-wait-s", metavar="S", minimum=0)
    worker_heartbeat: float = setting(1.0, "seconds between hello probes of an idle worker; no answer within "
                                      "worker_probe marks it gone (0 = off)", flag="--worker-heartbeat-s",
                                      metavar="S", minimum=0)
    max_stream_buffer_bytes: int = setting(4 << 20, "undelivered audio bytes one stream may hold before it is "
                                           "paused until its client reads", minimum=65536)
    max_frontend_buffer_bytes: int = setting(256 << 20, "undelivered audio bytes of all a frontend's streams "
                                             "beyond which every stream holding some is paused", minimum=65536)
    reader_stall: float = setting(30.0, "seconds a paused stream's client may read nothing before the stream "
                                  "is cancelled (0 = never)", flag="--reader-stall-s", metavar="S", minimum=0)
    # ---- process
    host: str = setting("127.0.0.1", "address to serve the public gRPC API on")
    port: int = setting(50051, "gRPC port (0 picks a free one)", minimum=0)
    metrics_port: int = setting(0, "Prometheus /metrics port (0 = off)", minimum=0)
    worker: str = setting("tcp://127.0.0.1:5560", "ZeroMQ endpoint of the gpu_worker", metavar="ENDPOINT")
    vocoder: list[str] = setting(["127.0.0.1:50053"], "a vocoder replica's address; repeat the flag for several",
                                 metavar="HOST:PORT")
    tokenizer: str | None = setting(None, "directory with the checkpoint's tokenizer files (usually the model's); "
                                    "unset: the bundled Qwen BPE", metavar="DIR")
    max_text_chars: int = setting(5000, "longest accepted text or transcript in characters", minimum=1)
    max_frames: int = setting(4096, "cap on a request's max_frames (80 ms frames)", minimum=1)
    max_request_bytes: int = setting(32 << 20, "largest accepted request message in bytes", minimum=1024)
    max_language_chars: int = setting(64, "longest accepted language in characters", minimum=1)
    max_instructions_chars: int = setting(1000, "longest accepted instructions in characters", minimum=1)
    max_request_id_chars: int = setting(128, "longest accepted request_id in characters", minimum=1)
    max_id_chars: int = setting(128, "longest accepted model name or voice_id in characters", minimum=1)
    max_references: int = setting(8, "voice references one request may give", minimum=1)
    max_reference_seconds: float = setting(60.0, "longest voice reference or stored voice in seconds",
                                           flag="--max-reference-s", metavar="S", minimum=1)
    max_voices: int = setting(128, "voices each API key owner may keep; CreateVoice of a new id beyond this is "
                              "refused", minimum=1)
    first_chunk_frames_loaded: int = setting(0, "while loaded_batch or more requests run, frames in a new "
                                             "stream's first chunk unless the client asks (0 = the vocoder's)",
                                             metavar="N", minimum=0, maximum=MAX_CHUNK_FRAMES)
    frontends: int = setting(1, "frontend processes serving the gRPC port (0 = an engine: frontend tier processes "
                             "reach it on frontend_link; the port serves grpc health only); a chorus up layout "
                             "whose worker is on a GPU runs 4 unless it sets this", minimum=0)
    drain_seconds: float = setting(25.0, "seconds the running and queued requests get to finish on SIGTERM (below "
                                   "terminationGracePeriodSeconds)", minimum=0)
    omnivoice_worker: list[str] = setting([], "ZeroMQ endpoint of an OmniVoice gpu_worker; repeat the flag for "
                                          "several (none: OmniVoice is not served)", metavar="ENDPOINT")
    omnivoice_vocoder: list[str] = setting([], "an OmniVoice codec (Higgs-Audio-v2) vocoder replica's address; repeat "
                                           "the flag for several", metavar="HOST:PORT")
    omnivoice_tokenizer: str | None = setting(None, "directory with the OmniVoice checkpoint's tokenizer files; unset: "
                                              "the bundled Qwen BPE", metavar="DIR")
    default_model: str = setting("", "model of requests that name none: a served model's name or architecture "
                                 "(empty: the MOSS model)", metavar="NAME")
    # ---- security
    tls_dir: str | None = setting(None, "directory with tls.crt, tls.key and ca.crt (a Kubernetes TLS secret) to "
                                  "serve the public API over TLS; unset: plaintext", metavar="DIR")
    require_client_cert: bool = setting(False, "with tls_dir: accept only clients whose certificate ca.crt signed")
    api_keys: str | None = setting(None, "file of API keys, one `OWNER KEY` a line, that calls must send as "
                                   "`authorization: Bearer KEY` (reread on change or SIGHUP); unset: no keys",
                                   metavar="FILE")
    vocoder_tls_dir: str | None = setting(None, "directory whose ca.crt verifies the vocoders and whose tls.crt and "
                                          "tls.key are this service's client certificate; unset: plaintext",
                                          metavar="DIR")
    curve_secret_key: str | None = setting(None, "this process's CURVE key pair file (.key_secret) for the "
                                           "worker links and the frontend link; unset: no CURVE", metavar="FILE")
    worker_public_key: str | None = setting(None, "the workers' CURVE public key file (.key); needed with "
                                            "curve_secret_key", metavar="FILE")
    # ---- text in pieces (long-form Synthesize, SynthesizeStream)
    max_longform_chars: int = setting(50000, "longest text a MOSS Synthesize accepts: text over max_text_chars is "
                                      "spoken in pieces, each continuing the last", minimum=1)
    sentence_chars: int = setting(300, "characters of text with no sentence end after which it is cut at a comma "
                                  "or space; a long-form piece groups sentences up to this", minimum=20)
    continuation_seconds: float = setting(10.0, "seconds of the previous sentences' audio a MOSS sentence or piece "
                                          "continues (whole sentences; 0 = each starts from the voice)",
                                          flag="--continuation-s", metavar="S", minimum=0)
    # ---- voices
    voice_store: str = setting("", "where the frontends keep voices: sqlite:///PATH or postgresql://USER@HOST/DB "
                               "(empty: chorus/voices.sqlite3 under $XDG_STATE_HOME or ~/.local/state)", metavar="URL")
    # ---- tiers
    frontend_link: str = setting("", "ZeroMQ endpoint the core binds for frontends, e.g. tcp://0.0.0.0:5570 "
                                 "(empty: an ipc socket for its own frontends alone)", metavar="ENDPOINT")
    frontend_curve_clients: str | None = setting(None, "directory of the CURVE public keys (.key) of the frontends "
                                                 "allowed on frontend_link; with curve_secret_key (unset: no CURVE)",
                                                 metavar="DIR")
    engines: list[str] = setting([], "frontend tier: an engine's frontend_link (tcp://HOST:PORT) or dns:///NAME:PORT "
                                 "for every address NAME resolves to; repeat the flag or separate by commas",
                                 metavar="ENDPOINT")
    engine_public_key: str | None = setting(None, "frontend tier: the engines' CURVE public key file (.key); with "
                                            "curve_secret_key, this frontend's pair", metavar="FILE")
    engine_refresh: float = setting(5.0, "frontend tier: seconds between DNS lookups of dns:/// engines",
                                    flag="--engine-refresh-s", metavar="S", minimum=0.1)
    engine_load_slack: float = setting(0.25, "frontend tier: an engine takes its voices while its load (requests "
                                       "in flight and queued) <= (1 + slack) * the mean + engine_load_margin",
                                       minimum=0)
    engine_load_margin: float = setting(2.0, "frontend tier: requests an engine may carry over (1 + slack) * the "
                                        "mean load and still take its voices", minimum=0)
    # ---- admission
    ttfa_objective_ms: float = setting(1000.0, "time to first audio a request is admitted within; a request "
                                       "expected later is queued, beyond max_expected_wait_s refused (0 = none)",
                                       metavar="MS", minimum=0)
    max_expected_wait_s: float = setting(5.0, "a request whose expected queue wait passes this many seconds gets "
                                         "RESOURCE_EXHAUSTED with a retry hint (0 = only max_queue refuses)",
                                         metavar="S", minimum=0)
    # ---- per caller: each frontend process counts its own calls (the deployment's limit is this times them)
    max_calls_per_owner: int = setting(0, "calls one API key owner may have open in each frontend process; more get "
                                       "RESOURCE_EXHAUSTED (0 = no cap)", metavar="N", minimum=0)
    calls_per_minute_per_owner: float = setting(0.0, "calls one API key owner may start a minute in each frontend "
                                                "process; faster get RESOURCE_EXHAUSTED (0 = no limit)",
                                                metavar="N", minimum=0)
    call_burst_per_owner: int = setting(10, "calls an owner may start at once before calls_per_minute_per_owner "
                                        "paces them", metavar="N", minimum=1)

    def link_message_bytes(self) -> int:
        """The largest message either end of the core-frontend link sends under these limits: a
        request of max_request_bytes, plus room for a step's rows."""
        return self.max_request_bytes + (16 << 20)

    def validate(self) -> None:
        serves_api = self.frontends or self.engines  # an engine (frontends = 0) talks to no vocoder
        if serves_api and not self.vocoder:
            raise ConfigError("scheduler.vocoder is empty: give at least one vocoder address")
        if serves_api and self.omnivoice_worker and not self.omnivoice_vocoder:
            raise ConfigError("scheduler.omnivoice_worker is set but scheduler.omnivoice_vocoder is empty: give the "
                              "address of at least one OmniVoice codec vocoder")
        if self.voice_store:
            try:
                check_url(self.voice_store)
            except ValueError as e:
                raise ConfigError(f"scheduler.voice_store: {e}") from None
        if self.engines:
            if self.curve_secret_key and not self.engine_public_key:
                raise ConfigError("scheduler.curve_secret_key on the frontend tier needs scheduler.engine_public_key "
                                  "(the engines' CURVE public key)")
            return
        if self.frontend_curve_clients and not self.curve_secret_key:
            raise ConfigError("scheduler.frontend_curve_clients needs scheduler.curve_secret_key (the core's CURVE "
                              "key pair)")
        if self.frontend_curve_clients and self.frontends:
            raise ConfigError("scheduler.frontend_curve_clients is for engines (frontends = 0): the core's own "
                              "frontends reach it on an ipc socket; set frontends = 0 or leave the keys out")
        if bool(self.curve_secret_key) != bool(self.worker_public_key):
            raise ConfigError("scheduler.curve_secret_key and scheduler.worker_public_key go together: give both "
                              "(CURVE on the worker links) or neither")
