"""`posttrain serve` as a child process (its own process group): what the tests and the benchmark start, stop and
crash; a script can use it the same way."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from posttrain_core.cluster import free_port
from posttrain_core.env import own_ray_environment
from posttrain_core.serve.app import READY

REPO = Path(__file__).resolve().parents[2]


class ServiceProcess:
    """`posttrain --store STORE serve --base-model NAME=PATH --keys KEYS ...` on 127.0.0.1:port.

    Args:
        keys: API key -> tenant, written to a keys file beside `state_dir`.
        base_path: a model folder, or anything `--base-model` takes (a .gguf, `latest:STAGE`, a key).
        store: a folder or a remote store's URI.
        more_bases: more base models, name -> path (a worker each).
        env: the service's environment (default: this one without `RAY_ADDRESS`, so it starts a local Ray of its own).
        flags: more `posttrain serve` options, e.g. `max_loras=2` for `--max-loras 2`.
    """

    def __init__(self, base_name: str, base_path: Path | str, store: Path | str, state_dir: Path, log: Path,
                 keys: dict[str, str], port: int | None = None, more_bases: dict[str, Path] | None = None,
                 env: dict[str, str] | None = None, **flags):  # fmt: skip
        self.base_name, self.base_path, self.store, self.state_dir, self.log = (
            base_name,
            base_path,
            store,
            state_dir,
            log,
        )
        self.keys = keys
        self.bases = {base_name: base_path, **(more_bases or {})}
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = {k.replace("_", "-"): v for k, v in flags.items()}
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.groups: list[int] = []

    def start(self, timeout: float = 240) -> ServiceProcess:
        keys = self.state_dir.parent / "keys.txt"
        keys.parent.mkdir(parents=True, exist_ok=True)
        keys.write_text("".join(f"{k} {t}\n" for k, t in self.keys.items()))
        cmd = [sys.executable, "-m", "flows.cli", "--store", str(self.store), "serve", "--port", str(self.port),
               "--keys", str(keys), "--state-dir", str(self.state_dir)]  # fmt: skip
        for name, path in self.bases.items():
            cmd += ["--base-model", f"{name}={path}"]
        for name, value in self.flags.items():
            cmd += [f"--{name}", str(value)]
        env = self.env or own_ray_environment()
        out = self.log.open("a")
        since = out.tell()  # a restarted service appends to the same log
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.groups.append(self.proc.pid)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"posttrain serve exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            # The gateway answers as soon as it is up; the service is ready once `serve.run` has returned, every
            # model worker up too, which the command says on its stdout.
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/api/v1/healthz", timeout=2) as r:
                    if r.status == 200 and READY.encode() in self.log.read_bytes()[since:]:
                        return self
            time.sleep(1)
        raise TimeoutError(f"posttrain serve not healthy in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def kill9(self) -> None:
        """A crash: SIGKILL to the service's process only (Ray's reaper takes its actors down)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        deadline = time.time() + 60
        while time.time() < deadline:  # wait until the port is free again
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.5)

    def stop(self, grace_s: float = 4.0) -> None:
        """Ctrl-C, then SIGKILL to its process group after `grace_s`. An idle service stops in 3-6 s; one with
        requests in flight gives them up to 5 s more, which a test or a benchmark that is done with
        it has no use for: the SIGKILL ends its Ray processes all the same, and a restart reads the journal (an
        autocommitted SQLite file), not anything a clean stop writes."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        for group in self.groups:  # whatever a crash left behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
