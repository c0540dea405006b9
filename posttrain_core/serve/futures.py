"""The service's futures: each accepted request runs as an asyncio task the SDK long-polls (`retrieve_future`).

A retry of a request (the same model and seq_id) finds the future its first copy started, so nothing runs twice.
A tenant with `max_queued` unfinished futures is answered 429 (the SDK backs off and retries). Outcomes stay in
memory for a while after they finish, and in the journal for good (see `state.Journal.past_future`).
"""

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import HTTPException, Response

from posttrain_core.serve.state import Journal
from posttrain_core.serve.wire import PROTOBUF, UserError

log = logging.getLogger("ray.serve")
KEEP_RESULTS_S = 900  # finished outcomes stay retrievable this long (the SDK polls once more after a lost reply)


class Futures:
    def __init__(self, journal: Journal, max_queued: int, long_poll_s: float):
        self.journal, self.max_queued, self.long_poll_s = journal, max_queued, long_poll_s
        self.tasks: dict[str, tuple[str, asyncio.Task]] = {}
        self.outcomes: dict[str, tuple[float, str, dict]] = {}  # id -> (finished, tenant, outcome)
        self.unfinished: dict[str, int] = {}
        self.rejected = 0  # requests answered 429

    def start(self, tenant: str, dedupe: str | None, kind: str, work: Callable[[], Awaitable[Any]], **extra):
        """Start `work` as a future (or find the one a retry of the same request started) and answer its id.

        `work` returns the result (bytes: a protobuf answer) or raises UserError (category user), LookupError
        (state lost in a restart: category server) or anything else (a bug: category server, logged).
        """
        known = self.journal.find_future(dedupe, tenant) if dedupe else None
        if known:
            return {"request_id": known, **extra}
        if self.unfinished.get(tenant, 0) >= self.max_queued:
            self.rejected += 1
            raise HTTPException(429, f"{self.max_queued} requests of this API key are unfinished")
        request_id = f"req-{uuid.uuid4().hex}"
        self.journal.add_future(request_id, tenant, dedupe, kind)
        self.unfinished[tenant] = self.unfinished.get(tenant, 0) + 1
        self.tasks[request_id] = (tenant, asyncio.create_task(self._complete(request_id, tenant, work)))
        now = time.monotonic()
        for rid in [r for r, (t, _, _) in self.outcomes.items() if now - t > KEEP_RESULTS_S]:
            self.outcomes.pop(rid, None)
        return {"request_id": request_id, **extra}

    async def _complete(self, request_id: str, tenant: str, work: Callable[[], Awaitable[Any]]) -> dict:
        try:
            outcome = {"result": await work()}
        except UserError as e:
            outcome = {"error": str(e), "category": "user"}
        except LookupError as e:
            outcome = {"error": str(e), "category": "server"}
        except Exception as e:
            log.exception("request %s failed", request_id)
            outcome = {"error": f"{type(e).__name__}: {e}", "category": "server"}
        self.unfinished[tenant] -= 1
        self.journal.finish_future(request_id, outcome)
        self.outcomes[request_id] = (time.monotonic(), tenant, outcome)
        self.tasks.pop(request_id, None)
        return outcome

    async def retrieve(self, request_id: str, tenant: str) -> Any:
        """The outcome in the SDK's shape, after waiting up to `long_poll_s` for it (then `try_again`).

        Raises:
            HTTPException: 404 for an id this tenant never got.
        """
        if request_id in self.tasks and self.tasks[request_id][0] == tenant:
            try:
                outcome = await asyncio.wait_for(asyncio.shield(self.tasks[request_id][1]), self.long_poll_s)
            except TimeoutError:
                return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        elif request_id in self.outcomes and self.outcomes[request_id][1] == tenant:
            outcome = self.outcomes[request_id][2]
        else:
            outcome = self.journal.past_future(request_id, tenant)
            if outcome is None:
                raise HTTPException(404, f"request_id: no request {request_id!r} for this API key")
        if "error" in outcome:
            return {"error": outcome["error"], "category": outcome["category"]}
        if isinstance(outcome["result"], bytes):
            return Response(content=outcome["result"], media_type=PROTOBUF)
        return outcome["result"]
