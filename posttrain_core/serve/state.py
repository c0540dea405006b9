"""What the service must remember across a restart, in one SQLite file: sessions, models, samplers, futures and
checkpoints, each with its tenant.

Live adapters are memory; this journal is what lets a restarted service tell the truth about them. A session
survives (heartbeats go on), a saved checkpoint still loads, a finished request whose result was JSON still
answers, and a request that was queued or running at the crash, or a model whose unsaved state died with the
process, fails with category `server` instead of running twice or answering from nothing. Every start is a new
`epoch`; rows of older epochs are what the crash left.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from posttrain_core.serve.wire import UserError

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY, tenant TEXT, created REAL, closed INTEGER DEFAULT 0);
CREATE TABLE IF NOT EXISTS models (
    id TEXT PRIMARY KEY, tenant TEXT, session TEXT, base TEXT, adapter TEXT, rank INTEGER, epoch INTEGER,
    dropped INTEGER DEFAULT 0);
CREATE TABLE IF NOT EXISTS samplers (
    id TEXT PRIMARY KEY, tenant TEXT, base TEXT, adapter TEXT, model_path TEXT, epoch INTEGER);
CREATE TABLE IF NOT EXISTS futures (
    id TEXT PRIMARY KEY, tenant TEXT, dedupe TEXT UNIQUE, kind TEXT, epoch INTEGER, status TEXT, result TEXT);
CREATE TABLE IF NOT EXISTS checkpoints (path TEXT PRIMARY KEY, tenant TEXT, model TEXT, key TEXT);
"""
LOST = (
    "the service restarted while this request was queued or running, so it did not complete and will not run again;"
    " continue from your last saved state"
)


class Journal:
    """The service's durable registry (see the module docstring). Thread-safe; each call is one transaction."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()
        row = self.db.execute("SELECT value FROM meta WHERE name='epoch'").fetchone()
        self.epoch = int(row[0]) + 1 if row else 1
        self.db.execute("INSERT OR REPLACE INTO meta VALUES ('epoch', ?)", (str(self.epoch),))

    def _one(self, sql: str, args: tuple = ()) -> tuple | None:
        with self.lock:
            return self.db.execute(sql, args).fetchone()

    def _run(self, sql: str, args: tuple = ()) -> None:
        with self.lock:
            self.db.execute(sql, args)

    # ------------------------------------------------------------------------------------------- sessions
    def add_session(self, session_id: str, tenant: str) -> None:
        self._run("INSERT INTO sessions (id, tenant, created) VALUES (?, ?, ?)", (session_id, tenant, time.time()))

    def session_open(self, session_id: str, tenant: str) -> bool:
        row = self._one("SELECT closed FROM sessions WHERE id=? AND tenant=?", (session_id, tenant))
        return row is not None and not row[0]

    def close_session(self, session_id: str, tenant: str) -> list[tuple[str, str]]:
        """Mark the session closed; return (base, adapter) of its live models and samplers to drop."""
        self._run("UPDATE sessions SET closed=1 WHERE id=? AND tenant=?", (session_id, tenant))
        with self.lock:
            models = self.db.execute(
                "SELECT base, adapter FROM models WHERE session=? AND tenant=? AND epoch=? AND dropped=0",
                (session_id, tenant, self.epoch),
            ).fetchall()
            samplers = self.db.execute(
                "SELECT base, adapter FROM samplers WHERE id LIKE ? AND tenant=? AND epoch=? AND adapter != ''",
                (f"{session_id}:%", tenant, self.epoch),
            ).fetchall()
            self.db.execute("UPDATE models SET dropped=1 WHERE session=? AND tenant=?", (session_id, tenant))
        return [tuple(r) for r in models + samplers]

    # --------------------------------------------------------------------------------------------- models
    def add_model(self, model_id: str, tenant: str, session: str, base: str, adapter: str, rank: int) -> None:
        self._run(
            "INSERT OR REPLACE INTO models (id, tenant, session, base, adapter, rank, epoch) VALUES (?,?,?,?,?,?,?)",
            (model_id, tenant, session, base, adapter, rank, self.epoch),
        )

    def model(self, model_id: str, tenant: str) -> dict[str, Any]:
        """A live model of this tenant: {base, adapter, rank, session}.

        Raises:
            UserError: unknown to this tenant (another tenant's id reads the same as a typo), or closed.
            LookupError: its unsaved state was lost in a restart (category `server`).
        """
        row = self._one(
            "SELECT base, adapter, rank, session, epoch, dropped FROM models WHERE id=? AND tenant=?",
            (model_id, tenant),
        )
        if row is None:
            raise UserError(f"model_id: no model {model_id!r} for this API key")
        if row[5]:
            raise UserError(f"model_id: model {model_id!r} belongs to a closed session")
        if row[4] != self.epoch:
            raise LookupError(
                f"model {model_id!r} lost its unsaved state when the service restarted; load its last checkpoint "
                "with create_training_client_from_state(...)"
            )
        return {"base": row[0], "adapter": row[1], "rank": row[2], "session": row[3]}

    # ------------------------------------------------------------------------------------------- samplers
    def add_sampler(self, sampler_id: str, tenant: str, base: str, adapter: str, model_path: str | None) -> None:
        self._run(
            "INSERT OR REPLACE INTO samplers VALUES (?,?,?,?,?,?)",
            (sampler_id, tenant, base, adapter, model_path or "", self.epoch),
        )

    def sampler(self, sampler_id: str, tenant: str) -> dict[str, Any]:
        """{base, adapter ('' = the base model), model_path, live} of this tenant's sampler.

        Raises:
            UserError: unknown to this tenant.
        """
        row = self._one(
            "SELECT base, adapter, model_path, epoch FROM samplers WHERE id=? AND tenant=?", (sampler_id, tenant)
        )
        if row is None:
            raise UserError(f"sampling_session_id: no sampler {sampler_id!r} for this API key")
        return {"base": row[0], "adapter": row[1], "model_path": row[2] or None, "live": row[3] == self.epoch}

    # -------------------------------------------------------------------------------------------- futures
    def find_future(self, dedupe: str, tenant: str) -> str | None:
        """The id of the future an earlier copy of this request started (a retry), if any."""
        row = self._one("SELECT id FROM futures WHERE dedupe=? AND tenant=?", (dedupe, tenant))
        return row[0] if row else None

    def add_future(self, request_id: str, tenant: str, dedupe: str | None, kind: str) -> None:
        self._run(
            "INSERT INTO futures VALUES (?,?,?,?,?,?,?)",
            (request_id, tenant, dedupe, kind, self.epoch, "pending", None),
        )

    def finish_future(self, request_id: str, outcome: dict[str, Any]) -> None:
        """Store the outcome: JSON results and errors in full; a protobuf result only as done (bytes stay in memory)."""
        body = None if isinstance(outcome.get("result"), bytes) else json.dumps(outcome)
        self._run("UPDATE futures SET status='done', result=? WHERE id=?", (body, request_id))

    def past_future(self, request_id: str, tenant: str) -> dict[str, Any] | None:
        """The outcome of a future from an earlier epoch, as the restarted service can give it; None if unknown."""
        row = self._one("SELECT status, result, epoch FROM futures WHERE id=? AND tenant=?", (request_id, tenant))
        if row is None:
            return None
        if row[0] == "done" and row[1] is not None:
            return json.loads(row[1])
        return {"error": LOST, "category": "server"}

    # ---------------------------------------------------------------------------------------- checkpoints
    def add_checkpoint(self, path: str, tenant: str, model_id: str, key: str) -> None:
        self._run("INSERT OR REPLACE INTO checkpoints VALUES (?,?,?,?)", (path, tenant, model_id, key))

    def last_checkpoint(self, model_id: str, tenant: str) -> str | None:
        """The tinker path of the model's newest checkpoint with its optimizer state (else its newest of any kind)."""
        with self.lock:
            rows = self.db.execute(
                "SELECT path FROM checkpoints WHERE model=? AND tenant=? ORDER BY rowid DESC", (model_id, tenant)
            ).fetchall()
        paths = [r[0] for r in rows]
        return next((p for p in paths if "/weights/" in p), paths[0] if paths else None)

    def checkpoint_owner(self, path: str) -> str | None:
        row = self._one("SELECT tenant FROM checkpoints WHERE path=?", (path,))
        return row[0] if row else None
