"""chorus/voice_store.py: one suite that both stores pass, SQLite (always) and PostgreSQL (a real
server this module starts from the Debian binaries, initdb + pg_ctl in a temporary directory, and
stops after; skipped where they or psycopg are missing). Then what a frontend's client gets when the
store refuses or fails, and the service on PostgreSQL."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile as sf

from chorus.client import channel, synthesize
from chorus.processes import free_port
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc
from chorus.voice_store import (StoreFull, StoredVoice, VoiceExists, VoiceStoreError, check_url, default_url,
                                open_store, shown_url)
from chorus.wire import rows_matrix
from helpers import make_cluster, seeded_request
from scheduler_svc.audio_relay import SynthesisFailed
from scheduler_svc.voices import VoiceLibrary

ROOT = Path(__file__).resolve().parent.parent


def _pg_skip_reason() -> str | None:
    missing = [b for b in ("initdb", "pg_ctl") if shutil.which(b) is None]
    if missing:
        return (f"PostgreSQL's {' and '.join(missing)} not found: install Debian's postgresql package to run the "
                "PostgreSQL half of the voice store suite")
    if importlib.util.find_spec("psycopg") is None:
        return 'psycopg is not installed: pip install -e ".[postgres]" to run the PostgreSQL half'
    return None


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL server on a unix socket in a temporary directory (trust auth): its URL."""
    reason = _pg_skip_reason()
    if reason:
        pytest.skip(reason)
    run_as = {}
    tmp = tempfile.mkdtemp(prefix="chorus-pg-")
    if os.geteuid() == 0:  # initdb refuses root: the server runs as the postgres (or nobody) user
        user = next((u for u in ("postgres", "nobody") if _user(u)), None)
        if user is None:
            shutil.rmtree(tmp)
            pytest.skip("running as root, and no postgres or nobody user to run PostgreSQL as")
        pw = _user(user)
        os.chown(tmp, pw.pw_uid, pw.pw_gid)
        run_as = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
    data, port = os.path.join(tmp, "data"), free_port()

    def pg(*argv):
        out = subprocess.run(argv, cwd=tmp, capture_output=True, text=True, timeout=120, **run_as)
        assert out.returncode == 0, f"{argv[0]} failed: {out.stdout}{out.stderr}"

    try:
        pg("initdb", "-D", data, "-U", "chorus", "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync")
        pg("pg_ctl", "-D", data, "-l", os.path.join(tmp, "log"), "-w", "-t", "60", "-o",
           f"-k {tmp} -p {port} -c listen_addresses='' -c fsync=off", "start")
        try:
            yield f"postgresql://chorus@/postgres?host={tmp}&port={port}"
        finally:
            pg("pg_ctl", "-D", data, "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _user(name: str):
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    """A fresh, empty store's URL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/voices.sqlite3"
    base = request.getfixturevalue("postgres")
    import psycopg
    with psycopg.connect(base, autocommit=True) as db:  # each test a database as new: drop what the last left
        db.execute("DROP TABLE IF EXISTS voices, chorus_schema")
    return base


def voice(voice_id: str = "v", owner: str = "", frames: int = 3, transcript: str = "Hello.", model: str = "m",
          seed: int = 0) -> StoredVoice:
    codes = np.random.default_rng(seed).integers(0, 1024, (frames, 12), dtype=np.int32)
    return StoredVoice(voice_id=voice_id, codes=rows_matrix(codes), transcript=transcript, frames=frames,
                       model=model, rms=0.25, owner=owner)


def timeless(v: StoredVoice) -> StoredVoice:
    """v as it was put: the store adds the row's created time."""
    assert v.created_at > 0
    out = StoredVoice()
    out.CopyFrom(v)
    out.ClearField("created_at")
    return out


def test_a_voice_is_stored_got_listed_and_deleted(url):
    with open_store(url) as store:
        v = voice("narrator", owner="alice", frames=5)
        before = int(time.time())
        created_at = store.put(v)
        assert before <= created_at <= time.time()  # the row's time, in unix seconds
        stored = StoredVoice()
        stored.CopyFrom(v)
        stored.created_at = created_at
        assert store.get("alice", "narrator") == stored
        [listed] = store.list("alice")
        assert (listed.voice_id, listed.frames, listed.transcript, listed.model, listed.owner, listed.created_at) == \
            ("narrator", 5, "Hello.", "m", "alice", created_at)
        assert listed.codes.rows == 0  # a listing carries no codes
        assert store.count("alice") == 1
        assert store.delete("alice", "narrator") == stored
        assert store.delete("alice", "narrator") is None
        assert store.get("alice", "narrator") is None and store.list("alice") == [] and store.count("alice") == 0


def test_each_owner_sees_only_its_own(url):
    with open_store(url) as store:
        store.put(voice("same", owner="alice", seed=1))
        store.put(voice("same", owner="bob", seed=2))  # one id, two owners: two voices
        time.sleep(0.01)  # created a clock tick later (SQLite keeps milliseconds; a tie lists by id)
        store.put(voice("hers", owner="alice"))
        assert [v.voice_id for v in store.list("alice")] == ["same", "hers"]
        assert [v.voice_id for v in store.list("bob")] == ["same"] and store.list("") == []
        assert store.get("bob", "hers") is None and store.delete("bob", "hers") is None
        assert timeless(store.get("alice", "same")) == voice("same", owner="alice", seed=1)
        assert timeless(store.get("bob", "same")) == voice("same", owner="bob", seed=2)
        assert (store.count("alice"), store.count("bob"), store.count("carol")) == (2, 1, 0)


def test_an_existing_id_is_refused_unless_replaced(url):
    with open_store(url) as store:
        store.put(voice("a", seed=1))
        store.put(voice("b"))
        with pytest.raises(VoiceExists, match="'a'"):
            store.put(voice("a", seed=2))
        assert timeless(store.get("", "a")) == voice("a", seed=1)
        time.sleep(0.01)
        store.put(voice("a", seed=3, transcript="Again."), replace=True)
        assert timeless(store.get("", "a")) == voice("a", seed=3, transcript="Again.")
        assert [(v.voice_id, v.transcript) for v in store.list("")] == [("b", "Hello."), ("a", "Again.")]


def test_the_limit_counts_the_owners_voices(url):
    with open_store(url) as store:
        for i in range(3):
            store.put(voice(f"v{i}", owner="alice"), limit=3)
        with pytest.raises(StoreFull):
            store.put(voice("v3", owner="alice"), limit=3)
        store.put(voice("v0", owner="alice", seed=9), replace=True, limit=3)  # replacing adds none
        store.put(voice("v0", owner="bob"), limit=3)  # another owner's room is its own
        store.delete("alice", "v1")
        store.put(voice("v3", owner="alice"), limit=3)
        assert sorted(v.voice_id for v in store.list("alice")) == ["v0", "v2", "v3"]


def test_unicode_large_and_nul(url):
    text = "说话人 — naïve 🎙️ " * 600  # ~11,000 characters, most of them multi-byte
    with open_store(url) as store:
        big = voice("🎙️声音-ü", owner="ОВНЕР", frames=750, transcript=text)  # 60 s of 12.5 Hz frames
        store.put(big)
        assert timeless(store.get("ОВНЕР", "🎙️声音-ü")) == big
        assert store.list("ОВНЕР")[0].transcript == text
        with pytest.raises(ValueError, match="transcript contains a NUL"):
            store.put(voice("nul", transcript="a\0b"))
        assert store.get("", "a\0b") is None and store.delete("", "a\0b") is None


def test_voices_persist_when_reopened(url):
    with open_store(url) as store:
        store.put(voice("kept", owner="alice", frames=7))
    with open_store(url) as store:
        assert timeless(store.get("alice", "kept")) == voice("kept", owner="alice", frames=7)
        assert store.count("alice") == 1


WRITER = """
import sys
from chorus.voice_store import StoreFull, StoredVoice, open_store
url, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open_store(url) as store:
    stored = 0
    for i in range(n):
        try:
            store.put(StoredVoice(voice_id=f"{name}{i}", owner="shared", frames=1, transcript=name), limit=50)
            stored += 1
        except StoreFull:
            pass
print(stored)
"""


def test_two_processes_write_one_store_and_the_limit_holds(url):
    """Two frontend processes at once, from a store not made yet: every write lands, and the per-owner
    limit is never crossed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, url, name, "40"], env=env, stdout=subprocess.PIPE,
                              text=True) for name in ("a", "b")]
    stored = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sum(stored) == 50
    with open_store(url) as store:
        assert store.count("shared") == 50 and len(store.list("shared")) == 50


def test_bad_urls_and_unreachable_stores_say_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match="sqlite:///PATH or postgresql://"):
        open_store("mysql://db/voices")
    with pytest.raises(ValueError, match="needs a file path"):
        check_url("sqlite:///")
    assert default_url().endswith("/chorus/voices.sqlite3")
    assert shown_url("postgresql://u:secret@db:5432/v") == "postgresql://u:***@db:5432/v"
    (tmp_path / "dir.sqlite3").mkdir()
    with pytest.raises(VoiceStoreError, match="cannot open"):
        open_store(f"sqlite:///{tmp_path}/dir.sqlite3")
    if importlib.util.find_spec("psycopg") is not None:
        with pytest.raises(VoiceStoreError, match=r"u:\*\*\*@") as e:
            open_store(f"postgresql://u:secret@/none?host={tmp_path}&port={free_port()}")
        assert "secret" not in str(e.value)


def test_a_newer_schema_is_refused(url):
    open_store(url).close()
    with open_store(url) as store:
        store._write("", lambda sql: sql.run("UPDATE chorus_schema SET version = 99 WHERE component = 'voices'"))
    with pytest.raises(VoiceStoreError, match="schema version 99"):
        open_store(url)


def test_the_frontends_library_answers_each_failure_with_its_status(tmp_path):
    """What a client gets: ALREADY_EXISTS, RESOURCE_EXHAUSTED naming the limit, and UNAVAILABLE (without
    the store's address) when the database fails."""
    library = VoiceLibrary(open_store(f"sqlite:///{tmp_path}/voices.sqlite3"), max_voices=1)

    async def run():
        await library.create(voice("a"))
        for v, code, words in ((voice("a"), grpc.StatusCode.ALREADY_EXISTS, "DeleteVoice"),
                               (voice("b"), grpc.StatusCode.RESOURCE_EXHAUSTED, "full (1 voices)")):
            with pytest.raises(SynthesisFailed) as e:
                await library.create(v)
            assert e.value.code == code and words in str(e.value)
        assert (await library.get_voice("a", "")).voice_id == "a" and await library.get_voice("b", "") is None
        library.close()
        with pytest.raises(SynthesisFailed) as e:
            await library.list("")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and str(tmp_path) not in str(e.value)
    asyncio.run(run())


def test_the_service_keeps_its_voices_in_postgresql(postgres):
    """The service on a PostgreSQL store (CI without PostgreSQL skips it): a voice made through the API
    is a row of the database, is used, and goes with DeleteVoice."""
    import psycopg
    with psycopg.connect(postgres, autocommit=True) as db:
        db.execute("DROP TABLE IF EXISTS voices, chorus_schema")
    buf = io.BytesIO()
    sf.write(buf, np.random.default_rng(0).standard_normal(24000).astype(np.float32) * 0.1, 24000, format="WAV")
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "4096"],
                      scheduler_args=["--voice-store", postgres]) as cluster:
        stub = tts_pb2_grpc.TextToSpeechStub(channel(cluster.address))
        made = stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id="pg", audio=common_pb2.AudioData(
            data=buf.getvalue()), transcript="In the database."))
        with open_store(postgres) as store:
            assert store.get("", "pg").frames == made.frames
        req = seeded_request(frames=3)
        req.references.add(voice_id="pg")
        assert synthesize(stub, req, timeout=120).summary.prompt_rows > made.frames
        stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="pg"))
        with open_store(postgres) as store:
            assert store.count("") == 0
