"""A frontend's voice library: what CreateVoice, ListVoices, DeleteVoice and a Synthesize naming a
voice_id ask of the voice store (chorus/voice_store.py) that every frontend shares; engines hold
no voices.

Each store call blocks, so it runs in a thread, off the loop that relays every stream's audio. A
store that fails is UNAVAILABLE to the client (a retry may find it back); what failed goes to the
log, not to the client.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from chorus.voice_store import StoredVoice, StoreFull, VoiceExists, VoiceStore, VoiceStoreError
from scheduler_svc.audio_relay import SynthesisFailed
from scheduler_svc.validation import shown

log = logging.getLogger("chorus.scheduler")


class VoiceLibrary:
    def __init__(self, store: VoiceStore, max_voices: int):
        """max_voices: how many voices each owner may keep."""
        self.store = store
        self.max_voices = max_voices

    async def _call(self, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except (VoiceExists, StoreFull):
            raise
        except VoiceStoreError as e:
            log.error("%s", e)
            raise SynthesisFailed(grpc.StatusCode.UNAVAILABLE, "the voice store is unavailable; retry later") from e

    async def get_voice(self, voice_id: str, owner: str) -> StoredVoice | None:
        """The owner's voice_id (owner: the caller's API key owner, "" without keys), or None."""
        return await self._call(self.store.get, owner, voice_id)

    async def create(self, voice: StoredVoice) -> int:
        """Store a new voice under voice.owner: its created time in unix seconds. ALREADY_EXISTS or
        RESOURCE_EXHAUSTED when it cannot be."""
        try:
            return await self._call(lambda: self.store.put(voice, limit=self.max_voices))
        except VoiceExists:
            raise SynthesisFailed(grpc.StatusCode.ALREADY_EXISTS, f"voice_id {shown(voice.voice_id)} already exists; "
                                  "delete it with DeleteVoice first, or choose another voice_id") from None
        except StoreFull:
            raise SynthesisFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"voice_id {shown(voice.voice_id)}: the voice "
                                  f"store is full ({self.max_voices} voices); delete one with DeleteVoice first") \
                from None

    async def list(self, owner: str) -> list[StoredVoice]:
        return await self._call(self.store.list, owner)

    async def delete(self, voice_id: str, owner: str) -> StoredVoice | None:
        """The voice removed, or None when the owner has none of that id."""
        return await self._call(self.store.delete, owner, voice_id)

    def close(self) -> None:
        self.store.close()
