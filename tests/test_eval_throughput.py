"""benchmarks/eval_throughput.py compares two evaluations of one thing: its plain loop (a torch DataLoader over the
shards, rayvl's per-sample code, the model of the checkpoint) embeds the same rows in the same order as `rayvl eval`
and scores the same retrieval metrics; the benchmark reads its phases from rayvl's own log lines."""
import importlib.util
import json
import logging
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO


def benchmark_module():
    spec = importlib.util.spec_from_file_location("eval_throughput", REPO / "benchmarks" / "eval_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plain_loop_scores_as_rayvl_eval(ray_local, demo_dir, tmp_path, caplog):
    """On the demo's 64 held-out images and the benchmark's tiny checkpoint: `rayvl eval --tasks retrieval` (in
    this process, on the session's Ray: its actor pool), the same command in a process of its own (no Ray: one model
    in that process) and the plain loop (as the benchmark runs it: its own process, one loader worker) write the
    same keys in the same order, the same embeddings to float32 rounding, the same retrieval
    metrics. The metrics may differ by one query's worth (100/64 points) and no more: only where rows differ by
    rounding and a query's candidates tie can a rank move, and the demo's held-out captions repeat (63 distinct of
    64; rayvl embeds each text once, the plain loop each row). A wrong row order, crop or tokenization moves the
    embeddings far past 1e-5."""
    from rayvl.cli import main

    bench = benchmark_module()
    checkpoint = bench.tiny_checkpoint(tmp_path)
    data = str(demo_dir / "eval")
    with ThreadPoolExecutor(1) as pool:  # the plain loop's process runs meanwhile: no timing is checked here
        plain_run = pool.submit(bench.timed, bench.plain_command(checkpoint, data, tmp_path / "plain", workers=1),
                                bench.child_env())
        with caplog.at_level(logging.INFO, logger="rayvl"):
            assert main(bench.rayvl_args(checkpoint, data, tmp_path / "rayvl")) == 0
        run = plain_run.result()
    assert run["returncode"] == 0, bench.failed("the plain loop", run)

    one_query = 100 / 64
    agreed = bench.agreement(tmp_path / "rayvl", tmp_path / "plain", metric_tolerance=one_query)
    assert agreed["same_keys"] and len(json.loads((tmp_path / "plain" / "keys.json").read_text())) == 64
    assert agreed["embedding_max_diff"] <= bench.EMBEDDING_TOLERANCE
    assert agreed["plain"] == pytest.approx(agreed["rayvl"], abs=one_query) and agreed["agree"]
    assert agreed["plain"]["retrieval_images"] == 64

    # the phases both sides are timed by: each side's lines are there to be read
    plain = bench.phases(run, 64, bench.PLAIN_READING, [bench.PLAIN_EMBEDDED])
    assert 0 < plain["startup_s"] < plain["startup_s"] + plain["pipeline_s"] < plain["wall_s"]
    logged = [(float(i), r.getMessage()) for i, r in enumerate(caplog.records) if r.name == "rayvl"]
    rayvl = bench.rayvl_phases({"wall_s": len(logged) + 1.0, "lines": logged}, 64)
    assert rayvl["pipeline_s"] is not None and rayvl["images_s"] >= 0 and rayvl["texts_s"] >= 0
    assert "rayvl eval" in bench.table(64, rayvl, plain, agreed)

    # `rayvl eval` on a machine of its own (no cluster named, one model): no Ray, the model in its own process fed
    # by a local loader — the same rows, the same embeddings, the same metrics as the actor above
    import numpy as np

    from rayvl.session import runs_without_ray

    assert not runs_without_ray(0, 0.0)  # this process runs the session's Ray
    local = bench.timed(bench.rayvl_command(checkpoint, data, tmp_path / "local"), bench.child_env())
    assert local["returncode"] == 0, bench.failed("rayvl eval without Ray", local)
    said = "\n".join(line for _, line in local["lines"])
    assert "one model in this process on cpu (128 images a forward), " in said
    assert "loader worker(s) reading; no Ray" in said
    assert "embedding model in this process ready" in said and "Ray" not in said.replace("no Ray", "")
    assert json.loads((tmp_path / "local" / "keys.json").read_text()) == json.loads(
        (tmp_path / "rayvl" / "keys.json").read_text())
    for name in ("image_embeddings.npy", "caption_embeddings.npy"):
        np.testing.assert_allclose(np.load(tmp_path / "local" / name), np.load(tmp_path / "rayvl" / name), atol=1e-6)
    written = [json.loads((tmp_path / side / "eval.json").read_text()) for side in ("local", "rayvl")]
    assert written[0]["retrieval"] == written[1]["retrieval"] and written[0]["data"] == written[1]["data"]
    assert written[0]["data"]["samples_kept"] == 64


# a Ray of its own with an object store smaller than the held-out set (decoded), `rayvl eval`'s actor pool on it:
# argv = checkpoint, shards, out; prints eval.json's counts and the store's spilled bytes as JSON
SMALL_STORE = r"""
import json, sys
import ray
ray.init(num_cpus=2, object_store_memory=80 << 20, include_dashboard=False)
from ray._private.internal_api import get_memory_info_reply, get_state_from_address
from rayvl.eval.runner import Sources, run_eval
out = run_eval(sys.argv[1], ["retrieval"], Sources(sys.argv[2], "shards"), out=sys.argv[3], actors=1,
               cpus_per_actor=0.5, batch_size=16)
stats = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address)).store_stats
print(json.dumps({"images": out["embedding"]["images"], "retrieval_images": out["retrieval"]["retrieval_images"],
                  "kept": out["data"]["samples_kept"], "spilled_bytes": stats.spilled_bytes_total}))
"""


@pytest.mark.ray
def test_a_held_out_set_larger_than_the_object_store_streams_through_it(demo_dir, tmp_path):
    """700 held-out images at 224 px are ~105 MB decoded; a Ray of 80 MiB of object store evaluates them all with
    nothing spilled: the driver holds a bounded share of the blocks in flight and Ray Data, told so, holds its
    reading (rayvl.eval.embed.BlockStream). Before, Ray Data read the whole set while the one actor started (it
    then spilled 68 MB of it; ``iter_internal_ref_bundles`` names no consumer, so Ray Data's liveness
    rule reads on past its budget)."""
    import subprocess
    import sys

    from rayvl.checks.gpu import copied_shards

    bench = benchmark_module()
    checkpoint = bench.tiny_checkpoint(tmp_path, image_size=224)
    shards = copied_shards(sorted(str(p) for p in (demo_dir / "eval").glob("*.tar")), 700, tmp_path / "shards",
                           shard_size=350)
    run = subprocess.run([sys.executable, "-c", SMALL_STORE, str(checkpoint), shards, str(tmp_path / "out")],
                         env=bench.child_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    said = json.loads(run.stdout.strip().splitlines()[-1])
    assert said["images"] == said["retrieval_images"] == said["kept"] == 700
    assert len(set(json.loads((tmp_path / "out" / "keys.json").read_text()))) == 700
    assert said["spilled_bytes"] == 0
