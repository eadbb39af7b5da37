"""Batch, KV and vocoder slots sized from the device's memory and the models, for settings left at 0.

The worker's max batch is the largest power of two up to MAX_BATCH whose requests' KV
(PLANNED_ROWS rows each, or max_context if shorter) fits, together with a decoder hosted in the
same process (as many slots as the batch: every running request streams through one). The KV
cache then takes what is left, up to max_batch x max_context rows: rows beyond the batch's hold
shared prefixes (the radix cache) and longer requests. A vocoder on its own sizes its slots the
same way from its share of the device.

What a process may take is the smaller of the memory free when it starts and `fraction` of the
device's total: the rest is headroom for allocator fragmentation and whatever else shares the
device (the launcher gives each of two processes on one device half of it). From that come its
weights and a fixed workspace (CUDA graph pools, prefill activations, the sampler's buffers).

Pure arithmetic over numbers the caller measured; `Sizing.reasons` says how each value came about
(the worker logs it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1 << 30
MAX_BATCH = 256        # the largest decode batch captured and measured (one H200, W1 c256)
PLANNED_ROWS = 1024    # KV rows planned per request at a full batch (a W1 request holds ~200)
WORKSPACE_BYTES = 4 * GiB
VOCODER_WORKSPACE_BYTES = 2 * GiB
# Shares of one device when the worker and vocoder processes share it (not colocated): a vocoder
# slot takes more than a request's KV, and both sides want MAX_BATCH of them.
WORKER_SHARE, VOCODER_SHARE = 0.35, 0.55
# Today's values on the CPU (the tiny presets, tests and the demo).
CPU_MAX_BATCH, CPU_KV_SLOTS, CPU_VOCODER_SLOTS = 64, 32768, 64


@dataclass(frozen=True)
class ModelFootprint:
    """The worker's model as sizing sees it."""
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    weight_bytes: int

    @property
    def kv_row_bytes(self) -> int:
        """K and V of one row (token) over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class CodecFootprint:
    """The vocoder's slot decoder as sizing sees it."""
    weight_bytes: int
    slot_bytes: int  # one slot: its state, its scratch row and its rows of a step's activations


@dataclass
class Sizing:
    max_batch: int
    kv_slots: int
    vocoder_slots: int  # 0: no vocoder sized here
    reasons: list[str] = field(default_factory=list)

    def explain(self) -> str:
        return "; ".join(self.reasons)


def allowance(free_bytes: int, total_bytes: int, fraction: float) -> int:
    """Bytes one process may take: what is free, at most `fraction` of the device."""
    return int(min(free_bytes, total_bytes * fraction))


def size_worker(free_bytes: int, total_bytes: int, fraction: float, model: ModelFootprint, max_context: int,
                codec: CodecFootprint | None = None, max_batch: int = 0, kv_slots: int = 0,
                vocoder_slots: int = 0) -> Sizing:
    """The worker's max_batch and kv_slots (and with `codec`, the hosted decoder's slots) for the
    values given as 0; a value given is kept and the others fit around it."""
    budget = allowance(free_bytes, total_bytes, fraction)
    reasons = [f"{budget / GiB:.1f} GiB allowed ({free_bytes / GiB:.1f} GiB free of {total_bytes / GiB:.1f}, "
               f"at most {fraction:g} of it)"]
    left = budget - model.weight_bytes - WORKSPACE_BYTES
    reasons.append(f"{left / GiB:.1f} GiB after {model.weight_bytes / GiB:.1f} GiB of weights and "
                   f"{WORKSPACE_BYTES / GiB:.0f} GiB of workspace")
    if codec is not None:
        left -= codec.weight_bytes + VOCODER_WORKSPACE_BYTES
        reasons.append(f"{left / GiB:.1f} GiB after the hosted decoder's {codec.weight_bytes / GiB:.1f} GiB of weights "
                       f"and {VOCODER_WORKSPACE_BYTES / GiB:.0f} GiB of workspace")
    row = model.kv_row_bytes
    planned = min(max_context, PLANNED_ROWS)

    def need(batch: int) -> int:
        slots = (vocoder_slots or batch) if codec is not None else 0
        return batch * planned * row + slots * (codec.slot_bytes if codec else 0)

    if not max_batch:
        max_batch = MAX_BATCH
        while max_batch > 1 and need(max_batch) > left:
            max_batch //= 2
        reasons.append(f"max_batch {max_batch}: the largest power of two up to {MAX_BATCH} whose KV "
                       f"({planned} rows a request, {row / 1024:.0f} KiB a row)"
                       + (" and decoder slots" if codec is not None else "") + " fit")
    if codec is not None and not vocoder_slots:
        vocoder_slots = max_batch
        reasons.append(f"vocoder slots {vocoder_slots}: one per running request "
                       f"({codec.slot_bytes / GiB:.2f} GiB a slot)")
    if codec is not None:
        left -= vocoder_slots * codec.slot_bytes
    if not kv_slots:
        cap = max_batch * max_context
        kv_slots = max(0, min(left // row, cap))
        reasons.append(f"kv_slots {kv_slots}: the rest, {left / GiB:.1f} GiB"
                       + (f", up to max_batch x max_context ({cap})" if kv_slots == cap else ""))
    return Sizing(max_batch, int(kv_slots), vocoder_slots, reasons)


def size_vocoder(free_bytes: int, total_bytes: int, fraction: float, codec: CodecFootprint,
                 largest_bucket: int = 0) -> Sizing:
    """A vocoder's slots on a device of its own (or its share of one): the largest power of two up to
    MAX_BATCH that fits, at most `largest_bucket` when its buckets are given."""
    budget = allowance(free_bytes, total_bytes, fraction)
    left = budget - codec.weight_bytes - VOCODER_WORKSPACE_BYTES
    cap = min(MAX_BATCH, largest_bucket) if largest_bucket else MAX_BATCH
    slots = cap
    while slots > 1 and slots * codec.slot_bytes > left:
        slots //= 2
    reasons = [f"{budget / GiB:.1f} GiB allowed ({free_bytes / GiB:.1f} GiB free of {total_bytes / GiB:.1f}, at most "
               f"{fraction:g} of it)",
               f"slots {slots}: the largest power of two up to {cap} whose state fits "
               f"({codec.slot_bytes / GiB:.2f} GiB a slot, {left / GiB:.1f} GiB after weights and workspace)"]
    return Sizing(0, 0, slots, reasons)
