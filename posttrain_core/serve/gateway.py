"""The HTTP front of the service: the tinker SDK's endpoints (`/api/v1/...`), tenants, futures and the journal.

The gateway holds no model. Each request is checked (API key -> tenant, ids owned by that tenant), recorded in the
journal, and sent to its base model's worker; the SDK then long-polls `retrieve_future` for the outcome. Errors:
an unknown or foreign id answers 404 at once (the SDK does not retry it); content the worker refuses fails the
future with category `user`, naming the field; a bug, or state lost in a restart, fails it with category
`server`. A tenant with `max_queued` requests unfinished gets 429, which the SDK backs off from and retries.

A model worker that dies (out of memory, a crash) takes down nothing else: its requests fail with category `server`,
naming what to load (`workers.Workers`), and the other base models' workers and their tenants carry on.
"""

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from ray import serve

from posttrain_core.artifacts.ref import ArtifactRef
from posttrain_core.serve import checkpoints
from posttrain_core.serve.config import ServeConfig
from posttrain_core.serve.futures import Futures
from posttrain_core.serve.state import Journal
from posttrain_core.serve.wire import UserError, decode_forward_backward
from posttrain_core.serve.workers import Workers

log = logging.getLogger("ray.serve")  # Serve formats and forwards its replicas' log lines to the driver

app = FastAPI(title="posttrain serve", description="tinker-compatible training and sampling of LoRA adapters")
API = "/api/v1"
EPHEMERAL_SAMPLERS = 2  # sampler snapshots kept per model (rl loops take a new one every batch)


@serve.deployment
@serve.ingress(app)
class Gateway:
    """See the module docstring.

    Args:
        config: the service's settings, resolved by `app.start` (store, state_dir).
        keys: API key -> tenant (None: any tml- key is its own tenant).
        workers: each base model's `ModelWorker` handle, by its public name.
        bases: each base model's artifact, configs folder and facts (`app._bases`), by its public name; the gateway
            runs on the node that resolved them.
    """

    def __init__(
        self, config: ServeConfig, keys: dict[str, str] | None, workers: dict[str, Any], bases: dict[str, dict]
    ):
        from posttrain_core.artifacts import ArtifactStore

        self.config, self.keys, self.bases = config, keys, bases
        self.store = ArtifactStore(config.store)
        self.journal = Journal(Path(config.state_dir) / "journal.sqlite")
        self.futures = Futures(self.journal, config.max_queued, config.long_poll_s)
        self.workers = Workers(workers, self.journal)
        self.snapshots: dict[str, deque[str]] = {}
        self.seen: set[tuple[str, str, str]] = set()
        log.info("gateway up: epoch %d, bases %s, store %s", self.journal.epoch, list(self.bases), self.store.root)

    # ------------------------------------------------------------------------------------------- plumbing
    def _tenant(self, request: Request) -> str:
        import hashlib

        route = request.scope.get("route")
        path = getattr(route, "path", request.url.path)
        self.seen.add((request.method, path, request.headers.get("content-type", "").split(";")[0]))
        key = request.headers.get("x-api-key") or ""
        if self.keys is None:
            if not key.startswith("tml-"):
                raise HTTPException(401, "X-API-Key: expected a key starting with 'tml-'")
            return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        if key not in self.keys:
            raise HTTPException(401, "X-API-Key: unknown API key")
        return self.keys[key]

    @staticmethod
    async def _json(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise HTTPException(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise HTTPException(400, "the body is not a JSON object")
        return body

    def _model(self, model_id: Any, tenant: str) -> dict[str, Any]:
        try:
            return self.journal.model(str(model_id), tenant)
        except UserError as e:
            raise HTTPException(404, str(e)) from None

    def _session(self, session_id: Any, tenant: str) -> str:
        if not self.journal.session_open(str(session_id), tenant):
            raise HTTPException(404, f"session_id: no open session {session_id!r} for this API key")
        return str(session_id)

    def _base(self, name: Any) -> str:
        if name not in self.bases:
            raise HTTPException(404, f"base_model: {name!r} is not served here (served: {', '.join(self.bases)})")
        return name

    # ------------------------------------------------------------------------------------- client + session
    @app.post(API + "/client/config")
    async def client_config(self, request: Request):
        self._tenant(request)
        # Chunks of one forward_backward arrive one after another: execution order is arrival order.
        return {"parallel_fwdbwd_chunks": False}

    @app.post(API + "/client/dynamic_config")
    async def dynamic_config(self, request: Request):
        self._tenant(request)
        return {}

    @app.post(API + "/telemetry")
    async def telemetry(self, request: Request):
        self._tenant(request)
        return {"status": "accepted"}

    @app.get(API + "/healthz")
    async def healthz(self):
        return {"status": "ok"}

    @app.get(API + "/get_server_capabilities")
    async def capabilities(self, request: Request):
        self._tenant(request)
        models = [
            {"model_name": n, "max_context_length": b["max_position_embeddings"], "trainable": True, "sampleable": True}
            for n, b in self.bases.items()
        ]
        return {"supported_models": models}

    @app.post(API + "/create_session")
    async def create_session(self, request: Request):
        tenant = self._tenant(request)
        await self._json(request)
        session_id = f"s{uuid.uuid4().hex[:16]}"
        self.journal.add_session(session_id, tenant)
        log.info("tenant %s: session %s opened", tenant, session_id)
        return {"session_id": session_id, "type": "create_session"}

    @app.post(API + "/session_heartbeat")
    async def heartbeat(self, request: Request):
        tenant = self._tenant(request)
        body = await self._json(request)
        if not self.journal.session_open(str(body.get("session_id")), tenant):
            return JSONResponse({"detail": "session closed or unknown"}, status_code=410)
        return {"type": "session_heartbeat"}

    @app.post(API + "/sessions/{session_id}/finish")
    async def finish(self, session_id: str, request: Request):
        tenant = self._tenant(request)
        self._session(session_id, tenant)
        for base, adapter in self.journal.close_session(session_id, tenant):
            await self.workers.submit(tenant, base, "drop", {"adapters": [adapter]})
        log.info("tenant %s: session %s closed", tenant, session_id)
        return {"type": "session_finish"}

    # --------------------------------------------------------------------------------------------- training
    @app.post(API + "/create_model")
    async def create_model(self, request: Request):
        tenant = self._tenant(request)
        body = await self._json(request)
        session = self._session(body.get("session_id"), tenant)
        base = self._base(body.get("base_model"))
        model_id = f"{session}:train:{body.get('model_seq_id', 0)}"
        lora = body.get("lora_config") or {}
        adapter = f"t{uuid.uuid4().hex[:12]}"

        async def work():
            await self.workers.submit(tenant, base, "create", {"adapter": adapter, "lora_config": lora}, home=model_id)
            log.info("tenant %s: model %s on %s (rank %s)", tenant, model_id, base, lora.get("rank"))
            return {"model_id": model_id, "type": "create_model"}

        if not self.journal.find_future(f"create:{model_id}", tenant):
            rank = lora.get("rank") if isinstance(lora.get("rank"), int) else 0  # the worker refuses a bad one
            self.journal.add_model(model_id, tenant, session, base, adapter, rank)
        return self.futures.start(tenant, f"create:{model_id}", "create_model", work, model_id=model_id)

    @app.post(API + "/get_info")
    async def get_info(self, request: Request):
        tenant = self._tenant(request)
        body = await self._json(request)
        try:
            model = self._model(body.get("model_id"), tenant)
        except LookupError as e:
            raise HTTPException(404, str(e)) from None
        base = self.bases[model["base"]]
        return {
            "model_id": body["model_id"],
            "model_data": {"model_name": model["base"], "arch": base["model_type"], "tokenizer_id": base["path"]},
            "is_lora": True,
            "lora_rank": model["rank"],
            "model_name": model["base"],
            "type": "get_info",
        }

    def _live(self, model_id: Any, tenant: str) -> dict[str, Any] | LookupError:
        try:
            return self._model(model_id, tenant)
        except LookupError as e:
            return e

    def _on_model(self, tenant: str, body_model: Any, seq: Any, kind: str, run: Callable[[dict], Awaitable[Any]]):
        """A future for work on one of the tenant's live models (a model lost in a restart fails it: server)."""
        model = self._live(body_model, tenant)

        async def work():
            if isinstance(model, LookupError):
                raise model
            return await run(model)

        return self.futures.start(tenant, f"{kind}:{body_model}:{seq}", kind, work, model_id=str(body_model))

    @app.post(API + "/forward_backward")
    async def forward_backward(self, request: Request):
        tenant = self._tenant(request)
        raw = await request.body()
        try:
            fb = decode_forward_backward(raw)
        except UserError as e:
            error = e

            async def fail():
                raise error

            return self.futures.start(tenant, None, "forward_backward", fail)

        async def run(model):
            return await self.workers.submit(
                tenant, model["base"], "forward_backward", {"adapter": model["adapter"], "request": fb}
            )

        return self._on_model(tenant, fb.model_id, fb.seq_id, "forward_backward", run)

    @app.post(API + "/optim_step")
    async def optim_step(self, request: Request):
        tenant = self._tenant(request)
        body = await self._json(request)

        async def run(model):
            adam = body.get("adam_params") or {}
            metrics = await self.workers.submit(
                tenant, model["base"], "optim_step", {"adapter": model["adapter"], "adam": adam}
            )
            return {"metrics": metrics, "type": "optim_step"}

        return self._on_model(tenant, body.get("model_id"), body.get("seq_id"), "optim_step", run)

    # ------------------------------------------------------------------------------------------ checkpoints
    async def _save(self, tenant: str, model_id: str, model: dict, kind: str, body: dict) -> str:
        """Save a model's adapter as a store artifact (`kind` weights: with its optimizer state) -> tinker path."""
        path = checkpoints.tinker_path(model_id, kind, body.get("path"))
        key = checkpoints.artifact_key(path)
        if not body.get("overwrite") and self.store.get(key) is not None:
            raise UserError(f"path: checkpoint {path} exists; save under another name or pass overwrite=True")
        payload = {"adapter": model["adapter"], "key": key, "with_state": kind == "weights"}
        saved = await self.workers.submit(tenant, model["base"], "save", payload)
        base = self.bases[model["base"]]["ref"]
        fields = {
            "tenant": tenant,
            "session": model["session"],
            "model_id": model_id,
            "base_model": model["base"],
            "base_model_key": base.key,
            "step": saved["steps"],
            "lora_rank": saved["rank"],
        }
        ref = await asyncio.to_thread(
            checkpoints.publish, self.store, path, saved["src"], base, fields, bool(body.get("overwrite"))
        )
        self.journal.add_checkpoint(path, tenant, model_id, ref.key)
        log.info("tenant %s: saved %s (step %d) as artifact %s", tenant, path, saved["steps"], ref.key)
        return path

    def _checkpoint(self, path: Any, tenant: str) -> tuple[str, ArtifactRef, int]:
        """(base name, artifact, LoRA rank) of a checkpoint this tenant saved; 404 for any other path."""
        try:
            checkpoints.parse(path)
        except UserError as e:
            raise HTTPException(400, str(e)) from None
        if self.journal.checkpoint_owner(path) != tenant:
            raise HTTPException(404, f"path: no checkpoint {path} for this API key")
        ref = checkpoints.resolve(self.store, path)
        manifest = self.store.manifest(ref)
        base = manifest.get("base_model")
        if base not in self.bases:
            raise HTTPException(400, f"path: {path} was trained on {base!r}, which this server does not serve")
        return base, ref, int(manifest.get("lora_rank") or 0)

    @app.post(API + "/save_weights")
    async def save_weights(self, request: Request):
        tenant = self._tenant(request)
        body = await self._json(request)

        async def run(model):
            return {"path": await self._save(tenant, str(body["model_id"]), model, "weights", body)}

        return self._on_model(tenant, body.get("model_id"), body.get("seq_id"), "save_weights", run)

    @app.post(API + "/save_weights_for_sampler")
    async def save_weights_for_sampler(self, request: Request):
        tenant = self._tenant(request)
        body = await self._json(request)
        model_id = str(body.get("model_id"))

        async def run(model):
            if body.get("path"):
                return {"path": await self._save(tenant, model_id, model, "sampler_weights", body)}
            sampler_id = f"{model['session']}:sample:{body.get('sampling_session_seq_id')}"
            snapshot = f"p{uuid.uuid4().hex[:12]}"
            payload = {"source": model["adapter"], "adapter": snapshot}
            await self.workers.submit(tenant, model["base"], "snapshot", payload, home=sampler_id)
            self.journal.add_sampler(sampler_id, tenant, model["base"], snapshot, None)
            kept = self.snapshots.setdefault(model_id, deque())
            kept.append(snapshot)
            if len(kept) > EPHEMERAL_SAMPLERS:
                await self.workers.submit(tenant, model["base"], "drop", {"adapters": [kept.popleft()]})
            return {"sampling_session_id": sampler_id}

        return self._on_model(tenant, model_id, body.get("seq_id"), "save_weights_for_sampler", run)

    @app.post(API + "/load_weights")
    async def load_weights(self, request: Request):
        tenant = self._tenant(request)
        body = await self._json(request)
        path = body.get("path")
        base, ref, rank = self._checkpoint(path, tenant)
        with_state = bool(body.get("optimizer"))
        if body.get("session_id") is not None:  # a new training client from a checkpoint
            session = self._session(body["session_id"], tenant)
            model_id = f"{session}:train:{body.get('model_seq_id', 0)}"
            adapter, drop = f"t{uuid.uuid4().hex[:12]}", []
            dedupe = f"load:{model_id}"
            if not self.journal.find_future(dedupe, tenant):
                self.journal.add_model(model_id, tenant, session, base, adapter, rank)
        else:  # load into an existing training client
            model_id = str(body.get("model_id"))
            model = self._model(model_id, tenant)
            adapter, drop, dedupe = model["adapter"], [model["adapter"]], f"load:{model_id}:{body.get('seq_id')}"

        async def work():
            if drop:
                await self.workers.submit(tenant, base, "drop", {"adapters": drop})
            payload = {"adapter": adapter, "ref": ref, "with_state": with_state, "trainable": True}
            await self.workers.submit(tenant, base, "load", payload, home=model_id)
            log.info("tenant %s: model %s loaded from %s (optimizer: %s)", tenant, model_id, path, with_state)
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return self.futures.start(tenant, dedupe, "load_weights", work, model_id=model_id)

    # --------------------------------------------------------------------------------------------- sampling
    @app.post(API + "/create_sampling_session")
    async def create_sampling_session(self, request: Request):
        tenant = self._tenant(request)
        body = await self._json(request)
        session = self._session(body.get("session_id"), tenant)
        sampler_id = f"{session}:sample:{body.get('sampling_session_seq_id', 0)}"
        path = body.get("model_path")
        if path:
            base, ref, _ = self._checkpoint(path, tenant)
            adapter = f"p{uuid.uuid4().hex[:12]}"
            payload = {"adapter": adapter, "ref": ref, "with_state": False, "trainable": False}
            try:
                await self.workers.submit(tenant, base, "load", payload, home=sampler_id)
            except UserError as e:
                raise HTTPException(400, str(e)) from None
        else:
            base, adapter = self._base(body.get("base_model")), ""
        self.journal.add_sampler(sampler_id, tenant, base, adapter, path)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    @app.get(API + "/samplers/{sampler_id}")
    async def get_sampler(self, sampler_id: str, request: Request):
        tenant = self._tenant(request)
        sampler = self._sampler(sampler_id, tenant)
        return {"sampler_id": sampler_id, "base_model": sampler["base"], "model_path": sampler["model_path"]}

    def _sampler(self, sampler_id: Any, tenant: str) -> dict[str, Any]:
        try:
            return self.journal.sampler(str(sampler_id), tenant)
        except UserError as e:
            raise HTTPException(404, str(e)) from None

    @app.post(API + "/asample")
    async def asample(self, request: Request):
        from posttrain_core.serve.sampling import sample_job

        tenant = self._tenant(request)
        body = await self._json(request)
        sampler_id = body.get("sampling_session_id")
        sampler = self._sampler(sampler_id, tenant)
        n = body.get("num_samples", 1)
        ids = [f"{sampler_id}:{body.get('seq_id')}:{k}" for k in range(n if isinstance(n, int) else 0)]

        async def work():
            if not sampler["live"]:
                raise LookupError(f"sampler {sampler_id!r} was lost when the service restarted; create a new one")
            job = sample_job(body, sampler["adapter"])
            result = await self.workers.submit(tenant, sampler["base"], "sample", {"adapter": job.adapter, "job": job})
            return result

        dedupe = f"sample:{sampler_id}:{body.get('seq_id')}"
        return self.futures.start(tenant, dedupe, "sample", work, sample_sequence_ids=ids)

    # ------------------------------------------------------------------------------------------------ futures
    @app.post(API + "/retrieve_future")
    async def retrieve_future(self, request: Request):
        tenant = self._tenant(request)
        body = await self._json(request)
        return await self.futures.retrieve(str(body.get("request_id")), tenant)

    @app.get(API + "/posttrain/status")
    async def status(self, request: Request):
        """Operators' view: each worker's queue, resident adapters and throughput counters; the routes served."""
        self._tenant(request)
        workers = await self.workers.describe()
        routes = sorted(self.seen)
        return {
            "epoch": self.journal.epoch,
            "workers": workers,
            "unfinished": sum(self.futures.unfinished.values()),  # a total: tenants do not see each other
            "rejected": self.futures.rejected,
            "routes_seen": routes,
        }
