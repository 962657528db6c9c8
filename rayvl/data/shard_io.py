"""The bytes of one shard, through errors that are not the data's fault.

Object storage fails now and then: a connection reset in the middle of an object, a stalled read, throttling
(503 SlowDown). None of that says anything about the shard, so it must not cost rows. A shard is read as a byte
stream that knows its position: after a transient error the stream is opened again *at the byte it reached* (a
ranged GET on object storage and over HTTP, a seek on a file, a re-run command whose first bytes are skipped for
``pipe:``) and the tar parser above never notices. What retries cannot mend — the object is missing, access is
denied, or the errors outlast ``data.io_retries`` — is a ``ShardIOError`` naming the shard and the cause: the run
fails with it, or, under ``data.unreadable_shards=skip`` (a choice the user makes), the rest of that shard is
skipped and counted as ``unreadable_shards``. A damaged tar (truncated, bad header) is the data's fault:
``shards.py`` counts it as ``truncated_shards`` and keeps the samples before the damage.

pyarrow's S3 client retries each request on its own first (about 30 attempts over a few seconds, seen against
the test server), as rayvl.http_objects' requests do a busy or failing status (429, 5xx) before a body comes;
``data.io_retries`` is the layer above them, with waits long enough to outlast a throttling spell.
"""
from __future__ import annotations

import io
import random
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from rayvl import http_objects, storage
from rayvl.errors import DataPlaneError
from rayvl.data.specs import DENIED_WORDS
from rayvl.spec_syntax import PIPE

# what pyarrow's S3/GCS clients say when retrying cannot help (its errors are OSErrors with the service's words)
_DENIED = DENIED_WORDS
_MISSING = ("NO_SUCH_KEY", "NoSuchKey", "NO_SUCH_BUCKET", "NoSuchBucket", "RESOURCE_NOT_FOUND", "NOT_FOUND",
            "Path does not exist")
REASONS = {"missing": "it does not exist", "denied": "access is denied",
           "transient": "I/O errors went on past data.io_retries"}


@dataclass(frozen=True)
class ReadPolicy:
    """How shard reads meet I/O errors (``data.io_retries``, ``data.io_retry_wait_s``, ``data.unreadable_shards``,
    ``data.read_buffer_mib``)."""

    retries: int = 5
    wait_s: float = 2.0
    max_wait_s: float = 60.0
    unreadable: Literal["fail", "skip"] = "fail"
    buffer_bytes: int = 16 << 20

    @classmethod
    def of(cls, data) -> "ReadPolicy":
        """The policy a DataConfig sets."""
        return cls(retries=data.io_retries, wait_s=data.io_retry_wait_s, unreadable=data.unreadable_shards,
                   buffer_bytes=data.read_buffer_mib << 20)

    def wait(self, attempt: int) -> float:
        """Exponential backoff with jitter (many read tasks hitting one throttled prefix must not retry in step)."""
        return min(self.max_wait_s, self.wait_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


class ShardIOError(DataPlaneError):
    """A shard that cannot be read: ``reason`` is missing, denied or transient (retries exhausted)."""

    def __init__(self, path: str, reason: str, detail: str, attempts: int, position: int):
        self.path, self.reason, self.detail, self.attempts, self.position = path, reason, detail, attempts, position
        super().__init__(f"shard {path} cannot be read: {REASONS[reason]} ({detail}; at byte {position}, "
                         f"{attempts} attempt{'s' if attempts > 1 else ''}) — fix the data or its access, or set "
                         f"data.unreadable_shards=skip to skip such shards (counted as unreadable_shards)")

    def __reduce__(self):  # raised in a Ray task, re-raised on the driver: pickled with its fields
        return type(self), (self.path, self.reason, self.detail, self.attempts, self.position)


def classify(error: BaseException) -> str:
    """missing, denied or transient (worth retrying: timeouts, resets, throttling, a failed command, anything else
    an I/O layer raises — after the retries the error still names it)."""
    if isinstance(error, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return "missing"
    if isinstance(error, PermissionError):
        return "denied"
    text = str(error)
    if any(word in text for word in _DENIED):
        return "denied"
    if any(word in text for word in _MISSING):
        return "missing"
    return "transient"


def open_shard(path: str, policy: ReadPolicy = ReadPolicy(), retried: Counter | None = None) -> io.BufferedReader:
    """A buffered binary stream of a shard (local path, URL or ``pipe:`` command) that resumes after transient
    errors; ``retried["io_retries"]`` counts the retries."""
    return io.BufferedReader(ResumableStream(path, policy, retried), buffer_size=policy.buffer_bytes)


class ResumableStream(io.RawIOBase):
    """A shard's bytes from ``position`` on; every raw read is one request (a ranged GET on object storage), so
    the buffer size above sets the request size."""

    def __init__(self, path: str, policy: ReadPolicy, retried: Counter | None):
        super().__init__()
        self.path, self.policy, self.retried = path, policy, retried
        self.position = 0
        self._source = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        attempt = 0
        while True:
            try:
                if self._source is None:
                    self._source = _open_at(self.path, self.position)
                data = self._source.read(len(buffer))
                break
            except OSError as e:
                self._drop()
                attempt += 1
                reason = classify(e)
                if reason != "transient" or attempt > self.policy.retries:
                    raise ShardIOError(self.path, reason, f"{type(e).__name__}: {' '.join(str(e).split())}",
                                       attempt, self.position) from e
                if self.retried is not None:
                    self.retried["io_retries"] += 1
                time.sleep(self.policy.wait(attempt))
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)

    def _drop(self) -> None:
        source, self._source = self._source, None
        if source is not None:
            try:
                source.close()
            except OSError:
                pass

    def close(self) -> None:
        self._drop()
        super().close()


def _open_at(path: str, position: int):
    """A source with ``read(n)`` positioned at byte ``position`` of the shard."""
    if path.startswith(PIPE):
        return _Command(path[len(PIPE):], position)
    if http_objects.is_http(path):  # one streamed GET from the byte reached (Range), as webdataset streams it
        return http_objects.open_at(path, position)
    if not storage.is_url(path):
        f = open(path, "rb")
    else:
        fs, inner = storage.filesystem(path)
        f = fs.open_input_file(inner)  # random access: each read is a ranged request
    if position:
        f.seek(position)
    return f


class _Command:
    """``pipe:`` — a shell command's standard output (webdataset's convention). A command that exits non-zero did
    not give the whole shard: an OSError with its status and the end of its standard error, retried like any
    transient error by running it again and skipping the bytes already read."""

    def __init__(self, command: str, position: int):
        self.command = command
        self.stderr = tempfile.TemporaryFile()  # a file, not a pipe: a chatty command cannot block on it
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=self.stderr)
        while position > 0:
            skipped = self.read(min(position, 1 << 20))
            if not skipped:
                raise OSError(f"pipe command {command!r} gave fewer bytes than on its earlier run")
            position -= len(skipped)

    def read(self, n: int) -> bytes:
        data = self.proc.stdout.read(n)
        if not data and self.proc.wait() != 0:
            self.stderr.seek(0)
            tail = self.stderr.read()[-300:].decode(errors="replace").strip()
            raise OSError(f"pipe command {self.command!r} exited with status {self.proc.returncode}: {tail}")
        return data

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()
