"""Recipes as programs: `rayvl train` and the jobs in ``jobs/`` train one recipe (``train_command``, reached from
a job's own command line through ``run_recipe``); the paper comparisons run variants × seeds as a Tune grid
(rayvl.sweeps.comparison). Their shared options and their one error style: a mistake the user can fix is
``rayvl: error: <one line>``, exit status 2, before Ray starts."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rayvl import dry_run, session, storage
from rayvl.assets import MissingAssetError
from rayvl.config import ConfigError, RayvlConfig, given_keys, installed_dir, load_config
from rayvl.data.report import DataPlaneError, format_data_report
from rayvl.eval.tables import format_eval_table
from rayvl.plots import DASHBOARD_FILE, PLOTS_DIR

CONFIGS = installed_dir("--config")  # configs/ of the checkout or the installed copy


class RayvlParser(argparse.ArgumentParser):
    """argparse with rayvl's one error style: a usage mistake ends as every user error does, ``rayvl: error: …``
    and exit status 2 (argparse's own is ``<prog>: error: …``, the prog differing per subcommand and job)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"rayvl: error: {one_line(message)}{expanded_spec_hint(message)}\n")


def expanded_spec_hint(message: str) -> str:
    """Where argparse's extra arguments are shard files, the shell expanded an unquoted brace spec
    (``--data /x/{00000..00003}.tar`` arrives as four paths): say so."""
    if not message.startswith("unrecognized arguments:"):
        return ""
    if not any(a.endswith(".tar") for a in message.split(":", 1)[1].split()):
        return ""
    return (" — the shell expanded a brace spec into one argument a shard: quote it, e.g. "
            "--data '/data/{00000..00099}.tar'")


def user_error(error: Exception | str) -> int:
    """A mistake the user can fix (a config key, a path, a flag), in one line on stderr; the exit status 2."""
    print(f"rayvl: error: {one_line(error)}", file=sys.stderr)
    return 2


def add_train_args(p: argparse.ArgumentParser, default_config: str | None) -> None:
    """The options of `rayvl train` and of the jobs: each sets config fields, so none has a default of its own."""
    recipe = Path(default_config).name if default_config else "none"
    names = ", ".join(sorted(f.stem for f in installed_dir("--config").glob("*.yaml")))
    p.add_argument("--config", default=default_config,
                   help=f"a recipe by name ({names}) or a YAML path (default: {recipe})")
    p.add_argument("--data", help="training shards (dir, glob, list file or URL); sets data.train")
    p.add_argument("--eval-data", help="held-out shards; sets data.eval")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set train.zero_stage=3 (repeatable)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="RUN",
                   help="continue a run from its latest checkpoint: RUN (a run name), or with no value (or "
                        "'latest') train.run_name if set, else the newest run of this recipe")
    p.add_argument("--init-from", default=None, metavar="RUN",
                   help="start a new run from the weights of RUN (a run directory, checkpoint or export); sets "
                        "train.init_from")
    p.add_argument("--verbose", action="store_true", help="show Ray's and the workers' own output")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config and the data (shard counts, the first 32 samples of the first and last "
                        "shard, pass size) and print what the run would do, without starting Ray or training")


def config_from_args(args, extra: list[str] = ()) -> RayvlConfig:
    overrides = config_overrides(args, extra)
    if args.resume:
        overrides.append("train.resume=true")
        if args.resume != "latest":
            overrides.append(f"train.run_name={args.resume}")
    if args.init_from:
        overrides.append(f"train.init_from={args.init_from}")
    return load_config(args.config, overrides)


def config_overrides(args, extra: list[str] = ()) -> list[str]:
    """The "key=value" overrides of --set (then ``extra``), --data and --eval-data."""
    overrides = list(args.set) + list(extra)
    if args.data:
        overrides.append(f"data.train={args.data}")
    if args.eval_data:
        overrides.append(f"data.eval={args.eval_data}")
    return overrides


# what a user can fix in one line, before Ray starts: exit 2 with the key and the value, no traceback
USER_ERRORS = (ConfigError, MissingAssetError, DataPlaneError)


def _train(cfg: RayvlConfig, verbose: bool):
    from rayvl.train.trainer import train  # Ray Train and DeepSpeed load only once the config is valid

    return train(cfg, progress=True, verbose=verbose, finished_ok=False)  # a user's --resume of a finished run: refused


def run_recipe(default_config: str, argv: list[str] | None = None) -> int:
    """A job's command line (jobs/laion_adapt.py): the options of `rayvl train`, parsed once, then train_command."""
    p = RayvlParser(description=f"rayvl recipe {Path(default_config).stem}")
    add_train_args(p, default_config)
    args = p.parse_args(argv)
    session.setup_logging(args.verbose)
    return train_command(args)


def train_command(args: argparse.Namespace) -> int:
    """Validate (before Ray starts), train, print the evaluation table and where the run is."""
    if args.dry_run:
        return print_dry_run(lambda: dry_run.describe(config_from_args(args), given_keys(config_overrides(args))))
    try:
        result = _train(config_from_args(args), args.verbose)
    except USER_ERRORS as e:
        return user_error(e)
    except Exception as e:  # a run that failed because of its data says so in one line, not a worker traceback
        cause = data_cause(e)
        if cause is None:
            raise
        print(f"rayvl: error: {one_line(cause)}", file=sys.stderr)
        return 1
    print("\n== evaluation (held-out split) ==")
    print(format_eval_table(result.metrics))
    print("\n== data ==")
    print(format_data_report(result.data_report))
    print(f"\nrun directory: {result.uri}")
    print(f"  checkpoint:  {result.checkpoint_dir}")
    print(f"  metrics:     {storage.join(result.uri, 'metrics.jsonl')}")
    print(f"  evaluation:  {storage.join(result.uri, 'eval.json')}")
    print(f"  dashboard:   {storage.join(result.uri, PLOTS_DIR, DASHBOARD_FILE)}   (tensorboard --logdir "
          f"{result.uri})")
    print(f"  export:      rayvl export {result.uri} --out {Path(str(result.uri)).name}-export")
    return 0


def print_dry_run(describe) -> int:
    """Print ``describe()``'s report, or the one-line error that the real run would have stopped with."""
    try:
        print(describe())
    except USER_ERRORS as e:
        return user_error(e)
    return 0


def one_line(e: Exception | str) -> str:
    return " ".join(str(e).split())


def data_cause(error: BaseException) -> DataPlaneError | None:
    """The DataPlaneError (an unreadable shard, a starved pipeline) behind a failed run: Ray Train's
    WorkerGroupError holds each rank's exception, Ray wraps a read task's error as its cause."""
    stack, seen = [error], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        wrapped = getattr(e, "cause", None)
        if isinstance(wrapped, BaseException):  # a RayTaskError(X) is an X whose message is a whole traceback
            stack.append(wrapped)
        elif isinstance(e, DataPlaneError):
            return e
        else:
            stack += [e.__cause__, e.__context__, *getattr(e, "worker_failures", {}).values()]
    return None


def gpu_errors_in_one_line(job):
    """``job()``, or None after printing in one line why an actor given a GPU could not use it (NoCudaError)."""
    from rayvl.eval.embed import no_cuda_cause

    try:
        return job()
    except Exception as e:  # anything else is re-raised as it was
        cause = no_cuda_cause(e)
        if cause is None:
            raise
        print(f"rayvl: error: {one_line(cause)}", file=sys.stderr)
        return None
