"""Launching the slot decoder's steps on CUDA streams and reading their PCM back (a mixin of
SlotDecoder, vocoder_svc/slot_decoder.py): the wire's PCM bytes converted on the device and copied
through pinned staging buffers on a stream of their own, so the next step can be launched before
this one's bytes are read; first chunks optionally on a high-priority stream (priority_frames)."""

from __future__ import annotations

import contextlib
from typing import Iterable, Mapping

import torch
from torch import Tensor

from vocoder_svc import slot_kernels as sk

# Steps launch_pcm may have launched whose PCM is not read yet (each holds a pinned buffer).
STAGING_BUFFERS = 2


class PcmLaunch:
    """step_pcm / launch_pcm and the CUDA streams a step runs on; SlotDecoder provides _decode."""

    def step_pcm(self, codes: Mapping[int, Tensor], int16: Iterable[int] = (), eager: bool = False,
                 bucket: int | None = None) -> dict[int, bytes]:
        """As `step`, but each stream's audio comes back as the wire's interleaved little-endian PCM
        bytes ([T*hop, C]): int16 for the slots in `int16` (chorus.audio.encode_pcm16's values: scale
        by 32767 in fp32, clip, round half to even), float32 for the others."""
        return self.launch_pcm(codes, int16, eager, bucket).result()

    def launch_pcm(self, codes: Mapping[int, Tensor], int16: Iterable[int] = (), eager: bool = False,
                   bucket: int | None = None) -> PendingPcm:
        """step_pcm without waiting for the device: the step, the PCM conversion and the copy to a
        pinned host buffer are queued, and `result()` of the returned handle waits and gives the
        bytes. The next step can be launched first, so the device never idles while the host turns
        one step's PCM into bytes (a 64-stream, 25-frame step's PCM16 is ~25 MB). At most
        STAGING_BUFFERS steps are unread: a further launch waits for the oldest result().

        The conversion runs on the device and the copy goes through a pinned host buffer: a
        64-stream step's float32 audio is ~50 MB, which a pageable copy moved at a few GB/s."""
        want16 = set(int16)
        with self._lock, torch.inference_mode():
            if not codes:
                return PendingPcm(self, [], [], None, None)
            slots, out, stream = self._decode(codes, eager, bucket, allow_priority=True)
            groups = [(torch.int16, [i for i, s in enumerate(slots) if s in want16]),
                      (torch.float32, [i for i, s in enumerate(slots) if s not in want16])]
            with self._on(stream):  # the conversion reads the pcm on the step's stream
                converted = []
                for dtype, idx in groups:
                    if not idx:
                        continue
                    x = out if len(idx) == len(slots) else out[torch.as_tensor(idx, device=out.device)]
                    if dtype == torch.int16:
                        # [n, T*hop, C], interleaved; "auto": the torch path for layouts the kernel skips
                        x = sk.pcm16(x, impl="auto" if self.glue_impl == "triton" else "torch")
                    else:
                        x = x.to(torch.float32).transpose(1, 2).contiguous()
                    converted.append((idx, x))  # contiguous: one plain memcpy to the host
            # The copy to the host runs on a stream of its own, so the next step's kernels (launched
            # ahead) overlap it instead of queueing behind it: a 64 x 25 step's PCM16 is ~25 MB.
            copy_stream = self._copy_stream_after(stream)
            buf = self._staging_acquire(sum(x.numel() * x.element_size() for _, x in converted))
            try:
                with self._on(copy_stream):
                    staged, offset = [], 0
                    for idx, x in converted:
                        nbytes = x.numel() * x.element_size()
                        host = self._staging[buf][offset:offset + nbytes].view(x.dtype).view(x.shape)
                        host.copy_(x, non_blocking=True)
                        if copy_stream is not None:
                            x.record_stream(copy_stream)  # not reused by the step stream before the copy ends
                        staged.append((idx, host))
                        offset += nbytes
                    done = None
                    if copy_stream is not None:
                        # A blocking-sync event: the finisher thread sleeps until the copy is done instead
                        # of spinning a core through the whole (tens of ms) step, as a default event's
                        # wait does. It follows the step too (the copy stream waited for it).
                        done = torch.cuda.Event(blocking=True)
                        done.record(copy_stream)
            except BaseException:
                self._staging_release(buf)  # a lost buffer would block every later launch
                raise
            self._after_step(slots, stream, done)
            return PendingPcm(self, slots, staged, done, buf)

    def _copy_stream_after(self, stream):
        """The stream that copies PCM to the host (None off CUDA), ordered after `stream`'s work."""
        if stream is None:
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copy_stream.wait_stream(stream)
        return self._copy_stream

    def _staging_acquire(self, nbytes: int) -> int:
        """(Under the lock.) A free pinned staging buffer of at least nbytes; waits while every one
        holds a step whose result() has not been read."""
        with self._staging_cond:
            while not self._staging_free:
                self._staging_cond.wait()
            buf = self._staging_free.pop()
            have = self._staging[buf]
            if have is None or have.numel() < nbytes:
                size = max(nbytes, 2 * (0 if have is None else have.numel()))
                self._staging[buf] = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            return buf

    def _staging_release(self, buf: int) -> None:
        with self._staging_cond:
            self._staging_free.append(buf)
            self._staging_cond.notify()

    def uses_priority_stream(self, t: int) -> bool:
        """Do steps of t frames run on the high-priority stream (see priority_frames)?"""
        return t in self.priority_frames and self.graph_mode is not None and not self.graphs_disabled

    def _stream(self, priority: bool):
        """The CUDA stream a step runs on (None off CUDA): the current one, or the high-priority one."""
        if self.device.type != "cuda":
            return None
        if not priority:
            return torch.cuda.current_stream(self.device)
        if self._priority_stream is None:
            # Lower is higher; out-of-range values map to the device's highest priority.
            self._priority_stream = torch.cuda.Stream(self.device, priority=-100)
        return self._priority_stream

    @staticmethod
    def _on(stream):
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def _wait_for_slots(self, slots: list[int], stream) -> None:
        """Order this step after the last step of each of its slots that ran on the other stream
        (a first chunk on the priority stream, then the stream's next step on the current one; or a
        slot's previous owner, cancelled while its last step still ran)."""
        if not self.priority_frames:
            return  # one stream: its steps run in order
        for s in slots:
            last = self._slot_events.get(s)
            if last is not None and last[0] != stream:
                stream.wait_event(last[1])

    def _after_step(self, slots: list[int], stream, event=None) -> None:
        """Remember each slot's last step (its stream, an event after it) for _wait_for_slots;
        only needed when steps run on two streams."""
        if stream is not None and self.priority_frames:
            if event is None:
                event = torch.cuda.Event()
                event.record(stream)
            for s in slots:
                self._slot_events[s] = (stream, event)


class PendingPcm:
    """A launched step_pcm (SlotDecoder.launch_pcm): result() waits for the device and returns
    {slot: PCM bytes}, once; the staging buffer goes back to the slot decoder then."""

    def __init__(self, slot_decoder: PcmLaunch, slots: list[int], staged: list[tuple[list[int], Tensor]],
                 done: torch.cuda.Event | None, buf: int | None):
        self._slot_decoder, self.slots, self._staged, self._done, self._buf = slot_decoder, slots, staged, done, buf
        self._read = False

    def wait_device(self) -> None:
        """Block until the step's device work (and its copy to the host buffer) is done."""
        if self._done is not None:
            self._done.synchronize()

    def running(self) -> bool:
        """Is the step's device work (or its copy to the host) still going? (False off CUDA.)"""
        return self._done is not None and not self._done.query()

    def result(self) -> dict[int, bytes]:
        if self._read:
            raise RuntimeError("PendingPcm.result() called twice")
        self._read = True
        try:
            if self._done is not None:
                self._done.synchronize()
            out: dict[int, bytes] = {}
            for idx, host in self._staged:
                for j, i in enumerate(idx):
                    out[self.slots[i]] = host[j].numpy().tobytes()
            return out
        finally:
            if self._buf is not None:
                self._slot_decoder._staging_release(self._buf)
                self._buf = None
