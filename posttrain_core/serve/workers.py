"""The gateway's side of the model workers: submit a request to a base model's worker, and tell a restarted one.

A worker that dies (out of memory, a crash) takes its adapters with it. Its requests in flight fail here with a
`server` error that says so. Serve starts a new worker, which has another `incarnation`; each adapter's home (the
incarnation it was created or loaded in, and the model or sampler that owns it) is remembered here, so a later
request on an adapter the new worker does not have fails naming the model's last saved state instead of an unknown
adapter.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from posttrain_core.serve.state import Journal
from posttrain_core.serve.wire import UserError

log = logging.getLogger("ray.serve")  # Serve formats and forwards its replicas' log lines to the driver

STATUS_WAIT_S = 5.0  # how long the status view waits for a worker (one busy in a long pass answers between rounds)


class Workers:
    """The `ModelWorker` handles by base model name, and where each adapter lives (see the module docstring)."""

    def __init__(self, handles: dict[str, Any], journal: Journal):
        self.handles, self.journal = handles, journal
        self.homes: dict[str, tuple[str, str]] = {}  # adapter -> (incarnation, its model or sampler id)

    async def submit(self, tenant: str, base: str, kind: str, payload: dict, home: str | None = None) -> Any:
        """Run one worker request; its result, or raise UserError / RuntimeError (category server).

        `home`: the model or sampler id whose adapter (`payload["adapter"]`) this request creates or loads; the
        adapter is then known to live in the answering worker.
        """
        try:
            outcome = await self.handles[base].submit.remote(tenant, kind, payload)
        except Exception as e:  # the worker process died with the request queued or running
            log.error("worker of %s died during a %s request of tenant %s: %s", base, kind, tenant, e)
            raise RuntimeError(
                f"the model worker of {base!r} stopped while this request was queued or running (it ran out of "
                "memory or crashed; the service starts a new one): the request did not complete, and the unsaved "
                "steps of the models on that worker are lost; load your last saved state"
            ) from None
        if "error" in outcome:
            lost = self._lost(tenant, payload, outcome["incarnation"])
            if lost is not None:
                raise RuntimeError(lost)
            raise (UserError if outcome["category"] == "user" else RuntimeError)(outcome["error"])
        if home is not None:
            self.homes[payload["adapter"]] = (outcome["incarnation"], home)
        return outcome["result"]

    def _lost(self, tenant: str, payload: dict, incarnation: str) -> str | None:
        """The message for a request on an adapter that a restarted worker no longer has, or None."""
        for adapter in [payload.get("adapter"), payload.get("source")]:
            if adapter not in self.homes or self.homes[adapter][0] == incarnation:
                continue
            owner = self.homes[adapter][1]
            if ":sample:" in owner:
                return (
                    f"sampler {owner!r} was lost when its model worker restarted (out of memory or a crash); "
                    "create a new sampling client"
                )
            saved = self.journal.last_checkpoint(owner, tenant)
            then = (
                f"load its last saved state, {saved}, with create_training_client_from_state_with_optimizer"
                if saved
                else "it was never saved: create a new model"
            )
            return (
                f"model {owner!r} lost its unsaved state when its model worker restarted (out of memory or a "
                f"crash); {then}"
            )
        return None

    async def describe(self) -> dict[str, dict]:
        """Each worker's view (queue, adapters, memory, counters); a worker being restarted is reported as such and
        does not hold up the others'."""
        views = {}
        for name, handle in self.handles.items():
            try:
                views[name] = await asyncio.wait_for(handle.describe.remote(), STATUS_WAIT_S)
            except Exception as e:  # noqa: BLE001 - reported, not raised
                views[name] = {"unavailable": f"{type(e).__name__}: {e}"}
        return views
