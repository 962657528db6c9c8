"""Shard specs as webdataset / open_clip users write them, and shard reads through a real S3 server that fails:
every form resolves to the shards it names, checks cost no more for 41,408 objects than for 2, and an I/O error
costs no row — it is retried and resumed, or it fails naming the shard (no Ray here; the training run over S3
is in test_object_store.py)."""
import io
import os
import shutil
import tarfile
from collections import Counter

import pytest

from rayvl.data.report import DataPlaneError
from rayvl.data.shard_io import ReadPolicy, ShardIOError, open_shard
from rayvl.data.specs import ACCESS_HINT, REACH_HINT, check, resolve_shards, way_out
from rayvl.spec_syntax import parts
from rayvl.data.tar import iter_tar_samples

FAST = ReadPolicy(retries=3, wait_s=0.05)


def _keys(path: str, policy: ReadPolicy = FAST, retried: Counter | None = None) -> list[str]:
    with open_shard(path, policy, retried) as f:
        return [s["key"] for s in iter_tar_samples(f, ("key", "img"))]


@pytest.fixture(scope="module")
def shard_dir(demo_dir, tmp_path_factory):
    """Three demo shards (128 samples each) under open_clip-style names, and a second source folder."""
    out = tmp_path_factory.mktemp("specs")
    for sub in ("a", "b"):
        (out / sub).mkdir()
        for i in range(3):
            shutil.copy(demo_dir / "train" / f"{i:05d}.tar", out / sub / f"{i:05d}.tar")
    return out


def test_parts_split_sources_and_lists_but_not_braces_or_commands():
    assert parts("a/{0..2}.tar::b/{x,y}.tar,c.tar") == ["a/{0..2}.tar", "b/{x,y}.tar", "c.tar"]
    assert parts("pipe:curl -H 'a,b' s3://x/{0..1}.tar :: d") == ["pipe:curl -H 'a,b' s3://x/{0..1}.tar", "d"]


def test_every_local_form(shard_dir):
    a, b = shard_dir / "a", shard_dir / "b"
    three = [str(a / f"{i:05d}.tar") for i in range(3)]
    assert resolve_shards(f"{a}/{{00000..00002}}.tar") == three  # a zero-padded brace range
    assert resolve_shards(f"{a}/{{00000,00002}}.tar") == [three[0], three[2]]  # brace alternatives
    assert resolve_shards(str(a)) == resolve_shards(f"{a}/*.tar") == three  # a folder, a glob
    joined = resolve_shards(f"{a}/{{00000..00001}}.tar::{b}")  # open_clip's :: between sources
    assert joined == three[:2] + [str(b / f"{i:05d}.tar") for i in range(3)]
    assert resolve_shards(f"{a}/00000.tar,{b}/00001.tar") == [three[0], str(b / "00001.tar")]
    listing = shard_dir / "list.txt"
    listing.write_text(f"{three[1]}\n\n{three[0]}\n")
    assert resolve_shards(str(listing)) == [three[1], three[0]]
    gone = shard_dir / "gone.txt"  # a list's local names must exist too, checked before Ray starts
    gone.write_text(f"{three[1]}\n{a}/00009.tar\n")
    with pytest.raises(DataPlaneError, match=r"00009\.tar' does not exist"):
        resolve_shards(str(gone))
    for bad, named in ((f"{a}/{{00000..00003}}.tar", "00003.tar"), (f"{a}::{shard_dir}/nothing", "nothing"),
                       (f"{a}/x*.tar", "x*.tar")):
        with pytest.raises(DataPlaneError, match=named):  # each part must name something: no silent typo
            resolve_shards(bad)
    assert "3 local files named and found" in check(f"{a}/{{00000..00002}}.tar").summary
    # every missing name in one error, not the first alone
    with pytest.raises(DataPlaneError) as missing:
        resolve_shards(f"{a}/{{00000..00009}}.tar")
    assert str(missing.value) == (f"'{a}/00003.tar', '{a}/00004.tar', '{a}/00005.tar', '{a}/00006.tar', "
                                  f"'{a}/00007.tar' and 2 more do not exist (7 of the shards "
                                  f"'{a}/{{00000..00009}}.tar' names)")


def test_folders_and_globs_list_shards_not_img2datasets_side_files(shard_dir, tmp_path, capsys, monkeypatch):
    """img2dataset writes a .parquet and a _stats.json beside each shard: a folder, a glob over its output (`0000*`)
    and the same as a file:// URL list the shards alone, .tar.gz ones too; a first shard that is no tar is a line
    of the dry run's data check, not a traceback."""
    import gzip

    from rayvl.cli import main

    out = tmp_path / "laion"
    out.mkdir()
    shutil.copy(shard_dir / "a" / "00000.tar", out / "00000.tar")
    (out / "00001.tar.gz").write_bytes(gzip.compress((shard_dir / "a" / "00001.tar").read_bytes()))
    for name in ("00000.parquet", "00000_stats.json", "00001.parquet", "00001_stats.json"):
        (out / name).write_bytes(b"side file")
    shards = [str(out / "00000.tar"), str(out / "00001.tar.gz")]
    # macOS's tar puts a ._ file before each member (its extended attributes): no key, not a sample (as webdataset)
    mac = tmp_path / "mac.tar"
    with tarfile.open(shard_dir / "a" / "00000.tar") as src, tarfile.open(mac, "w") as dst:
        for m in src.getmembers()[:6]:
            for name in (f"._{m.name}", m.name):
                data = src.extractfile(m).read() if name == m.name else b"\x00\x05\x16\x07 attributes"
                info = tarfile.TarInfo(name)
                info.size = len(data)
                dst.addfile(info, io.BytesIO(data))
    with open(mac, "rb") as f:
        got = [sorted(k for k in x if x[k] is not None) for x in iter_tar_samples(f)]
    assert got == [["img", "img_ext", "json", "key", "txt"]] * 2
    from rayvl.data.shards import shard_samples

    assert shard_samples(str(mac)) == 2  # what a pass size counts from the headers alone
    assert resolve_shards(str(out)) == resolve_shards(f"{out}/0000*") == shards
    assert resolve_shards(f"file://{out}/0000*") == [f"file://{s}" for s in shards]
    # a compressed shard on object storage: its count from its head scales by the head's share of the file
    from rayvl.data import shards as shard_module

    gz = f"file://{out}/00001.tar.gz"
    assert shard_module.remote_shard_samples(gz) == (128, "holds")
    monkeypatch.setattr(shard_module, "ESTIMATE_BYTES", (out / "00001.tar.gz").stat().st_size // 2)
    assert 100 <= shard_module.remote_shard_samples(gz)[0] <= 160
    empty = tmp_path / "damaged"
    empty.mkdir()
    (empty / "00000.tar").write_bytes(b"")  # a shard img2dataset had not begun
    shutil.copy(shard_dir / "a" / "00001.tar", empty / "00001.tar")
    assert main(["data", "check", str(empty), "-n", "2"]) == 0
    said = capsys.readouterr().out
    assert f"{empty / '00000.tar'}: no sample (an empty or damaged shard)" in said
    assert "damaged after 0 samples (ReadError: empty file): the run reads those and counts the shard" in said


def test_pipe_commands_are_shards(shard_dir, tmp_path):
    """``pipe:`` streams a command's output (webdataset's convention); a command that fails half-way is run again
    and its first bytes skipped, so the tar parser sees one whole shard."""
    shard = shard_dir / "a" / "00001.tar"
    assert resolve_shards(f"pipe:cat {shard_dir}/a/{{00001..00002}}.tar") == [
        f"pipe:cat {shard_dir}/a/00001.tar", f"pipe:cat {shard_dir}/a/00002.tar"]
    expected = _keys(str(shard))
    assert len(expected) == 128 and _keys(f"pipe:cat {shard}") == expected
    marker = tmp_path / "failed-once"  # the first run gives 70,000 bytes, then exits 1
    flaky = (f"pipe:if [ -e {marker} ]; then cat {shard}; else touch {marker}; head -c 70000 {shard}; "
             f"echo broken >&2; exit 1; fi")
    retried: Counter = Counter()
    assert _keys(flaky, retried=retried) == expected and retried["io_retries"] == 1
    with pytest.raises(ShardIOError, match="exited with status 3: nope"):
        _keys("pipe:echo nope >&2; exit 3")


def test_object_store_specs_cost_no_listing(s3, shard_dir):
    """A brace range of object names is made, not listed: resolving LAION-400M's 41,408 names sends no request,
    and the check before Ray starts looks up the first and the last object only (two HEADs)."""
    url = s3.upload_folder(shard_dir / "a", "specs-laion")  # a prefix of its own: the store lives all session
    s3.client().copy_object(Bucket="rayvl-test", Key="specs-laion/41407.tar",
                            CopySource="rayvl-test/specs-laion/00002.tar")
    s3.faults.clear()
    spec = f"{url}/{{00000..41407}}.tar"
    paths = resolve_shards(spec)
    assert len(paths) == 41408 and paths[0] == f"{url}/00000.tar" and paths[-1] == f"{url}/41407.tar"
    assert s3.faults.requests == []
    summary = check(spec).summary
    assert [m for m, _, _ in s3.faults.requests] == ["HEAD", "HEAD"]
    assert "41408 object names made from the spec, 2 of them checked" in summary
    assert "the other 41406 are checked when read" in summary
    with pytest.raises(DataPlaneError, match="specs-laion/41408.tar' does not exist"):
        check(f"{url}/{{00000..41408}}.tar")
    # a folder and a glob are one listing each; :: mixes object storage with a local source
    three = [f"{url}/{i:05d}.tar" for i in range(3)]
    assert resolve_shards(f"{url}/0000[0-2].tar") == three
    assert resolve_shards(f"{url}/") == resolve_shards(url) == three + [f"{url}/41407.tar"]
    mixed = resolve_shards(f"{url}/{{00000..00001}}.tar::{shard_dir}/b/00002.tar")
    assert mixed == [f"{url}/00000.tar", f"{url}/00001.tar", str(shard_dir / "b" / "00002.tar")]


@pytest.mark.slow
def test_object_store_faults_are_retried_and_resumed(s3, shard_dir):
    """Connections reset mid-object past what pyarrow's client retries on its own, a stall, throttling: the shard
    is read whole, each retry resuming at the byte reached. A missing object or denied access fails at once,
    naming the shard and the cause."""
    url = s3.upload_folder(shard_dir / "a", "faults")
    expected = _keys(str(shard_dir / "a" / "00000.tar"))
    key = "faults/00000.tar"
    s3.faults.add(key, *[("reset", 40_000)] * 40)  # pyarrow gives up after ~30 attempts; rayvl's layer resumes
    retried: Counter = Counter()
    assert _keys(f"{url}/00000.tar", retried=retried) == expected
    assert s3.faults.injected[(key, "reset")] == 40 and retried["io_retries"] >= 1
    s3.faults.add(key, ("stall", 40_000, 1), *[("status", 503, "SlowDown")] * 3)  # 1 s, as test_object_store
    assert _keys(f"{url}/00000.tar") == expected and s3.faults.injected[(key, "stall")] == 1

    with pytest.raises(ShardIOError) as missing:
        _keys(f"{url}/00007.tar")
    assert missing.value.reason == "missing" and missing.value.attempts == 1
    assert "faults/00007.tar cannot be read: it does not exist" in str(missing.value)
    s3.faults.add(key, *[("status", 403, "AccessDenied")] * 5)
    with pytest.raises(ShardIOError) as denied:
        _keys(f"{url}/00000.tar")
    assert denied.value.reason == "denied" and denied.value.attempts == 1
    assert "data.unreadable_shards=skip" in str(denied.value)
    assert way_out(str(denied.value)) == ACCESS_HINT  # S3's own words: the way out is the credentials
    s3.faults.clear()
    s3.faults.add(key, *[("reset", 1000)] * 200)  # past pyarrow's and rayvl's retries: transient, then failed
    with pytest.raises(ShardIOError, match="I/O errors went on past data.io_retries"):
        _keys(f"{url}/00000.tar", ReadPolicy(retries=1, wait_s=0.05))


@pytest.mark.slow
def test_a_store_out_of_reach_is_one_line_naming_the_network():
    """`rayvl data check gs://…` on a machine that cannot reach Google (this one: no route, no credentials): one line
    and exit 2, the way out being the network — pyarrow's own GCS retries ran 15 minutes in silence; rayvl bounds
    them (RAYVL_GCS_RETRY_S). The subprocess timeout only guards the suite against a hang."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rayvl.cli", "data", "check", "gs://bucket/cc12m/{00000..00010}.tar"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "RAYVL_GCS_RETRY_S": "1"})
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("rayvl: error: gs://bucket/cc12m/{00000..00010}.tar: cannot look up "
                           "'gs://bucket/cc12m/00000.tar'") and line.endswith(REACH_HINT), line


def test_a_runs_own_gcs_filesystem_waits_out_a_blip_the_checks_do_not(monkeypatch):
    """The checks before Ray starts give up on GCS after RAYVL_GCS_RETRY_S (10 s); the filesystem Ray Train and Tune
    keep for checkpoints and state after RAYVL_GCS_RUN_RETRY_S (300 s): a checkpoint is written late, not lost."""
    from datetime import timedelta

    from rayvl import storage

    def limit(fs):
        return fs.__reduce__()[1][0]["retry_time_limit"]

    assert limit(storage.filesystem("gs://b/runs")[0]) == timedelta(seconds=10)
    assert limit(storage.filesystem("gs://b/runs", patient=True)[0]) == timedelta(seconds=300)
    monkeypatch.setenv("RAYVL_GCS_RUN_RETRY_S", "42")
    assert limit(storage.filesystem("gs://b/runs", patient=True)[0]) == timedelta(seconds=42)
