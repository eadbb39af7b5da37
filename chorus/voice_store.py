"""Where stored voices live: a database the public tier (the frontend processes) owns, so voices
outlive restarts and every frontend of a deployment sees the same ones. Engines hold none.

A store is named by a URL:
  * `sqlite:///PATH` (the default: a file in the user's state directory): embedded, nothing to run;
    WAL journaling lets the frontend processes of one machine share the file.
  * `postgresql://USER@HOST:PORT/DB` (psycopg 3, `pip install "chorus-tts[postgres]"`): for frontends
    and gateways on several machines sharing one library. libpq reads the password from PGPASSWORD
    or ~/.pgpass, which keeps it out of configs and command lines.

A row is one voice of one owner (the API key owner; "" without keys): the columns a listing reads
(model, transcript, frames, created time) beside the voice itself as its StoredVoice message. Every
call blocks; callers on an event loop run them in a thread. Calls of one store are serialized.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable
from urllib.parse import unquote, urlsplit, urlunsplit

from chorus.v1 import frontend_pb2

SCHEMA_VERSION = 1
BUSY_SECONDS = 10.0  # how long a write waits for another process's write to finish
SCHEMES = ("sqlite:///", "postgresql://", "postgres://")

StoredVoice = frontend_pb2.StoredVoice


class VoiceStoreError(RuntimeError):
    """The database cannot be reached or used (a retry may succeed)."""


class VoiceExists(VoiceStoreError):
    """put(replace=False) of an id its owner already has."""


class StoreFull(VoiceStoreError):
    """put of a new id by an owner that has `limit` voices."""


def default_url() -> str:
    """A SQLite file in the user's state directory ($XDG_STATE_HOME, else ~/.local/state)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return f"sqlite:///{os.path.join(state, 'chorus', 'voices.sqlite3')}"


def check_url(url: str) -> None:
    """ValueError naming what is wrong with a store URL."""
    if not url.startswith(SCHEMES):
        raise ValueError(f"{shown_url(url)!r} is not a voice store URL: give sqlite:///PATH or "
                         "postgresql://USER@HOST:PORT/DB")
    if url.startswith("sqlite:") and not urlsplit(url).path.strip("/"):
        raise ValueError("sqlite:/// needs a file path, e.g. sqlite:///var/lib/chorus/voices.sqlite3")


def shown_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def open_store(url: str = "") -> VoiceStore:
    """The store at url (empty: default_url()), its schema created on first use; VoiceStoreError when
    it cannot be opened, ValueError when the URL names no store."""
    url = url or default_url()
    check_url(url)
    if url.startswith("sqlite:"):
        return SqliteStore(os.path.expanduser(unquote(urlsplit(url).path)))
    return PostgresStore(url)


class VoiceStore(ABC):
    """Voices keyed by (owner, voice_id)."""

    url: str  # as shown: no password

    def put(self, voice: StoredVoice, *, replace: bool = False, limit: int = 0) -> int:
        """Store voice under (voice.owner, voice.voice_id); the row's created time in unix seconds.
        VoiceExists when the owner has that id and not replace; StoreFull when it is new and the owner
        has `limit` voices (0: no limit); ValueError when a text field holds a NUL character, which
        PostgreSQL's text cannot."""
        for name in ("owner", "voice_id", "model", "transcript"):
            if "\0" in getattr(voice, name):
                raise ValueError(f"{name} contains a NUL character")

        def put(sql: _Sql) -> None:
            exists = sql.one("SELECT 1 FROM voices WHERE owner = ? AND voice_id = ?", voice.owner, voice.voice_id)
            if exists and not replace:
                raise VoiceExists(f"voice_id {voice.voice_id!r} already exists")
            if not exists and limit and sql.one("SELECT count(*) FROM voices WHERE owner = ?",
                                                voice.owner)[0] >= limit:
                raise StoreFull(f"the owner has {limit} voices, the limit")
            sql.run("INSERT INTO voices (owner, voice_id, model, transcript, frames, voice) VALUES (?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (owner, voice_id) DO UPDATE SET model = excluded.model, transcript = "
                    "excluded.transcript, frames = excluded.frames, voice = excluded.voice, created_at = "
                    "excluded.created_at", voice.owner, voice.voice_id, voice.model, voice.transcript,
                    voice.frames, voice.SerializeToString())
            return sql.one("SELECT created_at FROM voices WHERE owner = ? AND voice_id = ?", voice.owner,
                           voice.voice_id)[0]
        return _unix_seconds(self._write(voice.owner, put))

    def get(self, owner: str, voice_id: str) -> StoredVoice | None:
        if "\0" in owner + voice_id:
            return None  # put never stores one
        return _voice(self._read(lambda sql: sql.one(
            "SELECT voice, created_at FROM voices WHERE owner = ? AND voice_id = ?", owner, voice_id)))

    def delete(self, owner: str, voice_id: str) -> StoredVoice | None:
        """Remove the voice; what was removed, or None when the owner has no such id."""
        if "\0" in owner + voice_id:
            return None

        def delete(sql: _Sql) -> StoredVoice | None:
            row = sql.one("SELECT voice, created_at FROM voices WHERE owner = ? AND voice_id = ?", owner, voice_id)
            if row:
                sql.run("DELETE FROM voices WHERE owner = ? AND voice_id = ?", owner, voice_id)
            return _voice(row)
        return self._write(owner, delete)

    def list(self, owner: str) -> list[StoredVoice]:
        """The owner's voices, oldest first, without their codes, with their created_at."""
        rows = self._read(lambda sql: sql.all(
            "SELECT voice_id, model, transcript, frames, created_at FROM voices WHERE owner = ? "
            "ORDER BY created_at, voice_id", owner))
        return [StoredVoice(voice_id=r[0], model=r[1], transcript=r[2], frames=r[3], owner=owner,
                            created_at=_unix_seconds(r[4])) for r in rows]

    def count(self, owner: str) -> int:
        return self._read(lambda sql: sql.one("SELECT count(*) FROM voices WHERE owner = ?", owner))[0]

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def _read(self, fn: Callable[[_Sql], object]): ...

    @abstractmethod
    def _write(self, owner: str, fn: Callable[[_Sql], object]):
        """fn in one transaction that no other write of this owner's runs beside."""

    def __enter__(self) -> VoiceStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _voice(row) -> StoredVoice | None:
    """A (voice, created_at) row as the voice with its created time; None for no row."""
    if not row:
        return None
    voice = StoredVoice.FromString(bytes(row[0]))
    voice.created_at = _unix_seconds(row[1])
    return voice


def _unix_seconds(created_at) -> int:
    """A created_at column's value in unix seconds: SQLite's ISO 8601 text in UTC, PostgreSQL's datetime."""
    if isinstance(created_at, str):
        created_at = datetime.fromisoformat(created_at.replace("Z", "+00:00"))
    if created_at.tzinfo is None:  # SQLite's CURRENT_TIMESTAMP is UTC without a zone: not local time
        created_at = created_at.replace(tzinfo=timezone.utc)
    return int(created_at.timestamp())


class _Sql:
    """Statements on one connection, written with `?` placeholders."""

    def __init__(self, cursor, placeholder: str = "?"):
        self.cursor = cursor
        self.placeholder = placeholder

    def run(self, statement: str, *params) -> None:
        self.cursor.execute(statement.replace("?", self.placeholder), params)

    def one(self, statement: str, *params):
        self.run(statement, *params)
        return self.cursor.fetchone()

    def all(self, statement: str, *params) -> list:
        self.run(statement, *params)
        return self.cursor.fetchall()


def _check_version(sql: _Sql, where: str) -> None:
    sql.run("CREATE TABLE IF NOT EXISTS chorus_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL)")
    row = sql.one("SELECT version FROM chorus_schema WHERE component = 'voices'")
    if row is None:
        sql.run("INSERT INTO chorus_schema (component, version) VALUES ('voices', ?)", SCHEMA_VERSION)
    elif row[0] != SCHEMA_VERSION:
        raise VoiceStoreError(f"the voice store at {where} has schema version {row[0]}; this release reads version "
                              f"{SCHEMA_VERSION}: run the matching Chorus release, or point voice_store elsewhere")


def _with_retry(step: Callable[[], object]) -> None:
    """Run a statement SQLite may refuse as locked without waiting (switching a new file to WAL while
    another process opens it), again until BUSY_SECONDS have passed."""
    deadline = time.monotonic() + BUSY_SECONDS
    while True:
        try:
            step()
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class SqliteStore(VoiceStore):
    def __init__(self, path: str):
        self.url = f"sqlite:///{path}"
        self._lock = threading.Lock()
        try:
            Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))  # voices are personal: the owner's alone
            # autocommit; each call opens its own transaction (BEGIN IMMEDIATE: writers queue up front)
            self._db = sqlite3.connect(path, timeout=BUSY_SECONDS, isolation_level=None, check_same_thread=False)
            self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_SECONDS * 1000)}")
            _with_retry(lambda: self._db.execute("PRAGMA journal_mode = WAL"))  # readers never wait for writers
            self._transaction(self._create)
        except (OSError, sqlite3.Error) as e:
            raise VoiceStoreError(f"cannot open the voice store {self.url}: {e}") from e

    def _create(self, sql: _Sql) -> None:
        _check_version(sql, self.url)
        sql.run("CREATE TABLE IF NOT EXISTS voices (owner TEXT NOT NULL, voice_id TEXT NOT NULL, model TEXT NOT NULL, "
                "transcript TEXT NOT NULL, frames INTEGER NOT NULL, "
                "created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')), voice BLOB NOT NULL, "
                "PRIMARY KEY (owner, voice_id))")

    def _transaction(self, fn: Callable[[_Sql], object]):
        with self._lock:
            cursor = self._db.cursor()
            cursor.execute("BEGIN IMMEDIATE")
            try:
                out = fn(_Sql(cursor))
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            cursor.execute("COMMIT")
            return out

    def _read(self, fn):
        try:
            with self._lock:
                return fn(_Sql(self._db.cursor()))
        except sqlite3.Error as e:
            raise VoiceStoreError(f"the voice store {self.url} failed: {e}") from e

    def _write(self, owner, fn):
        try:
            return self._transaction(fn)
        except sqlite3.Error as e:
            raise VoiceStoreError(f"the voice store {self.url} failed: {e}") from e

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _lock_id(name: str) -> int:
    """A signed 64-bit advisory lock id for a name."""
    return int.from_bytes(hashlib.blake2b(f"chorus-voices:{name}".encode(), digest_size=8).digest(), "little",
                          signed=True)


class PostgresStore(VoiceStore):
    def __init__(self, url: str):
        try:
            import psycopg
        except ImportError as e:
            raise VoiceStoreError('a postgresql:// voice store needs psycopg 3: pip install "chorus-tts[postgres]"') \
                from e
        self._psycopg = psycopg
        self._conninfo = url
        self.url = shown_url(url)
        self._lock = threading.Lock()
        self._db = None
        self._write("", self._create)

    def _create(self, sql: _Sql) -> None:
        sql.run("SELECT pg_advisory_xact_lock(?)", _lock_id("schema"))  # frontends starting together
        _check_version(sql, self.url)
        sql.run("CREATE TABLE IF NOT EXISTS voices (owner TEXT NOT NULL, voice_id TEXT NOT NULL, model TEXT NOT NULL, "
                "transcript TEXT NOT NULL, frames INTEGER NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now(), "
                "voice BYTEA NOT NULL, PRIMARY KEY (owner, voice_id))")

    def _run(self, fn: Callable[[_Sql], object], transaction: bool):
        """fn on the connection, reconnecting once when the connection broke (a database restart)."""
        psycopg = self._psycopg
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._db is None or self._db.closed:
                        self._db = psycopg.connect(self._conninfo, autocommit=True, connect_timeout=10)
                    if not transaction:
                        with self._db.cursor() as cursor:
                            return fn(_Sql(cursor, "%s"))
                    with self._db.transaction(), self._db.cursor() as cursor:
                        return fn(_Sql(cursor, "%s"))
                except psycopg.errors.UniqueViolation as e:  # a put racing another of the same id
                    raise VoiceExists(f"the voice already exists: {e}") from e
                except psycopg.OperationalError as e:
                    if attempt == 0 and self._db is not None and self._db.broken:
                        self._db = None
                        continue
                    raise VoiceStoreError(f"the voice store {self.url} failed: {e}") from e
                except psycopg.Error as e:
                    raise VoiceStoreError(f"the voice store {self.url} failed: {e}") from e

    def _read(self, fn):
        return self._run(fn, transaction=False)

    def _write(self, owner, fn):
        def locked(sql: _Sql):
            sql.run("SELECT pg_advisory_xact_lock(?)", _lock_id(f"owner:{owner}"))  # count and insert as one
            return fn(sql)
        return self._run(locked, transaction=True)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
