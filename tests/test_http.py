"""Shards and files behind http(s) URLs (rayvl.http_objects) — a web server, a CDN, the Hugging Face Hub — read
from a real HTTP server on 127.0.0.1 (tests/web_server.py): named, checked and read through resets and throttling
with no row lost, refused and missing objects said as such, the Hub's token sent to the Hub alone, its page URLs
read as its files, a CLIP_benchmark set on the Hub evaluated from the URL its README gives."""
from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest

from web_server import TOKEN, WebServer


@pytest.fixture
def web(demo_dir, tmp_path):
    root = tmp_path / "served"
    shutil.copytree(demo_dir / "train", root / "train")
    server = WebServer(root, gated=("laion/CLIP-gated",))
    yield server
    server.stop()


@pytest.mark.slow  # the requests' own backoff: ~4 s of waits
def test_http_shards_are_named_checked_and_read_through_resets_and_throttling(web, demo_dir, monkeypatch):
    """Brace ranges of http(s) shards are names made, their first and last looked up (HEAD; a 429 asked again); a
    folder or a glob is refused (HTTP lists nothing), a query (``?download=true``) kept. A shard read through two
    connection resets and a 503 is byte for byte the file — resumed with ``Range`` where the server answers it, by
    skipping the bytes already read where it does not —, the resets counted as retries; a 403 is not retried, a
    404 or a URL that cannot be fetched is a missing shard, and each says so naming the shard; a server out of
    reach or busy gets the network's hint, not the spec forms'."""
    from rayvl import http_objects
    from rayvl.config import ConfigError
    from rayvl.data import specs
    from rayvl.data.shard_io import ReadPolicy, ShardIOError, open_shard

    spec = f"{web.url}/files/train/{{00000..00002}}.tar"
    web.faults.add("HEAD /files/train/00001.tar", ("status", 429, "Too Many Requests"))
    checked = specs.checked("data.train", spec)
    assert checked.paths == [f"{web.url}/files/train/0000{i}.tar" for i in range(3)]
    assert "3 object names made from the spec, 3 of them checked" in checked.summary
    assert [r[0] for r in web.seen] == ["HEAD"] * 4  # looked up, not read; the 429 asked again
    with pytest.raises(ConfigError, match=r"^data.train: '.*/files/train/00009.tar' does not exist"):
        specs.checked("data.train", f"{web.url}/files/train/{{00000..00009}}.tar")
    for listing in (f"{web.url}/files/train/", f"{web.url}/files/train/*.tar"):
        with pytest.raises(ConfigError, match="an http\\(s\\) URL names one shard \\(HTTP has no listing"):
            specs.checked("data.train", listing)
    assert specs.check(f"{web.url}/files/train/00001.tar?download=true").paths == [
        f"{web.url}/files/train/00001.tar?download=true"]

    whole = (demo_dir / "train" / "00000.tar").read_bytes()
    policy = ReadPolicy(wait_s=0.01)
    for where, resumed in (("files", ["", "bytes=20000-", "bytes=70000-", "bytes=70000-"]),  # 206 from the byte
                           ("plain", ["", "bytes=20000-", "bytes=50000-", "bytes=50000-"])):  # 200: bytes skipped
        path = f"/{where}/train/00000.tar"
        web.faults.add(path, ("reset", 20_000), ("reset", 50_000), ("status", 503, "Slow Down"))
        retried = Counter()
        with open_shard(web.url + path, policy, retried) as f:
            assert f.read() == whole, where
        # the 503 is asked again at once by the request (its body not begun), the resets by the stream
        assert retried == {"io_retries": 2} and [r[2] for r in web.requests_to(path) if r[0] == "GET"] == resumed, where
    # at the end, a resumed read asks past the last byte (416): nothing more, unless the object is no longer as long
    assert http_objects.open_at(f"{web.url}/files/train/00000.tar", len(whole)).read() == b""
    with pytest.raises(OSError, match="HTTP 416 .*the object is not the one read before"):
        http_objects.open_at(f"{web.url}/files/train/00000.tar", len(whole) + 5)
    # a head of the file from a server that ignores ranges: the bytes asked for, no more
    assert http_objects.read_bytes(f"{web.url}/plain/train/00000.tar", 100) == whole[:100]
    assert http_objects.open_at(f"{web.url}/plain/train/00000.tar", 1000, 100).read() == whole[1000:1100]

    web.faults.add("/files/train/00001.tar", ("status", 403, "Forbidden"))
    with pytest.raises(ShardIOError, match=r"00001.tar cannot be read: access is denied .*HTTP 403 .*1 attempt\)"):
        open_shard(f"{web.url}/files/train/00001.tar", policy).read()
    with pytest.raises(ShardIOError, match=r"00007.tar cannot be read: it does not exist .*HTTP 404"):
        open_shard(f"{web.url}/files/train/00007.tar", policy).read()
    with pytest.raises(ShardIOError, match=r"cannot be read: it does not exist .*InvalidURL.*1 attempt\)"):
        open_shard("http://[::1/00000.tar", policy).read()
    # lookups before Ray starts: a refusal's hint names the Hub's token with the stores' credentials; a server out
    # of reach, or failing past the request's own retries, the network's
    with pytest.raises(ConfigError, match="cannot look up .*HTTP 401 .*the Hugging Face Hub: HF_TOKEN"):
        specs.checked("data.train", f"{web.url}/laion/CLIP-gated/resolve/main/00000.tar")
    with pytest.raises(ConfigError, match="Connection refused.* — the store cannot be reached from this machine"):
        specs.checked("data.train", "http://127.0.0.1:9/00000.tar")
    # a Retry-After past RETRY_AFTER_MAX_S waits that long, an unreadable one is ignored: both asked again
    monkeypatch.setattr(http_objects, "RETRY_AFTER_MAX_S", 0.2)
    web.faults.add("HEAD /files/train/00000.tar", ("status", 503, "Slow Down", {"Retry-After": "3600"}),
                   ("status", 503, "Slow Down", {"Retry-After": "soon"}))
    assert specs.check(f"{web.url}/files/train/00000.tar").paths
    web.faults.add("HEAD /files/train/00002.tar", *[("status", 502, "Bad Gateway")] * 4)
    with pytest.raises(ConfigError, match="HTTP 502 .* — the store cannot be reached from this machine, or answers"):
        specs.checked("data.train", f"{web.url}/files/train/00002.tar")


def test_the_hubs_files_are_read_with_its_token_sent_to_it_alone_and_copied_once(web, tmp_path, monkeypatch):
    """A gated repository on the Hub (HF_ENDPOINT): refused without HF_TOKEN, the refusal saying how in; with it
    (a trailing newline and all), a page URL (``blob``) reads as the file (``resolve``), the token going to the
    Hub and not to the CDN it redirects to, nor to any other host. A CLIP's weights by URL (model.init_from_clip)
    are copied once into the cache with the open_clip_config.json beside them, through a reset (resumed at the byte
    written); the same URL again asks the Hub (its redirect says size and ETag) and nothing of the CDN; a replaced
    object is copied again. A URL signed for GET (HEAD refused) is looked up with a GET of its first byte."""
    from rayvl import storage
    from rayvl.config import ConfigError
    from rayvl.models import whole_clip

    repo = tmp_path / "served" / "hub" / "laion" / "CLIP-gated"
    repo.mkdir(parents=True)
    weights = np.random.default_rng(0).bytes(300_000)
    (repo / "open_clip_pytorch_model.bin").write_bytes(weights)
    (repo / "open_clip_config.json").write_text('{"model_cfg": {"embed_dim": 64}}')
    monkeypatch.setenv("HF_ENDPOINT", web.url)
    monkeypatch.setenv("RAYVL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    url = f"{web.url}/laion/CLIP-gated/resolve/main/open_clip_pytorch_model.bin"
    with pytest.raises(ConfigError, match=r"HTTP 401 UNAUTHORIZED \(GatedRepo Access to model laion/CLIP-gated is "
                                          r"restricted.\) — a gated repository: accept its terms on its page"):
        whole_clip.local(url)
    with pytest.raises(ConfigError, match=r"HTTP 401 .*\(RepoNotFound .*\) — no repository of that name, or a "
                                          r"private one: check the name \(and datasets/"):
        whole_clip.local(f"{web.url}/laion/CLIP-typo/resolve/main/open_clip_pytorch_model.bin")

    monkeypatch.setenv("HF_TOKEN", TOKEN + "\n")  # as `cat token` leaves it
    page = f"{web.url}/laion/CLIP-gated/blob/main/open_clip_config.json"
    assert storage.read_text(page) == '{"model_cfg": {"embed_dim": 64}}'
    web.seen.clear()
    hub_path, cdn_path = "/laion/CLIP-gated/resolve/main/open_clip_pytorch_model.bin", \
        "/cdn/laion/CLIP-gated/open_clip_pytorch_model.bin"
    web.faults.add(cdn_path, ("reset", 100_000))
    copy = whole_clip.local(url)
    assert copy.read_bytes() == weights and json.loads((copy.parent / "open_clip_config.json").read_text())
    assert {r[3] for r in web.requests_to(hub_path)} == {True}  # the token, to the Hub
    assert [(r[0], r[2], r[3]) for r in web.requests_to(cdn_path)] == [  # not to its CDN; the reset resumed
        ("GET", "", False), ("GET", "bytes=100000-", False)]
    web.seen.clear()
    assert whole_clip.local(url) == copy and web.requests_to(hub_path) and not web.requests_to(cdn_path)
    (repo / "open_clip_pytorch_model.bin").write_bytes(weights[:1000])
    assert whole_clip.local(url).read_bytes() == weights[:1000]
    cdn = f"http://localhost:{web.port}{cdn_path}"  # signed for GET: HEAD refused (403)
    assert storage.size(cdn) == 1000 and [r[0] for r in web.requests_to(cdn_path)][-2:] == ["HEAD", "GET"]
    web.seen.clear()
    assert storage.read_bytes(f"http://localhost:{web.port}/files/train/00000.tar", 10)
    assert [r[3] for r in web.seen] == [False]  # HF_TOKEN set, the host not the Hub: no token
    monkeypatch.setenv("HF_TOKEN", "hf_\u201cpasted")  # a quote a header cannot carry: refused here, not sent
    with pytest.raises(PermissionError, match="HF_TOKEN holds characters an HTTP header cannot carry"):
        storage.read_text(page)


def test_ray_datas_read_tasks_read_http_shards_as_files_through_resets(ray_local, web, demo_dir):
    """The same rows — keys, decoded images, tokens — from Ray Data's read tasks whether the shards are files or
    http(s) URLs whose connections reset mid-shard; the resets counted as retries in the data report, no sample
    lost."""
    import ray

    from rayvl import assets
    from rayvl.data import shards
    from rayvl.data.pipeline import Rows
    from rayvl.data.report import create_report, release_reports
    from rayvl.data.shards import Reading

    rows = Rows(image_size=16, crop_scale_min=0.5, train=False, max_tokens=16,
                tokenizer_path=str(assets.text_model_path("minilm-l6")))
    columns = ["key", "image", "input_ids"]
    web.faults.add("/files/train/00001.tar", ("reset", 30_000), ("reset", 400_000))
    read = {}
    for name, spec in (("files", str(demo_dir / "train" / "{00000..00002}.tar")),
                       ("http", f"{web.url}/files/train/{{00000..00002}}.tar")):
        report = create_report(f"test-http-{name}")
        try:
            reading = Reading(read_cpus=0.5, batch_size=16, report_name=f"test-http-{name}")
            read[name] = ({r["key"]: r for r in shards.read_shards(spec, rows, reading, columns).take_all()},
                          ray.get(report.snapshot.remote())["counts"])
        finally:
            release_reports([f"test-http-{name}"])
    (files, file_counts), (http, http_counts) = read["files"], read["http"]
    assert len(files) == 384 and files.keys() == http.keys()
    assert all(np.array_equal(files[k]["image"], http[k]["image"]) and
               np.array_equal(files[k]["input_ids"], http[k]["input_ids"]) for k in files)
    assert http_counts.pop("io_retries") == 2 and http_counts == file_counts


@pytest.mark.slow
def test_a_clip_benchmark_set_on_the_hub_is_evaluated_from_its_tree_url(web, demo_dir, tmp_path, capsys,
                                                                       monkeypatch):
    """`rayvl eval --data https://huggingface.co/datasets/clip-benchmark/wds_…/tree/main` (the root CLIP_benchmark's
    README gives, here at HF_ENDPOINT): its nshards.txt, class names and templates from the Hub, its shards through
    the CDN — the same numbers as the same set in a folder; the training dry run reads it as data.eval."""
    from conftest import untrained_checkpoint
    from rayvl.cli import main
    from rayvl.eval.runner import set_names
    from test_eval_protocol import _clip_benchmark_set

    local = tmp_path / "wds_shapes"
    _clip_benchmark_set(demo_dir, local, train=30)
    shutil.copytree(local, tmp_path / "served" / "hub" / "datasets" / "clip-benchmark" / "wds_shapes")
    monkeypatch.setenv("HF_ENDPOINT", web.url)
    tree = f"{web.url}/datasets/clip-benchmark/wds_shapes/tree/main"
    checkpoint = untrained_checkpoint(demo_dir, tmp_path / "ckpt") / "checkpoint_000000"
    out = {}
    for name, data in (("folder", str(local)), ("hub", tree)):
        out[name] = tmp_path / name
        assert main(["eval", str(checkpoint), "--tasks", "zeroshot,linear_probe", "--data", data,
                     "--out", str(out[name])]) == 0, capsys.readouterr().err
    folder, hub = (json.loads((out[n] / "eval.json").read_text()) for n in ("folder", "hub"))
    assert hub["zeroshot"] == folder["zeroshot"] and hub["linear_probe"] == folder["linear_probe"]
    assert hub["embedding"]["images"] == 25 and folder["zeroshot"]["zeroshot_classes"] == 8
    assert np.array_equal(np.load(out["hub"] / "image_embeddings.npy"), np.load(out["folder"] / "image_embeddings.npy"))
    served = [r[1] for r in web.seen]
    assert "/datasets/clip-benchmark/wds_shapes/resolve/main/test/nshards.txt" in served
    assert {"/cdn/datasets/clip-benchmark/wds_shapes/test/0.tar", "/cdn/datasets/clip-benchmark/wds_shapes/test/1.tar",
            "/cdn/datasets/clip-benchmark/wds_shapes/train/0.tar"} <= set(served)
    assert set_names([tree, f"{tree}/test", str(local)]) == ["wds_shapes", "test", "wds_shapes-2"]  # <out>/<set>/
    capsys.readouterr()
    assert main(["train", "--dry-run", "--data", str(demo_dir / "train"), "--eval-data", tree]) == 0
    printed = capsys.readouterr().out
    assert "data.eval: 2 shards" in printed and "  zeroshot: runs" in printed
    assert f"{web.url}/datasets/clip-benchmark/wds_shapes/resolve/main/test/0.tar: s0000000: 112×112 webp" in printed
