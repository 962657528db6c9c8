"""2 real Ray Train workers under real DeepSpeed: every ZeRO stage trains; checkpoints restore everything."""
import json
import math
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_card_snippet, small_config, tonics_shapes, untrained_checkpoint
from test_gpu_check import startup_section
from rayvl.models.dual_encoder import build_model
from rayvl.train.engine import lr_lambda
from rayvl.data import specs
from rayvl.data.report import format_data_report
from rayvl.train.trainer import train


def _ds_files(ckpt: Path) -> list[str]:
    return sorted(p.name for p in (ckpt / "deepspeed").iterdir())


# ZeRO-0 (the default) trains in every other run test; ZeRO-3 trains (and resumes) in
# test_checkpoint_round_trip_and_resume
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stage_trains_two_workers(ray_local, demo_dir, tmp_path, stage, monkeypatch):
    if stage == 1:  # BoW captions ([BoW] §2.2: statistics pass + deformation inside the real pipeline), from another
        # run's weights, logged to TensorBoard, MLflow and W&B (offline, as the driver's environment says: read back
        # below), the model run through torch.compile (its "eager" backend: Dynamo's graphs without code generation)
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_SILENT", "true")
        extra = ["bow.enabled=true",
                 "bow.ops=[shuffle, rm_stop_nalpha, limit_to_base_vocab, {rm_top_freq: 3}, {keep: 3}]",
                 f"train.init_from={untrained_checkpoint(demo_dir, tmp_path, 5, 'seeded')}",
                 "train.report_to=[tensorboard, mlflow, wandb]", f"train.mlflow_uri=sqlite:///{tmp_path}/mlflow.db",
                 "train.compile=eager", "model.vision_strategy=frozen"]  # LiT's locked image tower
    else:  # UniCL against an EMA memory bank of 40 keys ([BoW] §2.1): 3 steps × 16 keys wrap around; in bf16
        # (DeepSpeed's CPU accelerator), the precision every GPU user takes, with the alignment layers recomputed
        extra = ["memory_bank.size=40", "loss.kind=unicl", "memory_bank.momentum=0.9", "train.precision=bf16",
                 "train.max_steps=4", "train.stop_at_step=3",  # stops at 3 of 4: _check_memory_bank resumes it
                 "model.activation_checkpointing=true", "eval.tasks=[retrieval]",  # both towers, in bf16
                 *upsampled_mix(demo_dir)]  # a :: mix with upsampling factors, resumed below (its position's)
    cfg = small_config(demo_dir, tmp_path, f"train.zero_stage={stage}", *extra)
    listed = Counter()  # every listing of a shard spec on the driver (specs.resolve: the one function that lists)
    resolve = specs.resolve
    monkeypatch.setattr(specs, "resolve", lambda spec: listed.update([spec]) or resolve(spec))
    result = train(cfg)
    # the run's plan lists each spec once; the checks, the BoW statistics pass and the datasets read its lists
    assert set(listed.values()) == {1} and cfg.data.train in listed, listed
    captions = result.data_report["captions"]
    if stage == 1:
        assert (result.run_dir / "bow_stats.json").is_file()
        assert captions["bow_avg_words_before"] > 8 and 3 <= captions["avg_caption_words"] < 4.5
        assert 5 < captions["bow_base_share_pct"] < 20
    else:
        assert "bow_avg_words_before" not in captions and captions["avg_caption_words"] > 8
    history = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3]
    assert all(math.isfinite(h["loss"]) for h in history)
    schedule = lr_lambda(cfg.train.warmup_steps, cfg.train.max_steps)  # warm-up then cosine, stepped per step
    assert [h["lr"] for h in history] == pytest.approx([cfg.train.lr * schedule(s) for s in (1, 2, 3)])
    assert result.metrics["samples_kept"] > 0
    assert result.data_report["eval"]["counts"]["samples_kept"] == 2 * 64  # each rank reads the held-out split
    assert "image_label" not in result.data_report  # a report (an actor) per stream the run reads, no more
    every_task = ("zeroshot_top1", "paraphrase_AO@10", "paraphrase_JS@10", "sts_spearman") if stage == 1 else ()
    assert all(key in result.metrics for key in ("t2i_R@10", *every_task))
    assert 0 < result.metrics["evaluation_s"] < history[-1]["elapsed_s"]  # how long the final evaluation paused it
    files = _ds_files(Path(result.checkpoint_dir))
    # every rank's optimizer partition is in the one checkpoint (Ray merged both ranks' files)
    bf16 = "bf16_" if stage == 2 else ""  # DeepSpeed's name for the partitions of fp32 master weights under bf16
    assert {f"{bf16}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= set(files)
    state = torch.load(Path(result.checkpoint_dir) / "model.pt")
    assert "text.alignment.0.attention.self.query.weight" in state and state["logit_scale"].shape == (1,)
    assert json.loads((result.run_dir / "eval.json").read_text())["eval_images"] == 64
    assert all(h["grad_norm"] > 0 for h in history)  # DeepSpeed's global norm (ZeRO-0 fp32's own: test_seeds)
    if stage == 1:
        _check_same_numbers_as_rayvl_eval(result, tmp_path)
        _check_tensorboard_mlflow_and_plots(result, history, tmp_path)
        _check_export_round_trip(result, tmp_path)
        # 3 small steps from the seeded weights stay near them, far from the run's own seed-0 init
        seeded = torch.load(tmp_path / "seeded" / "checkpoint_000000" / "model.pt")
        own = build_model(cfg.model, seed=cfg.train.seed).state_dict()
        key = "vision_proj.weight"
        assert (state[key] - seeded[key]).norm() < (own[key] - seeded[key]).norm() / 5
        # the locked image tower: every backbone weight and BatchNorm statistic as the run started, bit for bit,
        # while its projection trained
        backbone = [k for k in seeded if k.startswith("vision.backbone.")]
        assert len(backbone) > 100 and all(torch.equal(state[k], seeded[k]) for k in backbone)
        assert not torch.equal(state[key], seeded[key])
    if stage == 2:  # the mix's pass: shard 0 three times, one of the other two — 3 × 128 + 128 rows
        assert result.data_report["img2dataset_successes_per_pass"] == 512
        _check_bf16_weights_and_embeddings(result, state)
        _check_memory_bank(cfg, result, state, demo_dir, tmp_path)


def _check_tensorboard_mlflow_and_plots(result, history, tmp_path):
    """The run's loggers, read back with their own libraries, hold what metrics.jsonl holds; the run directory
    has its plots and its record (config + git commit)."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(result.run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [h["step"] for h in history]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([h["loss"] for h in history])
    assert events.Scalars("eval/zeroshot_top1")[-1].value == pytest.approx(result.metrics["zeroshot_top1"])
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("laion_adapt").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["train.zero_stage"] == "1" and run.data.params["model.embed_dim"] == "64"
    assert [m.value for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"),
                                    key=lambda m: m.step)] == pytest.approx([h["loss"] for h in history])
    assert client.get_metric_history(run.info.run_id, "eval/t2i_R_at_1")[-1].value == pytest.approx(
        result.metrics["t2i_R@1"])
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"run.png", "eval.json", "run.json"}
    (offline,) = (result.run_dir / "wandb").glob("offline-run-*/run-*.wandb")  # W&B's own file, offline mode
    logged = {r.history.step.num: {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
              for r in _wandb_records(offline) if r.WhichOneof("record_type") == "history"}
    assert sorted(logged) == [h["step"] for h in history]
    assert [logged[h["step"]]["train/loss"] for h in history] == pytest.approx([h["loss"] for h in history])
    assert logged[3]["eval/t2i_R@1"] == pytest.approx(result.metrics["t2i_R@1"])
    record = json.loads((result.run_dir / "run.json").read_text())
    assert record["config"]["train"]["zero_stage"] == 1 and len(record["invocations"]) == 1
    # how the run ended, readable: its status, end, duration and final metrics, rounded to what float32 holds
    assert record["status"] == record["invocations"][0]["status"] == "finished"
    assert record["ended"] and 0 < record["duration_s"] == record["invocations"][0]["duration_s"]
    assert record["final_metrics"]["step"] == 3
    assert record["final_metrics"]["t2i_R@1"] == float(f"{result.metrics['t2i_R@1']:.7g}")
    evaluated = json.loads((result.run_dir / "eval.json").read_text())
    assert evaluated["step"] == 3 and evaluated["checkpoint"] == result.checkpoint_dir
    # every line says when; TensorBoard has the config as hyperparameters and no evaluation constants
    assert all(h["time"] > 1.7e9 and h["elapsed_s"] >= 0 for h in history)
    assert [h["elapsed_s"] for h in history] == sorted(h["elapsed_s"] for h in history)
    tags = events.Tags()["scalars"]
    assert not [t for t in tags if "_chance_" in t or t.endswith(("_images", "_captions"))], tags
    from tensorboard.plugins.hparams import plugin_data_pb2

    (plugin,) = [v for e in _events(result.run_dir / "tensorboard") for v in e.summary.value
                 if v.metadata.plugin_data.plugin_name == "hparams" and v.tag == "_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(plugin.metadata.plugin_data.content).session_start_info
    assert hparams.hparams["train.zero_stage"].number_value == 1
    assert hparams.hparams["model.text"].string_value == "minilm-l6"
    assert record["git_commit"] == run.data.tags["mlflow.source.git.commit"] and len(record["git_commit"]) >= 40
    assert [p.name for p in (result.run_dir / "plots").iterdir()] == ["run.png"]  # one dashboard


def _wandb_records(path):
    """The records of a W&B run file: W&B's header, then LevelDB's log format (32 KiB blocks of records, each a
    7-byte header — CRC, length, type: 1 whole, 2 first, 3 middle, 4 last piece — and its bytes), each record one
    of W&B's own protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2

    data, block = Path(path).read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    pos, records, pieces = 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:  # a block's zero-filled tail
            pos += left
            continue
        pieces, pos = pieces + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pieces))
            pieces = b""
    return records


def _events(folder):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [e for f in sorted(folder.glob("*tfevents*")) for e in EventFileLoader(str(f)).Load()]


def _check_export_round_trip(result, tmp_path):
    """`rayvl export` → `rayvl.load` embeds as the checkpoint's model does (rayvl's evaluation path); an
    intermediate checkpoint (DeepSpeed files, no model.pt) loads too, without Ray or DeepSpeed running."""
    import rayvl
    from rayvl import assets
    from rayvl.checkpoints import load_model
    from rayvl.cli import main
    from rayvl.eval.embed import ModelEmbedder

    assert main(["export", str(result.run_dir), "--out", str(tmp_path / "export")]) == 0
    assert {"model.safetensors", "rayvl_model.json", "README.md", "text"} <= {
        p.name for p in (tmp_path / "export").iterdir()}
    exported = rayvl.load(tmp_path / "export")
    reference = ModelEmbedder(load_model(result.checkpoint_dir)[0], str(assets.text_model_path("minilm-l6")), 16)
    captions = ["a large blue ring to the left of a small red star", "two green squares"]
    np.testing.assert_allclose(exported.encode_text(captions).numpy(), reference.texts(captions), atol=1e-6)
    images = np.random.default_rng(0).integers(0, 256, (3, 3, 32, 32), dtype=np.uint8)
    np.testing.assert_allclose(exported.encode_image(images).numpy(), reference.images(images), atol=1e-6)
    from PIL import Image

    photo = Image.fromarray(images[0].transpose(1, 2, 0)).resize((48, 40))
    assert exported.preprocess(photo).shape == (3, 32, 32) and exported.encode_image([photo]).shape == (1, 64)
    assert "| zeroshot_top1 |" in (tmp_path / "export" / "README.md").read_text()
    _check_export_without_rayvl(tmp_path / "export", exported, captions, images)
    (intermediate,) = [c for c in result.run_dir.glob("checkpoint_*")
                       if c.is_dir() and not (c / "model.pt").exists()]
    loaded = rayvl.load(intermediate)
    assert loaded.encode_text(captions).shape == (2, 64)
    # ZeRO-1's zero_to_fp32 rebuilds the optimizer's parameters only: the frozen LM comes from rank 0's module state
    rebuilt, final = loaded.module.state_dict(), torch.load(Path(result.checkpoint_dir) / "model.pt")
    assert rebuilt.keys() == final.keys()
    assert all(torch.equal(rebuilt[k], v) for k, v in final.items() if k.startswith("text.lm."))  # never trained


def _check_export_without_rayvl(export, exported, captions, images):
    """The export other tools load: the model card's "without rayvl" code — transformers' AutoModel for the
    language model, timm for the image tower, torch for the heads — embeds as rayvl.load does; every file is
    readable by others (0644); the card has Hugging Face metadata; rayvl.load imports neither Ray nor DeepSpeed and
    the README's lines warn of nothing."""
    import re
    import subprocess
    import sys

    assert {f.stat().st_mode & 0o777 for f in export.rglob("*") if f.is_file()} == {0o644}
    card = (export / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: rayvl\npipeline_tag: zero-shot-image-classification\n")
    (snippet,) = re.findall(r"## Use without rayvl\n\n```python\n(.*?)```", card, re.S)
    assert len(snippet.splitlines()) <= 10  # the card's lines; the code is the export's own without_rayvl.py
    # the card as a user runs it, on two photos (timm importable here through rayvl.compat: this VM's CUDA
    # torchvision over CPU torch); its preprocess is rayvl's crop exactly, so the embeddings are rayvl.load's
    namespace = run_card_snippet(snippet, export)
    assert "rayvl" not in (export / "without_rayvl.py").read_text().split('"""')[2]  # no rayvl import in its code
    model = namespace["model"]
    np.testing.assert_allclose(model.encode_text(captions).numpy(), exported.encode_text(captions).numpy(), atol=1e-5)
    photos = [str(export / "cat.jpg"), str(export / "dog.jpg")]
    assert torch.equal(namespace["pixels"], torch.stack([exported.preprocess(p) for p in photos]))
    np.testing.assert_allclose(namespace["images"].numpy(), exported.encode_image(photos).numpy(), atol=1e-5)
    np.testing.assert_allclose(model.encode_image(torch.from_numpy(images)).numpy(),
                               exported.encode_image(images).numpy(), atol=1e-5)
    assert model.logit_scale() == pytest.approx(exported.logit_scale())
    readme = f"""
import sys, warnings
import rayvl
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = rayvl.load({str(export)!r})
    images = model.encode_image(torch.zeros(2, 3, 32, 32, dtype=torch.uint8))
    texts = model.encode_text(["a photo of a cat", "a photo of a dog"])
    similarity = model.logit_scale() * images @ texts.T
print(sorted({{"ray", "deepspeed"}} & set(sys.modules)), [str(w.message) for w in caught])
"""
    out = subprocess.run([sys.executable, "-c", "import torch" + readme], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[] []", out.stdout + out.stderr[-2000:]


def _check_bf16_weights_and_embeddings(result, state):
    """A bf16 run's consolidated weights are the optimizer's fp32 masters (not bf16-rounded), and the exported
    model embeds in fp32."""
    from rayvl.checkpoints import load_model

    assert {v.dtype for v in state.values()} <= {torch.float32, torch.int64}
    trained = state["vision_proj.weight"]
    assert not torch.equal(trained, trained.bfloat16().float())
    model, _ = load_model(result.checkpoint_dir)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    assert model.encode_image(images).dtype == torch.float32


def _check_same_numbers_as_rayvl_eval(result, tmp_path):
    """The final in-training evaluation and `rayvl eval` on the final checkpoint (same weights) run the same task
    code and differ only in how embeddings are computed (the training ranks' slices vs Ray Data actors)."""
    from rayvl.eval.runner import after_training

    tasks = ("zeroshot", "retrieval", "paraphrase", "sts")
    # as a comparison's trial evaluates its run when it ends (rayvl.sweeps.comparison): `rayvl eval` on the run's own
    # held-out data and files
    evaluated = after_training(result, tasks=tasks, prefix="")
    pairs = {k: (v, result.metrics[k]) for k, v in evaluated.items()}
    assert len(pairs) > 20 and {"qe_paraphrase_AO@10", "single_template_zeroshot_top1"} <= set(pairs)
    assert {k: v[1] for k, v in pairs.items()} == pytest.approx({k: v[0] for k, v in pairs.items()}, abs=1e-6)


def upsampled_mix(demo_dir) -> list[str]:
    """The demo's first shard 3 times a pass, one of the other two a pass (rayvl.data.mix)."""
    train = demo_dir / "train"
    return [f"data.train={train}/00000.tar::{train}/00001.tar,{train}/00002.tar", "data.upsampling_factors=3::0.5"]


def _check_memory_bank(cfg, result, state, demo_dir, tmp_path):
    """The bank is in the checkpoint (EMA weights + queue with labels) and a resumed run continues its queue."""
    from rayvl.models.dual_encoder import build_model
    from rayvl.checkpoints import read_train_state
    from rayvl.methods.bow.memory_bank import MemoryBank

    saved = read_train_state(result.checkpoint_dir)["memory_bank"]
    assert (saved["ptr"], saved["filled"]) == (48 % 40, 40)
    assert len(set(saved["labels"].tolist())) == 40 and (saved["labels"] < 0).all()  # unique pair labels
    # keys are L2-normalised EMA features; at this test's 32 px, after 3 steps of lr 1e-3 on batches of 8, the
    # EfficientNet's ReLU6 head outputs all zeros for ~10% of images (the trained model does too), so 0 is allowed
    norms = saved["texts"].norm(dim=1).tolist() + saved["images"].norm(dim=1).tolist()
    assert all(abs(n - 1) < 1e-5 or n == 0 for n in norms) and sum(n > 0.5 for n in norms) >= 60
    bank = MemoryBank(build_model(cfg.model), 40, cfg.model.embed_dim, 0.9)
    bank.load_state_dict(saved)
    ema = bank.ema.state_dict()
    moved = [k for k in state if k.startswith("vision_proj") and not torch.equal(ema[k], state[k])]
    assert moved  # EMA lags the trained weights (momentum 0.9)
    from rayvl.config import ConfigError

    same = ["train.zero_stage=2", "memory_bank.size=40", "loss.kind=unicl", "memory_bank.momentum=0.9",
            "train.precision=bf16", "train.resume=true", *upsampled_mix(demo_dir)]
    assert json.loads((Path(result.checkpoint_dir) / "rayvl.json").read_text())["final"] is False  # stopped at 3
    for changed in ("train.max_steps=5", "train.warmup_steps=2", "train.lr=0.01",  # refused before Ray starts
                    "data.upsampling_factors=1::1"):
        with pytest.raises(ConfigError, match=rf"^{changed.split('=')[0]}: .* the value the run started with"):
            train(small_config(demo_dir, tmp_path, *same, "train.max_steps=4", changed))
    # no evaluation: only the bank's queue is checked
    resumed = train(small_config(demo_dir, tmp_path, *same, "train.max_steps=4", "eval.tasks=[]"))
    from rayvl.eval.tables import NO_EVALUATION

    assert json.loads((resumed.run_dir / "eval.json").read_text())["evaluation"] == NO_EVALUATION
    after = read_train_state(resumed.checkpoint_dir)["memory_bank"]
    assert (after["ptr"], after["filled"]) == (64 % 40, 40)  # restored queue + one step (a fresh one: 16, 16)
    assert torch.equal(after["labels"][24:40], saved["labels"][24:40])  # entries not yet overwritten survive


def _check_restore(config):
    """Inside Ray Train: rebuild the engine, restore Ray's latest checkpoint, compare with the saved weights."""
    import ray.train

    from rayvl.config import from_dict
    from rayvl.models.dual_encoder import build_model
    from rayvl.checkpoints import MODEL_FILE
    from rayvl.train import resume as checkpoint
    from rayvl.train.engine import build_engine
    from rayvl.train.state import Progress, TrainState

    cfg = from_dict(config["rayvl"])
    world = ray.train.get_context().get_world_size()
    engine = build_engine(build_model(cfg.model, seed=123), cfg, world)  # different init on purpose
    state = TrainState(Progress())  # the progress alone: the checkpoint's curriculum is left unread
    checkpoint.restore(engine, state)
    step, history = state.progress.step, state.progress.history
    restored = checkpoint.consolidated_state_dict(engine)
    if ray.train.get_context().get_world_rank() == 0:
        with ray.train.get_checkpoint().as_directory() as d:
            saved = torch.load(Path(d) / MODEL_FILE)
        same = all(torch.equal(restored[k], saved[k]) for k in saved) and restored.keys() == saved.keys()
        Path(config["out"]).write_text(json.dumps({
            "step": step, "history_steps": [h["step"] for h in history], "identical": same,
            "scheduler_steps": engine.lr_scheduler.last_epoch,
        }))


def test_checkpoint_round_trip_and_resume(ray_local, demo_dir, tmp_path, tonics_counts_path):
    """ZeRO-3 with TOnICS: (1) a worker killed while the step-2 checkpoint is written — the run resumes from step 1,
    trains step 2 again and goes on to its end, its curriculum, sampler counts and data position continued across the
    restart (no TOnICS row trained twice); (2) the final checkpoint restores the engine bit for bit; (3) its ZeRO-3
    shards alone rebuild the weights. A new driver resuming a run (train.resume) is checked in test_object_store
    (row-exact, from S3) and on the memory bank (test_zero_stage_trains_two_workers)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from conftest import fit_in_task
    from rayvl.checkpoints import RAY_TRAIN_SNAPSHOT, latest_checkpoint_dir, load_model, read_train_state

    # with TOnICS refreshing at every step (threshold 0): P_S(root) = 0.8^step only if the curriculum resumes too
    # (each refresh scores the first 8 held-out instances: the threshold of 0 takes any score, and every forward
    # under ZeRO-3 gathers the partitioned weights)
    tonics = tonics_shapes("tonics.refresh_every=1", "tonics.threshold=0", "tonics.alpha=0.8", "tonics.buffer_rows=64",
                           "tonics.refresh_instances=8",
                           f"tonics.counts_path={tonics_counts_path}")  # counted once for the session (test_tonics)
    # a checkpoint every step; every task is evaluated at the end: ZeRO-3's forwards gather the partitioned weights
    # ... and SigLIP's loss (its pairs' positives are the rows of one pair: TOnICS makes a row per object)
    cfg = small_config(demo_dir, tmp_path, "train.zero_stage=3", "train.max_steps=3", "train.checkpoint_every=1",
                       "loss.kind=siglip", *tonics)
    # rank 1 is killed (SIGKILL) after writing its DeepSpeed files of step 2, before reporting them; each start's
    # rank 0 profiles its start until its first step (rayvl check gpu --profile-startup)
    first = ray_local.get(fit_in_task(cfg.to_dict(), {"RAYVL_FAIL_AT": "checkpoint_write:2:1",
                                                      "RAYVL_PROFILE_STARTUP": str(tmp_path / "startup")}))
    # rayvl's own functions first: the restarted group's rank 0 (restored_state: a checkpoint read), written over
    # the first start's
    rayvl_own = startup_section((tmp_path / "startup" / "startup-rank0.txt").read_text())
    assert all(f"({name})" in rayvl_own for name in ("build_model", "build_engine", "restored_state")), rayvl_own
    assert "site-packages" not in rayvl_own
    assert json.loads((Path(first.checkpoint_dir) / "rayvl.json").read_text())["step"] == 3
    state = read_train_state(first.checkpoint_dir)
    assert state["progress"]["resumed_at"] == [1]  # the step-1 checkpoint was the one restored
    committed = json.loads((first.run_dir / RAY_TRAIN_SNAPSHOT).read_text())["checkpoint_results"]
    assert len(committed) == 2 and latest_checkpoint_dir(first.run_dir) == first.checkpoint_dir
    history = [json.loads(x) for x in (first.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3]  # step 2 once in the record, nothing repeated
    assert history[1]["resumed_from"] == 1 and history[1]["first_step"] == 2  # the restart record
    files = set(_ds_files(Path(first.checkpoint_dir)))  # ZeRO-3: both ranks' parameter and optimizer partitions
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_model_states.pt"} <= files
    assert [h["tonics_p_root"] for h in history] == pytest.approx([0.8, 0.64, 0.512])
    assert [h["tonics_refreshes"] for h in history] == [1, 2, 3]
    assert [h["tonics_last_refresh_step"] for h in history] == [1, 2, 3]  # the curve a threshold is read from
    # the samplers' counts are a train-state component: 3 steps × 2 ranks, each step's node drawn once — step 2's
    # first draw was lost with its group (restored from step 1), not counted twice
    assert [h["tonics_node_root_batches"] + h["tonics_node_object_batches"] for h in history] == [2, 4, 6]
    # the data position: 3 steps × 2 ranks × 8 rows, every (sample, noun) row of pass 0 trained on once, the rows
    # of the checkpoints restored never read again
    position = state["data_position"]
    assert position["rows_per_pass"] == {0: 48} and position["duplicates"] == 0
    assert history[-1]["data_rows_trained"] == 48 and history[-1]["data_duplicate_rows"] == 0
    assert Path(tonics_counts_path).is_file()
    assert "TOnICS:" in format_data_report(first.data_report)
    assert all(k in first.metrics for k in ("zeroshot_top1", "t2i_R@10", "paraphrase_AO@10", "sts_spearman"))
    # SigLIP's bias and temperature start at the paper's −10 and 10 and are learned (reported every window)
    assert [h["logit_bias"] != -10.0 for h in history] == [True] * 3 and history[0]["logit_scale"] != 10.0
    assert all(math.isfinite(h["loss"]) for h in history)

    out = tmp_path / "restore.json"
    TorchTrainer(_check_restore, train_loop_config={"rayvl": cfg.to_dict(), "out": str(out)},
                 scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                 run_config=RunConfig(name="run", storage_path=str(tmp_path))).fit()
    restored = json.loads(out.read_text())
    assert restored == {"step": 3, "history_steps": [1, 2, 3], "identical": True, "scheduler_steps": 3}
    with pytest.raises(Exception, match="already has checkpoints"):  # a run of the same name is not started over
        train(small_config(demo_dir, tmp_path, "train.zero_stage=3", "train.max_steps=3", *tonics))

    # the final checkpoint without its consolidated model.pt (as an intermediate one is): `rayvl eval` rebuilds the
    # weights from the ZeRO-3 shards (DeepSpeed's zero_to_fp32), frozen LM and buffers included
    shards_only = tmp_path / "shards_only"
    shutil.copytree(first.checkpoint_dir, shards_only)
    (shards_only / "model.pt").unlink()
    model, _ = load_model(shards_only)
    saved = torch.load(Path(first.checkpoint_dir) / "model.pt")
    rebuilt = model.state_dict()
    assert rebuilt.keys() == saved.keys() and all(torch.equal(rebuilt[k], saved[k]) for k in saved)


class _Payload:
    """What a tampered checkpoint file could carry: unpickling it runs code (here: touches a marker file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_fit_polls_its_reports_sooner_than_rays_default_unless_the_environment_says(monkeypatch):
    """Around fit(), rayvl's poll interval is in the environment Ray Train passes to the run's controller and workers
    (a report waits for the poll after its previous one); a user's own setting is kept; nothing stays set after."""
    from ray.train.v2._internal.constants import get_env_vars_to_propagate

    from rayvl.session import REPORT_POLL, report_polls

    key, value = REPORT_POLL
    monkeypatch.delenv(key, raising=False)
    with report_polls():
        assert get_env_vars_to_propagate()[key] == value
    assert key not in os.environ
    monkeypatch.setenv(key, "2")
    with report_polls():
        assert get_env_vars_to_propagate()[key] == "2"
    assert os.environ[key] == "2"


def test_tampered_checkpoint_files_are_refused_not_run(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from rayvl.checkpoints import STATE_FILE, UnsafeCheckpointError, read_train_state, weights_only_loads

    marker = tmp_path / "code-ran"
    torch.save({"progress": {"step": 1, "history": [], "extra": _Payload(str(marker))}}, tmp_path / STATE_FILE)
    with pytest.raises(UnsafeCheckpointError, match=f"{tmp_path}: refused"):
        read_train_state(tmp_path)
    # DeepSpeed's own loads ask for weights_only=False: inside the guard they are weights-only all the same
    optim = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0),
                                         "payload": _Payload(str(marker))}}, optim)
    with pytest.raises(UnsafeCheckpointError, match="weights_only"), weights_only_loads(tmp_path):
        torch.load(optim, weights_only=False)
    assert not marker.exists()
    torch.save({"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0)}, optim)  # DeepSpeed's records
    with weights_only_loads(tmp_path):
        assert torch.load(optim, weights_only=False)["zero_stage"] == ZeroStageEnum.gradients
    torch.load(tmp_path / STATE_FILE, weights_only=False)  # the same file without the guard runs its payload
    assert marker.exists()
