"""What a user sees and keeps, without a training run: progress lines, plots, the run log's scalars, `--resume`
without a name, the recipes in a non-editable install, and bad input as one line + exit 2 before Ray starts.
(The training-run side — metrics.jsonl growing, TensorBoard and MLflow read back, export round trip, init-from —
rides on the runs of test_training.py and test_autoscaling.py.)"""
import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, small_config
from rayvl.config import ConfigError
from rayvl.train.progress import ProgressPrinter, duration, progress_line
from rayvl.train.run_log import mlflow_name, scalars

ROW = {"step": 150, "first_step": 101, "loss": 2.31412, "lr": 6.2e-4, "logit_scale": 15.31, "samples_per_s": 38.2,
       "data_wait_share": 0.0031, "grad_norm": 1.8234, "samples_seen": 4800, "samples_kept": 4797, "time": 1252.0}


def test_progress_line_format():
    line = progress_line(ROW, total=200, started=1000.0, rate=1.68, workers=2)
    assert line == ("step 150/200 (75%) | 4m12s, ETA 1m24s | loss 2.3141 | lr 6.20e-04 | scale 15.3 | "
                    "38.2 samples/s (19.1/worker) | data wait 0.3% | grad norm 1.82 | dropped 3")
    evaluated = progress_line({**ROW, "zeroshot_top1": 45.25, "t2i_R@1": 12.0, "zeroshot_chance_top1": 12.5},
                              total=200, started=1000.0, rate=None, workers=2)
    assert evaluated.startswith("step 150/200 (75%) | 4m12s | loss")  # no ETA before a rate is known
    assert evaluated.endswith("| dropped 3 | eval zeroshot_top1 45.2, t2i_R@1 12.0")
    assert duration(3725) == "1h02m05s" and duration(59.6) == "1m00s"
    assert progress_line({**ROW, "tonics_p_root": 0.64}, 200, 1000.0, None, 2).endswith("| P_S(root) 0.640")
    assert "| scale 15.3, bias -9.87 |" in progress_line({**ROW, "logit_bias": -9.871}, 200, 1000.0, None, 2)


STARTUP = {"startup_ray_s": 2.0, "startup_data_s": 0.5, "startup_fit_s": 0.5, "startup_workers_s": 9.0,
           "startup_setup_s": 1.0, "startup_model_s": 3.0, "startup_engine_s": 2.0, "startup_restore_s": 1.0,
           "startup_first_step_s": 11.0, "startup_first_batch_wait_s": 4.0, "startup_total_s": 30.0}
RESTART = {"startup_setup_s": 1.0, "startup_model_s": 2.0, "startup_engine_s": 1.0, "startup_restore_s": 1.0,
           "startup_first_step_s": 1.0, "startup_first_batch_wait_s": 0.0, "startup_total_s": 6.0}


def test_progress_follows_a_growing_metrics_file_and_restarts(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({**ROW, "step": 1}) + "\n")  # a resumed run's earlier rows are not shown again
    printer = ProgressPrinter(path, total=10, workers=2, poll_s=0.05)
    printer.start()
    t = time.time()
    with caplog.at_level(logging.INFO, logger="rayvl"):
        with open(path, "a") as f:
            for step, when in ((4, t + 10), (5, t + 12), (6, t + 14)):
                f.write(json.dumps({**ROW, "step": step, "time": when, **(STARTUP if step == 4 else {})}) + "\n")
            resumed = json.dumps({**ROW, "step": 5, "time": t + 30, "resumed_from": 4, **RESTART})
            f.write(resumed[:20])  # half-written
            f.flush()
            time.sleep(0.3)
            f.write(resumed[20:] + "\n")
        printer.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "rayvl"]
    assert [x.split(" |")[0] for x in lines] == [
        "first step after 30.0 s: ray 2.0, data 0.5, fit 0.5, workers 9.0, setup 1.0, model 3.0, engine 2.0, restore "
        "1.0, first step 11.0 (of which waiting for the first batch 4.0)", "step 4/10 (40%)", "step 5/10 (50%)",
        "step 6/10 (60%)", "resumed from the checkpoint of step 4",
        "first step after 6.0 s: setup 1.0, model 2.0, engine 1.0, restore 1.0, first step 1.0 (of which waiting for "
        "the first batch 0.0)", "step 5/10 (50%)"]
    assert "ETA 0m08s" in lines[3]  # 2 s a step since step 4, 4 steps left
    assert "ETA" not in lines[1] and "ETA" not in lines[6]  # the first report, and the first after a restart


def test_run_log_scalars_group_metrics_and_fit_mlflow_names():
    out = scalars({**ROW, "t2i_R@1": 3.0, "samples_kept": 10, "resumed_from": 4, "grad_norm": None,
                   "bad": float("nan"), "data_rows_trained": 48, "t2i_chance_R@1": 1.5, "retrieval_images": 64,
                   "elapsed_s": 3.0, "checkpoint": True})
    assert out["train/loss"] == 2.31412 and out["eval/t2i_R@1"] == 3.0 and out["data/samples_kept"] == 10
    assert out["data/rows_trained"] == 48
    assert not {"train/step", "train/time", "train/resumed_from", "train/grad_norm", "train/bad", "train/elapsed_s",
                "train/checkpoint", "eval/t2i_chance_R@1", "eval/retrieval_images", "data/data_rows_trained"} & set(out)
    assert mlflow_name("eval/t2i_R@1") == "eval/t2i_R_at_1"


def test_evaluation_constants_stand_in_metrics_jsonl_once_and_again_when_they_change(tmp_path):
    """Chance levels and set sizes: on the first evaluation's line, then only where their value changes — both as the
    run goes (RunLog) and in the final rewrite from the checkpoint's history (_keep_history)."""
    from rayvl.train.run_dir import _keep_history
    from rayvl.train.run_log import RunLog

    rows = [{**ROW, "step": s, "t2i_R@1": float(s), "t2i_chance_R@1": 1.5625, "retrieval_images": n}
            for s, n in ((2, 64), (4, 64), (6, 128))]
    log = RunLog(str(tmp_path), {"name": "r", "run_dir": str(tmp_path), "config": {"train": {"max_steps": 6}}}, [],
                 "", sync_every_s=1e9)
    for row in rows:
        log.after_report(None, [row], None)
    for lines in ([json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()],
                  _rewritten(rows, tmp_path, _keep_history)):
        assert [x["t2i_R@1"] for x in lines] == [2.0, 4.0, 6.0]  # the metrics on every line
        assert [x.get("t2i_chance_R@1") for x in lines] == [1.5625, None, None]
        assert [x.get("retrieval_images") for x in lines] == [64, None, 128]


def _rewritten(rows: list[dict], tmp_path, keep_history) -> list[dict]:
    live = tmp_path / "rewritten.jsonl"
    keep_history("".join(json.dumps(r) + "\n" for r in rows), live)
    return [json.loads(x) for x in live.read_text().splitlines()]


def _runs(tmp_path) -> None:
    """Runs a and b: 3 steps of training curves, t2i_R@1 evaluated at steps 2 and 3, zero-shot only at step 2 —
    and in b only, i2t_R@1 twice."""
    for name, offset in (("a", 0.0), ("b", 0.5)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, "loss": 3 - s / 10 + offset, "lr": 1e-3, "samples_per_s": 30.0, "data_wait_share": 0.01}
                for s in (1, 2, 3)]
        rows[1].update({"t2i_R@1": 5.0 + offset, "t2i_chance_R@1": 1.0, "zeroshot_top1": 40.0 + offset,
                        "eval_images": 64})
        rows[2].update({"t2i_R@1": 7.0 + offset, "t2i_chance_R@1": 1.0})
        if name == "b":
            rows[1]["i2t_R@1"], rows[2]["i2t_R@1"] = 4.0, 6.0
        rows.append({**rows[2], "loss": 9.0})  # step 3 again after a restart: the later row counts
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_a_run_has_one_dashboard_and_several_runs_share_one(tmp_path, capsys):
    """One PNG per run (not one per metric): curves where a metric has more than one point, the metrics reported
    once in a table of the same figure; several runs: the same panels, a line per run."""
    from PIL import Image

    from rayvl.cli import main
    from rayvl.plots import history, plot_run, plot_runs

    _runs(tmp_path)
    assert [r["loss"] for r in history(str(tmp_path / "a"))] == [2.9, 2.8, 9.0]
    assert main(["plot", str(tmp_path / "a")]) == 0
    assert [p.name for p in (tmp_path / "a" / "plots").iterdir()] == ["run.png"]
    with Image.open(tmp_path / "a" / "plots" / "run.png") as png:
        assert png.format == "PNG" and png.width > 0 and png.height > 0
    drawn = plot_run(str(tmp_path / "a"))
    assert drawn.path == tmp_path / "a" / "plots" / "run.png" and drawn.runs == ["a"]
    assert drawn.panels == ["training loss", "learning rate", "samples/s (all workers)",
                            "data wait (% of step time)", "text→image R@1 %"]
    assert drawn.table == {"zeroshot_top1": {"a": (2, 40.0)}}  # chance levels and set sizes are not plotted
    logged = [{"step": s, "loss": 1.0, "logit_scale": 14.3 + s, "grad_norm": 0.5 * s} for s in (1, 2, 3, 4)]
    logged[1]["checkpoint"] = True
    logged[3].update({"checkpoint": True, "sts_spearman": 50.0, "zeroshot_top1": 40.0, "t2i_R@1": 3.0,
                      "i2t_R@5": 9.0, "zeroshot_chance_top1": 12.5})
    c = plot_runs({"c": logged}, tmp_path / "c")
    assert c.panels == ["training loss", "logit scale (1/τ)", "gradient norm"]
    assert c.marks == {"checkpoint": [2, 4], "evaluation": [4]}  # what paused training, drawn on every panel
    siglip = plot_runs({"s": [{**row, "logit_bias": -10.0 + 0.1 * row["step"]} for row in logged]}, tmp_path / "s")
    assert siglip.panels == ["training loss", "logit scale (1/τ)", "logit bias (SigLIP's b)", "gradient norm"]
    assert list(c.table) == ["i2t_R@5", "t2i_R@1", "zeroshot_top1", "sts_spearman"]  # grouped by task
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")]) == 0
    assert capsys.readouterr().out.strip() == (f"wrote {tmp_path / 'cmp' / 'run.png'}: 6 curves, 1 metrics reported "
                                               f"once in a table")
    assert [p.name for p in (tmp_path / "cmp").iterdir()] == ["run.png"]
    with Image.open(tmp_path / "cmp" / "run.png") as png:
        assert png.format == "PNG" and png.width > 0


def test_plot_mistakes_are_one_line_and_exit_2(tmp_path, capsys):
    from rayvl.cli import main

    _runs(tmp_path)
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err == f"rayvl: error: {tmp_path / 'nothing'}: no metrics.jsonl (not a rayvl run " \
                                      f"directory, or no report yet)\n"
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err == "rayvl: error: plot: several runs need --out (the folder for their dashboard)\n"
    assert not (tmp_path / "a" / "plots").exists()


def test_resume_without_a_name_continues_the_newest_run_of_the_recipe(demo_dir, tmp_path):
    from rayvl.train.run_dir import run_paths

    cfg = small_config(demo_dir, tmp_path, "train.run_name=", "train.resume=true")
    with pytest.raises(ConfigError, match="train.resume: no run of recipe 'laion_adapt'"):
        run_paths(cfg)
    for name, checkpointed in (("laion_adapt-20261101-090000", True), ("laion_adapt-20261102-090000", True),
                               ("laion_adapt-20261103-090000", False), ("tonics-20261201-090000", True),
                               ("my-named-run", True)):
        folder = tmp_path / name / "checkpoint_000001"
        folder.mkdir(parents=True)
        if checkpointed:
            (folder / "rayvl.json").write_text(json.dumps({"step": 1, "config": cfg.to_dict(), "final": False}))
    assert run_paths(cfg)[1] == "laion_adapt-20261102-090000"  # newest of the recipe that has a checkpoint


@pytest.mark.slow
def test_recipes_are_installed_with_the_package(tmp_path):
    """A non-editable install (a wheel) carries configs/ as rayvl.configs and tune_spaces/ as rayvl.tune_spaces, and
    the CLI finds them there — a space by its name, from any folder, with the recipe it names."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO),
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True, cwd=tmp_path)
    wheel = next((tmp_path / "wheel").glob("rayvl-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, capture_output=True)
    code = "import rayvl.cli.recipes as r; print(r.CONFIGS); print(sorted(p.name for p in r.CONFIGS.glob('*.yaml')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}).stdout.splitlines()
    assert out[0].startswith(str(tmp_path / "site")), out
    assert out[1] == "['bow_pretrain.yaml', 'clip_finetune.yaml', 'laion_adapt.yaml', 'tonics.yaml', 'unicl.yaml']"
    code = "from rayvl.sweeps.spaces import load_sweep; s = load_sweep('curriculum'); print(s.path); print(s.recipe)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [str(tmp_path / "site" / "rayvl" / "tune_spaces" / "curriculum.yaml"),
                                       str(tmp_path / "site" / "rayvl" / "configs" / "tonics.yaml")]


@pytest.mark.parametrize("args, key", [
    (["--data", "/nonexistent/shards-*.tar"], "data.train: '/nonexistent/shards-*.tar' matches no shard"),
    (["--set", "model.vision=resnet5O"], "model.vision: 'resnet5O' is neither a rayvl asset"),
    (["--set", "model.text=/no/such/hf-model"], "model.text: '/no/such/hf-model' is neither a rayvl asset"),
    (["--init-from", "/no/such/run"], "train.init_from: '/no/such/run' is not a rayvl run"),
    (["--resume", "no-such-run"], "train.resume: run"),
    # issue 56, defect 9: what the user meant, named
    (["--set", "train.report_to=wandb"], "train.report_to: expected a list, got str 'wandb' (a list of one: "
                                         "train.report_to=[wandb])"),
    (["--set", "model.vision=vit_base_patch32_clip_224", "--set", "data.image_size=224", "--set",
      f"model.vision_checkpoint={__file__}"], f"model.vision_checkpoint: cannot read {__file__!r} as a checkpoint "
                                              f"(a file torch.save or TorchScript wrote:"),
])
def test_bad_input_is_one_line_and_exit_2_before_ray(demo_dir, tmp_path, capsys, args, key):
    import ray

    from rayvl.cli.recipes import CONFIGS, run_recipe

    was_running = ray.is_initialized()
    base = ["--eval-data", str(demo_dir / "eval"), "--set", f"train.storage_path={tmp_path}"]
    if "--data" not in args:
        base += ["--data", str(demo_dir / "train")]
    assert run_recipe(str(CONFIGS / "laion_adapt.yaml"), base + args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rayvl: error: {key}") and "\n" not in err, err
    assert ray.is_initialized() == was_running  # refused before Ray started


def test_evaluation_tasks_log_progress_lines(caplog):
    from rayvl.eval.tasks import evaluate

    class Embedder:
        def images(self, images):
            return images

    class Data:
        images, captions, classes, labels = np.eye(3, dtype="float32"), [], [], np.full(3, -1)

    with caplog.at_level(logging.INFO, logger="rayvl"):
        evaluate(["zeroshot", "retrieval"], Data(), Embedder())
    lines = [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "rayvl"]
    assert lines == ["eval: 3 images embedded", "eval: task 1/2 zeroshot skipped", "eval: task 2/2 retrieval skipped"]


@pytest.mark.slow
def test_missing_checkpoint_is_one_line_and_exit_2_in_a_fresh_process(tmp_path):
    for command in (["eval", str(tmp_path / "gone")], ["export", str(tmp_path / "gone"), "--out",
                                                         str(tmp_path / "x")]):
        r = subprocess.run([sys.executable, "-m", "rayvl.cli", *command], capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith(f"rayvl: error: {tmp_path / 'gone'}: neither a rayvl checkpoint nor a run "
                                   "directory"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def _options(parser, path=("rayvl",)):
    """(command path, option) for every option of every (sub)command."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _options(child, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_has_help_and_config_fields_keep_their_config_default():
    """An option that sets a config field defaults to None, so the config's default applies; its help shows the
    dataclass's value (read from it, not a copy)."""
    from rayvl.cli import build_parser
    from rayvl.config import EvalConfig

    options = list(_options(build_parser()))
    assert len(options) > 50
    assert not [f"{' '.join(p)} {a.dest}" for p, a in options if not (a.help or "").strip()]
    by_flag = {(p[-1], a.option_strings[-1] if a.option_strings else a.dest): a for p, a in options}
    e = EvalConfig()
    for flag, key in (("--gpus", "gpus_per_actor"), ("--actors", "actors"), ("--cpus-per-actor", "cpus_per_actor"),
                      ("--batch-size", "batch_size"), ("--k", "paraphrase_k"), ("--tasks", "checkpoint_tasks")):
        action = by_flag["eval", flag]
        shown = ",".join(getattr(e, key)) if key == "checkpoint_tasks" else format(getattr(e, key), "g")
        assert action.default is None and f"eval.{key}, {shown})" in action.help, (flag, action.help)
    for flag in ("--data", "--eval-data", "--resume", "--init-from"):
        assert by_flag["train", flag].default is None
    assert by_flag["pseudo-label", "run"].default is None and "weighted_count)" in by_flag["pseudo-label",
                                                                                             "--rules"].help


def test_train_is_parsed_once_and_usage_errors_read_as_every_error(monkeypatch, capsys):
    """`rayvl train` hands its parsed options to the recipe runner (no second parse); argparse's own mistakes end
    as `rayvl: error: …`, exit 2, like the ones rayvl finds."""
    import rayvl
    import rayvl.cli as cli

    seen = []
    monkeypatch.setattr(cli, "train_command", lambda args: seen.append(args) or 7)
    assert cli.main(["train", "--data", "s", "--set", "a.b=1", "--resume"]) == 7
    assert [(a.data, a.set, a.resume, a.init_from) for a in seen] == [("s", ["a.b=1"], "latest", None)]
    for argv, message in ((["eval"], "the following arguments are required: RUN"),
                          (["plot", "--bogus", "x"], "unrecognized arguments: --bogus"),
                          (["eval", "run", "--gpus", "one"], "argument --gpus: invalid float value: 'one'")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"rayvl: error: {message}"
    with pytest.raises(SystemExit) as exit_:  # issue 56: the version a bug report names
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"rayvl {rayvl.__version__}"
    # an unquoted brace spec, expanded by the shell into a path a shard (issue 56): the line says to quote it
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--data", "/x/00000.tar", "/x/00001.tar", "/x/00002.tar"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "rayvl: error: unrecognized arguments: /x/00001.tar /x/00002.tar — the shell expanded a brace spec into one "
        "argument a shard: quote it, e.g. --data '/data/{00000..00099}.tar'")


def test_rayvl_eval_refuses_unknown_tasks_and_pool_settings_naming_them(demo_dir, tmp_path, capsys):
    """RUN is positional; --tasks and the actor pool are checked against the known tasks and their ranges, each
    named by flag and config key, before Ray starts."""
    import ray

    from rayvl.cli import main

    cfg = small_config(demo_dir, tmp_path)
    folder = tmp_path / "run" / "checkpoint_000001"
    folder.mkdir(parents=True)
    (folder / "rayvl.json").write_text(json.dumps({"step": 1, "config": cfg.to_dict(), "final": False}))
    was_running = ray.is_initialized()
    capsys.readouterr()
    sizes = ("rayvl: error: --actors, --cpus-per-actor, --workers, --batch-size (eval.actors, eval.cpus_per_actor, "
             "eval.loader_workers, eval.batch_size) must be ≥ 0 (--batch-size 0: by the device)")
    for flags, message in (
            (["--tasks", "zeroshot,bogus"], "rayvl: error: --tasks: unknown ['bogus'] (known: zeroshot, retrieval, "
                                            "paraphrase, sts, linear_probe)"),
            (["--gpus", "2"], "rayvl: error: --gpus 2 (eval.gpus_per_actor): GPUs per embedding actor, from 0 to 1 "
                              "(more GPUs: more --actors)"),
            (["--batch-size", "-1"], sizes), (["--workers", "-1"], sizes),
            # --set takes the checkpoint's eval.* settings (issue 56, defect 8), checked as the flags are
            (["--set", "eval.batch_size=-1"],
             "rayvl: error: eval.batch_size: must be ≥ 0 (0: by the device), got -1"),
            (["--set", "eval.checkpoint_tasks=[zeroshot, bogus]"], "rayvl: error: eval.checkpoint_tasks: unknown "
                                                                   "['bogus'] (known: zeroshot, retrieval, paraphrase, "
                                                                   "sts, linear_probe)"),
            (["--set", "model.embed_dim=3"], "rayvl: error: --set model.embed_dim=3: rayvl eval takes eval.* keys (the "
                                             "checkpoint's model and data are its own; --data, --classes, ... choose "
                                             "what it evaluates on)"),
            (["--set", "eval.batch_size=x"], "rayvl: error: eval.batch_size: expected an integer, got 'x'")):
        assert main(["eval", str(tmp_path / "run"), *flags]) == 2
        assert capsys.readouterr().err == message + "\n"
    assert ray.is_initialized() == was_running


def test_without_held_out_shards_a_run_trains_unevaluated_and_tonics_is_refused(demo_dir, tmp_path, caplog):
    """--data without --eval-data: the workers once looked for an "eval" dataset that was never made and every
    retry failed inside them. Now evaluation is off with a warning; TOnICS, whose refresh needs the held-out split,
    is a config error before Ray starts."""
    from conftest import REPO, small_config
    from rayvl.config import ConfigError, load_config
    from rayvl.train import datasets

    cfg = small_config(demo_dir, tmp_path, "data.eval=")
    with caplog.at_level(logging.WARNING, logger="rayvl"):
        off = datasets.evaluation_or_off(cfg, datasets.resolve(cfg).eval)
    assert cfg.eval.tasks and off.eval.tasks == [] and "training without evaluation" in caplog.text
    assert datasets.evaluation_or_off(cfg, str(demo_dir / "eval")) is cfg
    tonics = load_config(REPO / "configs" / "tonics.yaml", [f"data.train={demo_dir / 'train'}", "data.eval="])
    with pytest.raises(ConfigError, match="data.eval: the TOnICS curriculum refresh needs held-out shards"):
        datasets.resolve(tonics)


def test_cli_mistakes_name_the_way_out(demo_dir, tmp_path, capsys, monkeypatch):
    """A resume of a finished run, a key's near miss, a packaged recipe named from another folder, a report of a
    folder that is no sweep's: each one line (exit 2) saying what to do instead, before Ray starts."""
    from rayvl.cli import main
    from rayvl.config import load_config
    from rayvl.cli.recipes import CONFIGS, run_recipe

    finished = tmp_path / "runs" / "done" / "checkpoint_000001"
    finished.mkdir(parents=True)
    recipe = load_config(CONFIGS / "laion_adapt.yaml")
    (finished / "rayvl.json").write_text(json.dumps({"step": recipe.train.max_steps, "config": recipe.to_dict(),
                                                     "final": True}))
    base = ["--data", str(demo_dir / "train"), "--eval-data", str(demo_dir / "eval"),
            "--set", f"train.storage_path={tmp_path / 'runs'}", "--resume", "done"]
    for dry in ([], ["--dry-run"]):
        assert run_recipe(str(CONFIGS / "laion_adapt.yaml"), base + dry) == 2
        assert capsys.readouterr().err.strip() == (
            f"rayvl: error: train.resume: run '{tmp_path / 'runs' / 'done'}' finished at step 200 (train.max_steps): "
            f"nothing is left to train — to train it further, start a new run from its weights with --init-from "
            f"{tmp_path / 'runs' / 'done'} (train.init_from), on a schedule of its own")
    assert main(["train", "--dry-run", "--set", "model.alignment_layer=2"]) == 2
    assert "model.alignment_layer: unknown key (did you mean model.alignment_layers? known: " in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # not the repository: the recipe installed with the package
    assert main(["train", "--dry-run", "--config", "bow_pretrain"]) == 0
    assert capsys.readouterr().out.startswith("recipe bow_pretrain: config valid")
    assert main(["train", "--dry-run", "--config", "no_such_recipe"]) == 2
    assert "the recipes rayvl has: bow_pretrain, clip_finetune, laion_adapt, tonics, unicl" in capsys.readouterr().err
    assert main(["tune", "--report", str(tmp_path)]) == 2
    assert f"--report {tmp_path}: not a sweep's directory" in capsys.readouterr().err
    # a sweep's --set mistake is the command line's, not the space file's
    assert main(["tune", str(REPO / "tune_spaces" / "alignment_depth.yaml"), "--dry-run", "--set", "train.lrr=1"]) == 2
    assert capsys.readouterr().err.startswith("rayvl: error: --set train.lrr: unknown key (did you mean train.lr? ")


def test_eval_export_and_plot_take_a_run_by_name_or_latest(tmp_path, monkeypatch, capsys):
    from rayvl.cli import main
    from rayvl.train.run_dir import find_run

    from rayvl.train.run_dir import remember_run

    monkeypatch.setenv("HOME", str(tmp_path))  # the default storage path, ~/rayvl-runs
    monkeypatch.setenv("RAYVL_CACHE", str(tmp_path / "cache"))
    runs = tmp_path / "rayvl-runs"
    for name, checkpointed in (("tonics-20261101-090000", True), ("laion_adapt-20261102-090000", True),
                               ("laion_adapt-20261103-090000", False), ("mine", True)):
        (runs / name / "checkpoint_000001").mkdir(parents=True)
        if checkpointed:
            (runs / name / "checkpoint_000001" / "rayvl.json").write_text(json.dumps({"step": 1}))
    assert find_run("latest") == str(runs / "laion_adapt-20261102-090000")  # the newest with a checkpoint
    assert find_run("mine") == str(runs / "mine") and find_run(str(tmp_path)) == str(tmp_path)
    # a run kept under another train.storage_path (issue 56, defect 7): found by name where this machine started it
    far = tmp_path / "bucket" / "far"
    (far / "checkpoint_000001").mkdir(parents=True)
    (far / "checkpoint_000001" / "rayvl.json").write_text(json.dumps({"step": 1}))
    remember_run(str(tmp_path / "bucket" / "mine-elsewhere"))  # gone since: not found
    remember_run(str(far))
    assert find_run("far") == str(far)
    for argv in (["export", "nope", "--out", str(tmp_path / "x")], ["plot", "nope"], ["eval", "mine-elsewhere"]):
        assert main(argv) == 2
        name = argv[1]
        assert f"rayvl: error: RUN: '{name}' is neither a run directory nor checkpoint, nor a run's name under " \
               f"'{runs}' (or latest), nor one this machine started under another train.storage_path" in \
               capsys.readouterr().err


def test_demo_budget_warnings_are_for_the_recipes_keys_and_no_evaluation_says_so(demo_dir, capsys):
    """The dry run's demo-budget warnings name what the recipe set for its demo data, not what the command line set;
    a run without an evaluation prints and records that none ran (issue 56, defect 4; the file: test_training's
    resumed memory-bank run)."""
    from rayvl.cli import main
    from rayvl.eval.tables import NO_EVALUATION, format_eval_table

    warned = "the recipe's budget for its demo data"
    data = ["--data", str(demo_dir / "train"), "--eval-data", str(demo_dir / "eval")]
    assert main(["train", "--dry-run", *data, "--set", "train.max_steps=21"]) == 0
    out = capsys.readouterr().out
    assert f"a warm-up of 20 steps (train.warmup_steps) — {warned}" in out
    assert f"evaluation only at the last step (eval.every_steps=0) — {warned}" in out
    assert "train.max_steps=21" not in out.split("warning")[-1]  # the command line's: no warning
    assert main(["train", "--dry-run", *data, "--set", "train.max_steps=21", "--set", "train.warmup_steps=3",
                 "--set", "eval.every_steps=10"]) == 0
    assert warned not in capsys.readouterr().out
    assert format_eval_table({"step": 3, "loss": 1.0}) == NO_EVALUATION
