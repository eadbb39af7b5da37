"""The scheduler's policy knobs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    max_queue: int = 256
    max_running: int = 64
    prefill_chunk: int = 512       # prompt rows per step, all requests together; 0 = unlimited
    page_size: int = 0             # KV rows per allocator page; 0 = the worker's (Hello.page_size)
    radix_cache: bool = True
    lookahead: bool = True
    lookahead_depth: int = 2       # steps in flight with lookahead on (the worker launches N+1 while N runs);
                                   # 3 measured no faster at c256 on the H200 and worse p99 TTFA
    lookahead_max_batch: int = 256  # larger decode batches wait for the journal (no graph to overlap)
    prefill_interval: int = 1      # while decoding, prefill only in every n-th step (graphed decode between)
    # While at least loaded_batch requests decode, prefill only every loaded_prefill_interval-th step: a
    # step that prefills costs a fixed ~2 ms on the H200 beyond ~16 us a row, even with its decodes folded
    # into the prefill pass (the worker's default since session 11), so at 180 decoding and 113 new rows a
    # step, prefilling every 4th step makes steps 13% shorter on average (11.8 -> 10.3 ms,
    # worker_mixed_fold_s11_h200.json), at up to 3 steps more TTFA; end to end at c256 (unfolded, when the
    # fixed cost was ~2.8 ms) it took 5-frame chunks from 1,370 to 1,472 s/s (every 3rd step).
    loaded_prefill_interval: int = 4
    loaded_batch: int = 64
    cache_key: str = ""            # model/codec identity: requests under other keys never share KV
    step_timeout: float = 300.0    # seconds without a journal before a step is given up
    # A step without its journal after this long asks the worker hello: a new process answering means
    # the old one died with the step (crash, OOM kill, stall watchdog) and was restarted, so the running
    # requests re-prefill on it now instead of after step_timeout. 0 = never ask early.
    worker_probe: float = 5.0
    restart_wait: float = 120.0    # after that, how long a restarted worker may take to answer hello
