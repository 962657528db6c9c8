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
    this process, on the session's Ray) and the plain loop (as the benchmark runs it: its own process, one loader
    worker) write the same keys in the same order, the same embeddings to float32 rounding, the same retrieval
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

    # `rayvl eval` on a Ray it started itself, with the default pool, embeds in its own process (no actor to start):
    # the same rows, the same embeddings, the same metrics as the actor above
    import numpy as np

    from rayvl.checkpoints import read_meta
    from rayvl.eval.runner import default_sources, embeds_in_process, run_eval

    assert embeds_in_process(True, 0, 0.0) and embeds_in_process(True, 1, 0.0)
    assert not any((embeds_in_process(False, 0, 0.0), embeds_in_process(True, 2, 0.0), embeds_in_process(True, 0, 1)))
    with caplog.at_level(logging.INFO, logger="rayvl"):
        local = run_eval(str(checkpoint), ["retrieval"], default_sources(read_meta(str(checkpoint))["config"], data,
                                                                          "shards"),
                         out=tmp_path / "local", in_process=True)
    assert "embedding model in this process ready" in caplog.text
    assert json.loads((tmp_path / "local" / "keys.json").read_text()) == json.loads(
        (tmp_path / "rayvl" / "keys.json").read_text())
    np.testing.assert_allclose(np.load(tmp_path / "local" / "image_embeddings.npy"),
                               np.load(tmp_path / "rayvl" / "image_embeddings.npy"), atol=1e-6)
    assert local["retrieval"] == json.loads((tmp_path / "rayvl" / "retrieval.json").read_text())
