"""An S3 API on 127.0.0.1 for the tests: moto's standalone server (`moto_server`), a process of its own, with a
bucket. No object-store server is installable here that is closer to the real thing: PyPI packages none, npm's
Zenko CloudServer needs git dependencies from GitHub, and Debian's radosgw a whole Ceph cluster.

The store reaches it the way a user reaches MinIO: the standard AWS variables (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL_S3`), read by botocore whenever s3fs makes a client.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from posttrain_core.cluster import free_port


@contextlib.contextmanager
def s3_server(log: Path, bucket: str = "posttrain") -> Iterator[dict[str, str]]:
    """Start the server, create `bucket`; yield the environment that points s3fs at it (set it in os.environ)."""
    exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    env = {
        "AWS_ACCESS_KEY_ID": "posttrain-test",
        "AWS_SECRET_ACCESS_KEY": "posttrain-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
    }
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-2000:]
                time.sleep(0.2)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            import fsspec

            fsspec.filesystem("s3", skip_instance_cache=True).mkdir(bucket)
            yield {**env, "bucket": bucket}
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        proc.kill()
        proc.wait(timeout=10)
