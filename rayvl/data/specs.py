"""Shard specs as webdataset and open_clip users write them → the list of shards a run reads.

A spec is one or more sources joined by ``::`` (open_clip's way to mix datasets); a source is a comma list of
parts; a part is brace-expanded (``{00000..41407}`` ranges, ``{a,b}`` alternatives — the ``braceexpand`` package,
as webdataset does) into

- ``pipe:COMMAND`` — the shard is the command's standard output (``pipe:aws s3 cp s3://b/00000.tar -``);
- a URL (``s3://``, ``gs://``, ``file://``, any fsspec scheme): a ``.tar`` object, a folder (its ``.tar`` files) or
  a glob in the last path component (one listing of its folder); an ``http(s)://`` URL names one shard, its
  query (``?download=true``, a presigned URL's signature) kept (rayvl.http_objects: HTTP has no listing);
- a local path: a ``.tar`` file, a folder, a glob, or a ``.txt`` file listing one shard per line.

Resolving costs a listing per folder or glob and no request per brace-expanded object name: LAION-400M's 41,408
names are made, not listed. ``check`` then looks at what is cheap to look at before Ray starts — every local name,
the first and last object of each brace range, the folders listed — and says what it did not check.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from braceexpand import braceexpand

from rayvl import http_objects, storage
from rayvl.config import ConfigError
from rayvl.errors import DataPlaneError
from rayvl.spec_syntax import is_pipe, source_parts, sources

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
GLOB_CHARS = "*?["
CHECK_ALL_UP_TO = 8  # a brace range this short has every object checked


@dataclass
class Resolved:
    """The shards of a spec, and how each part found them (what ``check`` may look at)."""

    spec: str
    paths: list[str] = field(default_factory=list)
    named_urls: list[list[str]] = field(default_factory=list)  # per part: object names made, not listed
    pipes: int = 0
    listed: int = 0  # shards found by listing a folder or a glob (local or remote)
    from_lists: int = 0  # shards read from .txt list files, taken as written
    missing: list[str] = field(default_factory=list)  # local names that do not exist: all of them in one error
    sources: list[int] = field(default_factory=list)  # shards of each ``::`` source, in spec order (data/mix.py)


def resolve(spec: str) -> Resolved:
    """Every shard a spec names, in spec order; a part that names nothing is an error naming it."""
    if not spec or not spec.strip():
        raise DataPlaneError("no shards given")
    found = Resolved(spec)
    for source in sources(spec):
        first = len(found.paths)
        for part in source_parts(source):
            _add_part(part, spec, found)
        found.sources.append(len(found.paths) - first)
    if found.missing:
        n = len(found.missing)
        shown = ", ".join(repr(p) for p in found.missing[:5]) + (f" and {n - 5} more" if n > 5 else "")
        raise DataPlaneError(f"{shown} {'does' if n == 1 else 'do'} not exist"
                             + (f" ({n} of the shards {spec!r} names)" if n > 1 else ""))
    return found


def _add_part(part: str, spec: str, found: Resolved) -> None:
    before = len(found.paths)
    named: list[str] = []
    for item in braceexpand(part):
        _add(item, found, named)
    if named:
        found.named_urls.append(named)
    if len(found.paths) == before and not found.missing:
        raise DataPlaneError(f"{part!r} matches no shard" + (f" (in {spec!r})" if part != spec else ""))


def resolve_shards(spec: str | Sequence[str]) -> list[str]:
    """The shard paths of a spec (see the module docstring). A list of shards already resolved is taken as it is:
    a run's plan resolves each spec once (on object storage every listing is a request per folder) and hands the
    list on."""
    return list(spec) if not isinstance(spec, str) else resolve(spec).paths


def _add(item: str, found: Resolved, named: list[str]) -> None:
    if is_pipe(item):
        found.paths.append(item)
        found.pipes += 1
    elif storage.is_url(item):
        _add_url(item, found, named)
    else:
        _add_local(os.path.expanduser(item), found)


def _add_url(url: str, found: Resolved, named: list[str]) -> None:
    if http_objects.is_http(url):  # one object a URL: HTTP lists nothing, and a ? starts the URL's query
        named_path = http_objects.without_query(url)
        if not named_path.endswith(SHARD_SUFFIXES) or any(c in named_path for c in "*["):
            raise DataPlaneError(f"{url!r}: an http(s) URL names one shard (HTTP has no listing of folders or "
                                 f"globs) — name them with brace ranges (…/{{00000..00099}}.tar) or list them in a "
                                 f".txt file")
        found.paths.append(url)
        named.append(url)
        return
    base = url.rstrip("/").rsplit("/", 1)[-1]
    if any(c in base for c in GLOB_CHARS) or not base.endswith(SHARD_SUFFIXES):  # a glob or a folder: one listing
        try:
            listed = storage.list_files(url, SHARD_SUFFIXES)
        except OSError as e:
            raise DataPlaneError(f"cannot list {url!r}: {' '.join(str(e).split())}") from None
        found.paths += listed
        found.listed += len(listed)
    else:
        found.paths.append(url)
        named.append(url)


def _add_local(path: str, found: Resolved) -> None:
    if os.path.isdir(path):  # the shards in it (img2dataset's .parquet and _stats.json beside them are not)
        listed = sorted(p for p in glob.glob(os.path.join(glob.escape(path), "*")) if p.endswith(SHARD_SUFFIXES)
                        and os.path.isfile(p))
    elif path.endswith(".txt") and os.path.isfile(path):
        # a list file: one shard (path, URL or pipe:) per line, taken as written; a local one must exist, as every
        # local name a spec gives (a missing one would fail the run when its turn comes)
        lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
        local = [x for x in lines if not is_pipe(x) and not storage.is_url(x)]
        found.missing += [x for x in local if not os.path.isfile(os.path.expanduser(x))]
        found.paths += [x for x in lines if x not in set(found.missing)]
        found.from_lists += len(lines)
        return
    elif any(c in os.path.basename(path) for c in GLOB_CHARS):  # the shards it matches, as a folder's
        listed = sorted(p for p in glob.glob(path) if p.endswith(SHARD_SUFFIXES) and os.path.isfile(p))
    elif os.path.isfile(path):
        found.paths.append(path)
        return
    else:
        found.missing.append(path)
        return
    found.paths += listed
    found.listed += len(listed)


@dataclass
class SpecCheck:
    """What ``check`` found: the shards, and a line on what was and was not looked at."""

    paths: list[str]
    summary: str
    sources: tuple[int, ...] = ()
    """shards of each ``::`` source, in spec order."""


def check(spec: str) -> SpecCheck:
    """Resolve ``spec`` and check, at a cost that does not grow with the number of shards, that what it names
    exists: local names and listings are complete; of each brace range of object names, the first and the last
    (all when it has at most CHECK_ALL_UP_TO) are looked up. Raises DataPlaneError naming a missing one."""
    found = resolve(spec)
    looked = 0
    for named in found.named_urls:
        probe = named if len(named) <= CHECK_ALL_UP_TO else [named[0], named[-1]]
        for url in probe:
            try:
                found_it = storage.is_file(url)
            except OSError as e:  # GCS's status carries its retry metadata after error_info: left out
                raise DataPlaneError(f"cannot look up {url!r}: {' '.join(str(e).split(' error_info=')[0].split())}") \
                    from None
            if not found_it:
                raise DataPlaneError(f"{url!r} does not exist (named by {spec!r})")
        looked += len(probe)
    named = sum(len(n) for n in found.named_urls)
    notes = [f"{len(found.paths)} shard{'s' if len(found.paths) != 1 else ''}"]
    if found.listed:
        notes.append(f"{found.listed} found by listing")
    if named:
        notes.append(f"{named} object names made from the spec, {looked} of them checked (first and last of each "
                     f"range){'' if looked == named else f'; the other {named - looked} are checked when read'}")
    if found.pipes:
        notes.append(f"{found.pipes} pipe: commands, run when read")
    if found.from_lists:
        notes.append(f"{found.from_lists} from list files, taken as written")
    local = len(found.paths) - found.listed - named - found.pipes - found.from_lists
    if local > 0:
        notes.append(f"{local} local files named and found")
    if len(found.sources) > 1:
        notes.append(f"{len(found.sources)} sources mixed ({' + '.join(f'{n:,}' for n in found.sources)} shards)")
    return SpecCheck(found.paths, "; ".join(notes), tuple(found.sources))


# what object stores' clients (pyarrow's S3 and GCS) say when the credentials are refused or missing, and when the
# store cannot be reached: the way out is the machine's access, not the spec's form
DENIED_WORDS = ("ACCESS_DENIED", "AccessDenied", "PERMISSION_DENIED", "INVALID_ACCESS_KEY_ID", "InvalidAccessKeyId",
                "SIGNATURE_DOES_NOT_MATCH", "SignatureDoesNotMatch", "ExpiredToken", "UNAUTHENTICATED", "HTTP 401",
                "HTTP 403")
_NO_CREDENTIALS = ("access token", "credentials", "NoCredentials", "No response body")
_UNREACHABLE = ("UNAVAILABLE", "Could not resolve host", "Couldn't connect", "Connection refused", "timed out",
                "Timeout", "curlCode: 6", "curlCode: 7", "curlCode: 28", "Failed to resolve", "HTTP 429", "HTTP 5")
ACCESS_HINT = ("check the credentials this machine and every node use — S3: AWS_PROFILE or AWS_ACCESS_KEY_ID / "
               "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for an S3-compatible store, or the instance role; GCS: "
               "GOOGLE_APPLICATION_CREDENTIALS or the VM's service account; the Hugging Face Hub: HF_TOKEN")
REACH_HINT = ("the store cannot be reached from this machine, or answers that it is busy or failing: its network, or "
              "the endpoint (AWS_ENDPOINT_URL, the bucket's region, the server of an http(s) URL)")
FORM_HINT = ("give img2dataset shards as a folder, a glob, brace ranges ({00000..00099}.tar), a comma or :: list, "
             "a .txt list file, a URL or pipe:COMMAND")


def checked(key: str, spec: str) -> SpecCheck:
    """``check(spec)`` for the config key ``key``: a ConfigError naming it when the spec names nothing or names
    something missing or out of reach (before Ray starts), with the way out that fits: the credentials, the
    network, or the spec's forms."""
    try:
        return check(spec)
    except DataPlaneError as e:
        raise ConfigError(f"{key}: {e} — {way_out(str(e))}") from None


def way_out(error: str) -> str:
    """The hint for a spec's error: the network where the store was not reached (a credential lookup that could
    not reach its server included), the credentials where they were refused or missing, else the spec's forms."""
    if any(w in error for w in _UNREACHABLE[1:]):
        return REACH_HINT
    if any(w in error for w in DENIED_WORDS + _NO_CREDENTIALS):
        return ACCESS_HINT
    return REACH_HINT if _UNREACHABLE[0] in error else FORM_HINT
