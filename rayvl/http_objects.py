"""Objects behind ``http://`` and ``https://`` URLs — shards on a web server or a CDN, a Hugging Face repository's
files (``https://huggingface.co/datasets/OWNER/NAME/resolve/main/…``), a presigned object-store URL — read the way
webdataset and open_clip read ``https://`` shards (one streamed GET), with what a long run needs around it:

- a read resumed at a byte (``Range: bytes=N-``; a server that ignores ranges answers 200 and its first N bytes are
  skipped), so a reset connection costs no rows (rayvl.data.shard_io retries it);
- statuses as the errors they are: 404/410 a missing object, 401/403 a refused one (not retried), 408/429/5xx and
  cut connections transient (retried);
- the Hugging Face Hub: its page URLs (``…/tree/main``, ``…/blob/main/x.tar``, ``…/raw/main/…``) read as the
  files they show (``…/resolve/main/…``, as CLIP_benchmark rewrites its ``tree/main`` roots), the Hub at
  ``HF_ENDPOINT`` (huggingface_hub's variable: a mirror) and ``HF_TOKEN`` sent to it for gated and private
  repositories — only to it: requests drops the header when the Hub redirects to its CDN on another host.

HTTP has no listing: a URL names one object (a shard, a file), never a folder or a glob.
"""
from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass

SCHEMES = ("http://", "https://")
HUB = "https://huggingface.co"
# a Hub page: /[datasets|spaces/]OWNER/NAME/(tree|blob|raw)/REVISION[/PATH]; its file: …/resolve/…
_HUB_PAGE = re.compile(r"^/((?:datasets/|spaces/)?[^/]+/[^/]+)/(?:tree|blob|raw)/(.+)$")
_HUB_FILE = re.compile(r"^/(?:datasets/|spaces/)?[^/]+/([^/]+)/(?:tree|blob|raw|resolve)/[^/]+/?(.*)$")
_MISSING, _REFUSED = (404, 410), (401, 403)
_sessions = threading.local()  # a requests Session a thread: its connection pool is reused across shards


def is_http(path: str) -> bool:
    return str(path).startswith(SCHEMES)


def hub() -> str:
    """The Hugging Face Hub this machine reaches: HF_ENDPOINT (a mirror, or a test server), else huggingface.co."""
    return os.environ.get("HF_ENDPOINT", HUB).rstrip("/")


def file_url(url: str) -> str:
    """The URL of the file a Hub page shows (``tree``/``blob``/``raw`` → ``resolve``); any other URL as it is."""
    base = hub()
    if not url.startswith(base + "/"):
        return url
    page = _HUB_PAGE.match(url[len(base):])
    return f"{base}/{page[1]}/resolve/{page[2]}" if page else url


def without_query(url: str) -> str:
    """An http(s) URL without its query (a presigned URL's signature, ``?download=true``): the object it names;
    any other path as it is."""
    return url.split("?", 1)[0] if is_http(url) else url


def repository_path(url: str) -> str:
    """A Hub URL as the repository's path (``…/datasets/clip-benchmark/wds_cars/tree/main/test`` →
    ``wds_cars/test``: what a folder of the same files would be called); any other URL as it is."""
    base = hub()
    found = _HUB_FILE.match(url[len(base):].rstrip("/")) if url.startswith(base + "/") else None
    return "/".join(p for p in found.groups() if p) if found else url


@dataclass(frozen=True)
class Info:
    size: int | None  # bytes (None: the server did not say)
    version: str  # what changes when the object is replaced: its ETag, else its Last-Modified, with its size


def info(url: str) -> Info | None:
    """What a lookup says of the object; None when it does not exist. Raises PermissionError when access is
    refused, OSError for any other failure. The Hub's answer is its redirect's (the file's size and ETag, as
    huggingface_hub reads them: the CDN's signed URL is for GETs alone); a server that refuses HEAD — as a URL
    signed for GET does, with 403 — is asked for the object's first byte instead."""
    url = file_url(url)
    response = _request("HEAD", url, redirects=not url.startswith(hub() + "/"))
    if response.is_redirect:
        linked = _count(response.headers.get("X-Linked-Size"))
        if linked is not None:
            return Info(linked, f"{linked} {response.headers.get('X-Linked-Etag', '')}")
        response = _request("HEAD", url)
    if response.status_code in (403, 405, 501):
        response = _request("GET", url, {"Range": "bytes=0-0"}, stream=True)
        response.close()
    if response.status_code in _MISSING:
        return None
    _raise_for(response, url)
    whole = response.headers.get("Content-Range", "").rpartition("/")[2]  # "bytes 0-0/SIZE" of a ranged answer
    length = whole if response.status_code == 206 else response.headers.get("Content-Length")
    size = _count(length)
    return Info(size, f"{size} {response.headers.get('ETag') or response.headers.get('Last-Modified') or ''}")


def _count(text: str | None) -> int | None:
    return int(text) if text and text.isascii() and text.isdecimal() else None


def read_bytes(url: str, limit: int | None = None) -> bytes:
    """The object's bytes (its first ``limit`` where given: one ranged GET)."""
    body = open_at(url, 0, limit)
    try:
        return body.read()
    finally:
        body.close()


def copy_to(url: str, out, retries: int = 5) -> None:
    """The object's bytes written to the open file ``out``, a cut connection resumed at the byte written (a
    weights file of gigabytes is not fetched again from its start)."""
    written, attempt = 0, 0
    while True:
        try:
            body = open_at(url, written)
            try:
                while data := body.read(16 << 20):
                    out.write(data)
                    written += len(data)
            finally:
                body.close()
            return
        except (FileNotFoundError, PermissionError):
            raise
        except OSError:
            attempt += 1
            if attempt > retries:
                raise
            time.sleep(min(30.0, 2.0 ** (attempt - 1)))


def open_at(url: str, position: int, limit: int | None = None) -> "Body":
    """The object's bytes from ``position`` on (up to ``limit`` of them), as a stream with ``read(n)``."""
    url = file_url(url)
    headers = {}
    if position or limit is not None:
        headers["Range"] = f"bytes={position}-" + ("" if limit is None else str(position + limit - 1))
    response = _request("GET", url, headers, stream=True)
    if response.status_code == 416 and position:  # nothing from position on: at the end, if the object is as long
        response.close()
        if response.headers.get("Content-Range", "") != f"bytes */{position}":
            raise OSError(f"{url}: asked for bytes {position}- and got HTTP 416 "
                          f"({response.headers.get('Content-Range')!r}): the object is not the one read before")
        return Body(url, None, 0)
    if response.status_code in _MISSING:
        response.close()
        raise FileNotFoundError(f"{url}: HTTP {response.status_code} {response.reason}")
    _raise_for(response, url)
    body = Body(url, response, limit)
    if position and response.status_code == 200:  # the server sent the whole object: skip what was read before
        body.skip(position)
    elif position and not response.headers.get("Content-Range", "").startswith(f"bytes {position}-"):
        body.close()
        raise OSError(f"{url}: asked for bytes {position}- and got {response.headers.get('Content-Range')!r}")
    return body


class Body:
    """A GET's body read as it arrives; a cut connection or a stalled read is an OSError (rayvl.data.shard_io
    retries it from the byte reached), said with the URL asked for (not a CDN's signed one)."""

    def __init__(self, url: str, response, limit: int | None):
        self.url, self.response, self.left = url, response, limit

    def read(self, n: int = -1) -> bytes:
        if self.left is not None:
            n = self.left if n < 0 else min(n, self.left)
        data = self._raw(n)
        if self.left is not None:
            self.left -= len(data)
        return data

    def skip(self, n: int) -> None:
        """Past the object's first ``n`` bytes (a whole object sent for a ranged ask), ``limit`` untouched."""
        while n > 0:
            data = self._raw(min(n, 1 << 20))
            if not data:
                raise OSError(f"{self.url}: the object ended before byte {n} of an earlier read")
            n -= len(data)

    def _raw(self, n: int) -> bytes:
        import urllib3

        if self.response is None or n == 0:
            return b""
        try:
            return self.response.raw.read(None if n < 0 else n)
        except urllib3.exceptions.HTTPError as e:  # a reset, a read timeout, a body cut short: urllib3's, not OSError
            raise OSError(f"{self.url}: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        if self.response is not None:
            self.response.close()


# statuses worth asking again, at once and then after 1, 2 s (or as Retry-After says, up to RETRY_AFTER_MAX_S) —
# before the answer is an error; a shard's read has data.io_retries above this, resuming at the byte it reached
_RETRIED = (408, 429, 500, 502, 503, 504)
RETRY_AFTER_MAX_S = 30.0


def _session():
    """This thread's requests Session (its pool's connections reused across shards), with its retries."""
    import requests
    from requests.adapters import HTTPAdapter

    session = getattr(_sessions, "session", None)
    if session is None:
        session = _sessions.session = requests.Session()
        retry = _retry_class()(total=3, connect=2, read=1, status_forcelist=_RETRIED, allowed_methods=("HEAD", "GET"),
                               backoff_factor=0.5, respect_retry_after_header=True, raise_on_status=False)
        for scheme in SCHEMES:
            session.mount(scheme, HTTPAdapter(max_retries=retry))
    return session


def _retry_class():
    """urllib3's Retry with Retry-After bounded (its own bound is 6 hours a wait) and an unreadable one ignored
    (urllib3 raises InvalidHeader for ``Retry-After: soon``, which would end the request)."""
    from urllib3.exceptions import InvalidHeader
    from urllib3.util.retry import Retry

    class BoundedRetry(Retry):
        def get_retry_after(self, response):
            try:
                after = super().get_retry_after(response)
            except InvalidHeader:
                return None
            return None if after is None else min(after, RETRY_AFTER_MAX_S)

    return BoundedRetry


# a process forked from one that used a Session makes its own (the pool's sockets are the parent's)
os.register_at_fork(after_in_child=_sessions.__dict__.clear)


def _request(method: str, url: str, headers: dict | None = None, stream: bool = False, redirects: bool = True):
    """One request, redirects followed, with the Hub's token where the URL is the Hub's. A connection that cannot
    be made, a timeout or a header the server sent that cannot be read is requests' error — an OSError; a URL that
    cannot be fetched is no object at all (FileNotFoundError: not retried), a token that cannot be sent a refusal
    (PermissionError), said without its value."""
    import requests

    # identity: a .tar.gz's bytes as stored (a server's gzip encoding would otherwise be undone under the parser)
    headers = {"Accept-Encoding": "identity", **(headers or {})}
    token = _token()
    if token and url.startswith(hub() + "/"):
        if not all(" " < c <= "~" for c in token):  # what a header can carry: a pasted quote or break cannot
            raise PermissionError(f"{url}: HF_TOKEN holds characters an HTTP header cannot carry (a pasted quote, a "
                                  f"space or a line break?)")
        headers["Authorization"] = f"Bearer {token}"
    timeout = float(os.environ.get("RAYVL_HTTP_TIMEOUT_S", 60))
    try:
        return _session().request(method, url, headers=headers, stream=stream, allow_redirects=redirects,
                                  timeout=(min(timeout, 30.0), timeout))
    except (requests.exceptions.InvalidURL, requests.exceptions.InvalidSchema,
            requests.exceptions.MissingSchema) as e:
        raise FileNotFoundError(f"{url}: not a URL requests can fetch ({type(e).__name__}: {e})") from None


def _token() -> str:
    return (os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or "").strip()


def _raise_for(response, url: str) -> None:
    """A status that is no answer: refused (PermissionError, with the way in for the Hub), else an OSError. The
    Hub says why in X-Error-Code and X-Error-Message (huggingface_hub reads them too): said with the status."""
    if response.status_code < 400:
        return
    response.close()
    why = " ".join(f"{response.headers.get('X-Error-Code', '')} {response.headers.get('X-Error-Message', '')}".split())
    said = f"{url}: HTTP {response.status_code} {response.reason}" + (f" ({why})" if why else "")
    if response.status_code in _REFUSED:
        raise PermissionError(said + _way_in(url, response.headers.get("X-Error-Code", "")))
    raise OSError(said)


def _way_in(url: str, code: str) -> str:
    """What to do about a refusal of the Hub: a gated repository's terms, a missing or private one's name or
    token, a token without access."""
    if not url.startswith(hub() + "/"):
        return ""
    if code == "GatedRepo":
        return (" — a gated repository: accept its terms on its page with the account whose HF_TOKEN every node "
                "sets")
    if code == "RepoNotFound":
        return (" — no repository of that name, or a private one: check the name (and datasets/ before a data "
                "set's) or set HF_TOKEN of an account with access on every node")
    return (" — a gated or private Hugging Face repository (or none of that name): accept its terms and set HF_TOKEN "
            "on every node" if not _token() else
            " — HF_TOKEN is set: its account has no access to this repository (or there is none of that name)")
