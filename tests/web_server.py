"""A real HTTP server for the tests (werkzeug's, threaded, on 127.0.0.1), serving a folder three ways:

- ``/files/PATH``: as a web server or a CDN does — HEAD, ETag, ``Range`` answered with 206 (werkzeug's send_file);
- ``/plain/PATH``: a server that ignores ``Range`` (always 200 and the whole file);
- the Hugging Face Hub's file URLs, ``/[datasets/]OWNER/NAME/resolve/REVISION/PATH`` → ``hub/[datasets/]OWNER/NAME/
  PATH``: text files answered there, others (LFS files on the Hub) redirected (302, the file's size and ETag in
  X-Linked-Size and X-Linked-Etag) to ``/cdn/…`` on ``localhost`` — another host, as the Hub's CDN is, whose URLs
  refuse HEAD as URLs signed for GET do; a repository in ``gated`` answers 401 without ``Authorization: Bearer
  TOKEN``, as a gated one does, and one that is not there 401 too, as the Hub answers for a missing or private
  one (each with the Hub's X-Error-Code and X-Error-Message).

Faults come from object_store.Faults, keyed by a GET's path or by ``"HEAD PATH"``: ``("reset", after)`` sends
``after`` bytes of the body then resets the connection, ``("status", code, reason[, headers])`` answers with that
status.
Every request is recorded with its method, path, Range and whether it carried an Authorization header."""
from __future__ import annotations

import re
import socket
import struct
import threading
from pathlib import Path

from object_store import Faults

TOKEN = "hf_test_token"
_RESOLVE = re.compile(r"^/((?:datasets/)?[^/]+/[^/]+)/resolve/[^/]+/(.+)$")


def _quiet_handler():
    from werkzeug.serving import WSGIRequestHandler

    class Quiet(WSGIRequestHandler):
        def log_request(self, *args, **kwargs):  # a line a request on stderr: the tests read the record instead
            pass

    return Quiet


class WebServer:
    def __init__(self, root: Path, gated: tuple[str, ...] = ()):
        from werkzeug.serving import make_server

        self.root, self.gated = Path(root), set(gated)
        self.faults = Faults()
        self.seen: list[tuple[str, str, str, bool]] = []  # (method, path, Range, Authorization sent)
        self.lock = threading.Lock()
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True, request_handler=_quiet_handler())
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def app(self, environ, start_response):
        from werkzeug.exceptions import HTTPException
        from werkzeug.utils import redirect, send_file
        from werkzeug.wrappers import Request, Response

        request = Request(environ)
        path = request.path
        with self.lock:
            self.seen.append((request.method, path, request.headers.get("Range", ""),
                              "Authorization" in request.headers))
        action = self.faults.next_action(path if request.method == "GET" else f"{request.method} {path}")
        if action is not None:
            self.faults.injected[(path, action[0])] += 1
            if action[0] == "status":  # ("status", code, reason[, headers])
                return Response(f"injected {action[1]}", status=f"{action[1]} {action[2]}",
                                headers=action[3] if len(action) > 3 else None)(environ, start_response)
        hub = _RESOLVE.match(path)
        if hub:
            if hub[1] in self.gated and request.headers.get("Authorization") != f"Bearer {TOKEN}":
                return Response("gated", status=401, headers={  # the Hub's words
                    "X-Error-Code": "GatedRepo", "X-Error-Message": f"Access to model {hub[1]} is restricted."
                })(environ, start_response)
            if not (self.root / "hub" / hub[1]).is_dir():  # the Hub: 401 for a repository it has not (or hides)
                return Response("no repository", status=401, headers={
                    "X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})(environ, start_response)
            file = self.root / "hub" / hub[1] / hub[2]
            if file.is_file() and not file.name.endswith(".txt"):  # an LFS file: the CDN, on another host, and
                # the file's size and ETag in the redirect, as the Hub says them
                response = redirect(f"http://localhost:{self.port}/cdn/{hub[1]}/{hub[2]}")
                response.headers["X-Linked-Size"] = str(file.stat().st_size)
                response.headers["X-Linked-Etag"] = f'"{file.stat().st_mtime_ns}-{file.stat().st_size}"'
                return response(environ, start_response)
        elif path.startswith("/cdn/"):  # its URLs are signed for GET: a HEAD is refused, as S3 refuses it
            if request.method == "HEAD":
                return Response("signed for GET", status=403)(environ, start_response)
            file = self.root / "hub" / path.removeprefix("/cdn/")
        elif path.startswith(("/files/", "/plain/")):
            file = self.root / path.split("/", 2)[2]
        else:
            file = Path("/nonexistent")
        if not file.is_file():
            return Response("not found", status=404)(environ, start_response)
        try:
            response = send_file(file, environ, conditional=not path.startswith("/plain/"), max_age=None)
        except HTTPException as e:  # a range past the end: 416, with Content-Range bytes */SIZE
            return e(environ, start_response)
        if action is None:
            return response(environ, start_response)
        return self._cut(response, environ, start_response, action[1])

    @staticmethod
    def _cut(response, environ, start_response, after: int):
        body = b"".join(response(environ, start_response))
        yield body[:after]
        sock = environ["werkzeug.socket"]
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close → RST, not FIN
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()

    def requests_to(self, path: str) -> list[tuple[str, str, str, bool]]:
        with self.lock:
            return [r for r in self.seen if r[1] == path]

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join()
