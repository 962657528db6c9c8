"""A run's wall time between its reports at Ray Train's default poll interval and at rayvl's, side by side.

    .venv/bin/python benchmarks/report_polls.py [--steps 40] [--log-every 2] [--rounds 2]

Ray Train's controller takes one report of each worker every time it polls them, every
RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, and a worker's ``ray.train.report`` waits while its previous report is unpolled
(a queue of one). At Ray's default of 2 s, a run whose reports come faster than one per 2 s trains ``log_every``
steps per 2 s, whatever its step time; rayvl's fits poll sooner (``rayvl.session.report_polls``). The effect needs no
GPU: steps of a small model on the embedded demo come faster than Ray's polls on any machine.

Each round trains the laion_adapt recipe at toy size on the demo (1 worker, 32 px, a frozen text tower, no
evaluation, one checkpoint at the end) twice on one local Ray, in turns: with the interval set to Ray's default as a
user sets it (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=2``, which rayvl keeps), and with rayvl's. The table gives, from
the run's ``metrics.jsonl``, the driver's clock from the first report to the last report before the final checkpoint
(``elapsed_s``), those steps' rate over it, and the sum of the same reports' windows (``samples_per_s``: since
rayvl's windows hold each report's wait, the two agree at either interval, within two polls: the difference of the
first and the last report's way to the driver). Timings are printed, never asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rayvl import session  # noqa: E402
from rayvl.config import load_config  # noqa: E402
from rayvl.data.demo import write_demo  # noqa: E402
from rayvl.train.trainer import train  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KEY = session.REPORT_POLL[0]


def run_once(demo: Path, out: Path, name: str, steps: int, log_every: int) -> dict:
    cfg = load_config(REPO / "configs" / "laion_adapt.yaml", [
        f"data.train={demo / 'train'}", f"data.eval={demo / 'eval'}", "data.image_size=32", "data.max_text_tokens=16",
        "train.num_workers=1", "train.micro_batch_size=8", f"train.max_steps={steps}", "train.warmup_steps=1",
        f"train.log_every={log_every}", f"train.checkpoint_every={steps}", f"train.storage_path={out}",
        f"train.run_name={name}", "train.report_to=[]", "eval.tasks=[]", "model.alignment_layers=1",
        "model.embed_dim=64", "model.text_strategy=frozen"])
    result = train(cfg, verbose=False)
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = rows[:-1]  # the last report carries the final checkpoint
    wall = rows[-1]["elapsed_s"] - rows[0]["elapsed_s"]
    windows = sum(log_every * cfg.train.micro_batch_size / r["samples_per_s"] for r in rows[1:])
    return {"steps": rows[-1]["step"] - rows[0]["step"], "wall": wall, "windows": windows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    session.setup_logging(False)
    tmp = Path(tempfile.mkdtemp(prefix="rayvl-report-polls-"))
    demo = write_demo(tmp / "demo", samples=384, eval_samples=64, seed=0, shard_size=128)
    session.connect("", 0, verbose=False)
    settings = {"Ray's default (2 s, set by the user)": "2", f"rayvl's ({session.REPORT_POLL[1]} s)": None}
    results: dict[str, list[dict]] = {label: [] for label in settings}
    for r in range(args.rounds):
        for i, (label, value) in enumerate(settings.items()):
            if value is None:
                os.environ.pop(KEY, None)
            else:
                os.environ[KEY] = value
            results[label].append(run_once(demo, tmp / "runs", f"r{r}-{i}", args.steps, args.log_every))
    os.environ.pop(KEY, None)
    print(f"\n{args.steps} steps, a report every {args.log_every}, {args.rounds} round(s) each, in turns on one local "
          f"Ray ({os.cpu_count()} CPUs); the steps between the first report and the last before the final checkpoint")
    head = f"{'poll interval':<40} {'steps':>5} {'wall s':>16} {'steps/s':>16} {'windows s':>16}"
    print(head + "\n" + "-" * len(head))
    for label, runs in results.items():
        def each(f) -> str:
            return " / ".join(f"{f(x):.2f}" for x in runs)
        print(f"{label:<40} {runs[0]['steps']:>5} {each(lambda x: x['wall']):>16} "
              f"{each(lambda x: x['steps'] / x['wall']):>16} {each(lambda x: x['windows']):>16}")
    default, ours = (statistics.median(x["steps"] / x["wall"] for x in runs) for runs in results.values())
    print(f"\nrayvl's interval ÷ Ray's default, steps/s over the driver's clock (median of rounds): "
          f"{ours / default:.2f}×")


if __name__ == "__main__":
    main()
