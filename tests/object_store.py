"""A real S3-compatible object store for the tests: moto's S3 server (a real HTTP server speaking S3) on 127.0.0.1,
reached through the same pyarrow filesystem code a cluster uses, with a fault injector in front of it that resets
or stalls connections in the middle of objects.

The store is configured the way a user configures S3: ``AWS_ENDPOINT_URL`` and credentials in the environment
(pyarrow's S3 filesystem reads them; Ray workers inherit them from the driver or the runtime env)."""
from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter, defaultdict, deque
from pathlib import Path

BUCKET = "rayvl-test"


class Faults:
    """What the next GETs of an object do: a queue of actions per key, taken one per GET of that key.
    ``("reset", after)`` sends ``after`` bytes of the body, then resets the TCP connection (RST, as a load balancer
    or a dying server does); ``("stall", after, seconds)`` sends ``after`` bytes, then sends nothing for
    ``seconds``; ``("status", code, s3_code)`` answers with that S3 error (503 SlowDown is S3's throttling)."""

    def __init__(self):
        self.plan: dict[str, deque] = defaultdict(deque)
        self.injected: Counter = Counter()
        self.gets: Counter = Counter()
        self.requests: list[tuple[str, str, str]] = []  # (method, path, query) of every request
        self.lock = threading.Lock()

    def add(self, key: str, *actions: tuple) -> None:
        with self.lock:
            self.plan[key].extend(actions)

    def clear(self) -> None:
        with self.lock:
            self.plan.clear()
            self.injected.clear()
            self.gets.clear()
            self.requests.clear()

    def next_action(self, key: str):
        with self.lock:
            self.gets[key] += 1
            queue = self.plan.get(key)
            return queue.popleft() if queue else None


class FaultInjector:
    """WSGI middleware between the clients and moto's S3 app."""

    def __init__(self, app, faults: Faults):
        self.app, self.faults = app, faults

    def __call__(self, environ, start_response):
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD")
        with self.faults.lock:
            self.faults.requests.append((method, path, environ.get("QUERY_STRING", "")))
        key = path.split("/", 2)[-1]
        action = self.faults.next_action(key) if method == "GET" else None
        if action is None:
            return self.app(environ, start_response)
        self.faults.injected[(key, action[0])] += 1
        if action[0] == "status":  # ("status", 503, "SlowDown") or ("status", 403, "AccessDenied")
            start_response(f"{action[1]} {action[2]}", [("Content-Type", "application/xml")])
            return [f"<Error><Code>{action[2]}</Code><Message>injected</Message></Error>".encode()]
        return self._cut(environ, start_response, action)

    def _cut(self, environ, start_response, action):
        body = b"".join(self.app(environ, start_response))
        yield body[:action[1]]
        if action[0] == "stall":
            time.sleep(action[2])
            yield body[action[1]:]
            return
        sock = environ["werkzeug.socket"]
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close → RST, not FIN
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()


class ObjectStore:
    """moto's S3 server with a fault injector, on 127.0.0.1 and a free port."""

    def __init__(self):
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        self.faults = Faults()
        app = FaultInjector(DomainDispatcherApplication(create_backend_app), self.faults)
        self.server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def env(self) -> dict[str, str]:
        """What a user sets to reach an S3-compatible store (pyarrow reads AWS_ENDPOINT_URL)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def upload_folder(self, folder: Path, prefix: str, bucket: str = BUCKET) -> str:
        """Every file of ``folder`` under s3://bucket/prefix/; returns that URL."""
        s3 = self.client()
        for path in sorted(Path(folder).iterdir()):
            if path.is_file():
                s3.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())
        return f"s3://{bucket}/{prefix}"

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join()


def start() -> ObjectStore:
    """An object store with the test bucket, its settings in ``os.environ`` (so this process and the Ray workers it
    starts reach it)."""
    import os

    store = ObjectStore()
    os.environ.update(store.env)
    store.client().create_bucket(Bucket=BUCKET)
    return store
