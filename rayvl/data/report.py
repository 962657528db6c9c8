"""The run's data report: every sample seen, kept and dropped (by reason), counted across all Ray Data tasks, and
how it is printed. Nothing is lost silently: a dropped sample, a truncated shard or an emptied caption is a count
here, and the counts ride in every metrics report and in ``data_report.json``."""
from __future__ import annotations

import sys
from collections import Counter

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayvl import plugins
from rayvl.data.position import DataPosition
from rayvl.errors import DataPlaneError  # noqa: F401 (raised by the readers; callers import it from here too)


@ray.remote(num_cpus=0)
class DataReport:
    """Counts every sample seen and every sample dropped (by reason) across all Ray Data tasks of one run, per
    (pass, shard) for a training stream, and holds the data position read tasks resume from (data/position.py).

    ``settled``: counts of shards that will not be read again (finished, or restored from a checkpoint);
    ``units``: the current counts of each shard being read, replaced when the shard is read again (a retried read
    task, a resumed run). A restore (one per worker group, ``token``) drops what the lost group's reads counted; a
    stream without a position (image-label data) is restored from the beginning (``restore(token, None, 0)``: it is
    read again from its start, so its counts start again), its reads counted under the token they started with
    (``add(token=…)``)."""

    def __init__(self):
        self.settled: Counter = Counter()
        self.bad_shards: dict[str, str] = {}
        self.units: dict[tuple[int, int], tuple[str, Counter]] = {}
        self.running: Counter = Counter()  # the sum of self.units' counts
        # rows a shard produced, from the end of its read until the position settles it: at most the shards being
        # read or trained on, not every shard of every pass
        self.rows: dict[tuple[int, int], int] = {}
        self.token: str | None = None
        self.position: DataPosition | None = None
        self.execution = 0
        self.passes = 0  # passes one execution of the positioned stream lists (read tasks say, in plan)

    def add(self, counts: dict, bad_shard: tuple[str, str] | None = None, unit: tuple | None = None,
            token: str | None = None) -> None:
        """``unit`` = (token, attempt, pass, shard, rows produced or None before the shard's end); without one the
        counts are settled at once, unless ``token`` (the one the read started under) is no longer current."""
        if (unit[0] if unit is not None else token) != self.token:  # a read of a worker group replaced since
            return
        if bad_shard:
            self.bad_shards[bad_shard[0]] = bad_shard[1]
        if unit is None:
            self.settled.update(counts)
            return
        _, attempt, p, s, rows = unit
        held = self.units.get((p, s))
        if held is None or held[0] != attempt:  # read again: its earlier counts are replaced
            if held is not None:
                self.running.subtract(held[1])
            held = self.units[(p, s)] = (attempt, Counter())
        held[1].update(counts)
        self.running.update(counts)
        if rows is not None:
            self.rows[(p, s)] = rows

    def restore(self, token: str, position: dict | None, n_shards: int, mix: tuple = ()) -> None:
        """A worker group starts (from ``position``, or from the beginning when None; ``n_shards``, ``mix``: as
        DataPosition takes them); the same token twice is a no-op, so every rank of a group may call it."""
        if token == self.token:
            return
        self.token, self.units, self.running, self.rows = token, {}, Counter(), {}
        self.position = DataPosition(n_shards, mix)
        if position is not None:
            self.position.load_state_dict(position)
        self.settled = Counter(self.position.report["counts"])
        self.bad_shards = dict(self.position.report["bad_shards"])
        self.execution = self.position.execution

    def current_token(self) -> str | None:
        return self.token

    def read_task(self, listed_pass: int, passes: int, shards: list[int]) -> tuple:
        """(token, pass, shards to skip, shard → rows trained on) for a read task of pass ``listed_pass`` of a
        dataset that lists ``passes`` passes (its later executions read the passes after them)."""
        pass_ = listed_pass + self.execution * passes
        self.passes = passes
        skip, trained = self.position.left_out(pass_, shards) if self.position else (set(), {})
        return self.token, pass_, skip, trained

    def begin_execution(self, execution: int) -> None:
        self.execution = max(self.execution, execution)

    def unit_rows(self, units: list[tuple[int, int]]) -> dict:
        """Rows produced by each of ``units`` whose read has reached the shard's end, and every unit read to its
        end that produced none (no row of it is ever trained on, so only this settles it)."""
        wanted = set(units)
        return {u: n for u, n in self.rows.items() if u in wanted or n == 0}

    def settle(self, units: list[tuple[int, int]], open_pass: int | None = None) -> tuple[dict, int]:
        """Fold finished shards' counts into the settled ones; returns (the settled report, the execution a
        checkpoint resumes in). ``open_pass``: the first pass not complete in the position being saved."""
        for u in units:
            self.rows.pop(u, None)
            held = self.units.pop(u, None)
            if held is not None:
                self.running.subtract(held[1])
                self.settled.update(held[1])
        report = {"counts": dict(+self.settled), "bad_shards": dict(self.bad_shards)}
        if open_pass is None or not self.passes:
            return report, self.execution
        # execution k starts (batches.epochs' begin) as soon as k − 1's reads end, while its last rows still wait
        # in the prefetch queue or a TOnICS bucket: while a pass of k − 1 is open, a resume must read k − 1 again
        # (its finished shards are skipped unopened)
        return report, min(self.execution, open_pass // self.passes)

    def snapshot(self) -> dict:
        return {"counts": dict(+(self.settled + self.running)), "bad_shards": dict(self.bad_shards)}


_handles: dict = {}


def create_report(name: str):
    """A new DataReport actor, created by the driver of the run (or evaluation) it counts for: owned by that
    driver, on its node — a worker node the autoscaler (or a spot market) takes away must not take the run's counts
    with it. Ended by ``release_reports`` once its counts are read."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    _handles[name] = DataReport.options(name=name, namespace="rayvl", scheduling_strategy=here).remote()
    return _handles[name]


def report_actor(name: str):
    """The named report, which its driver created (``create_report``) before any reading started: found, never
    created — a read task that starts after the run ended fails instead of starting a report that nobody ends (a
    process that found it before keeps its handle: report names are unique per run and evaluation)."""
    if name not in _handles:
        try:
            _handles[name] = ray.get_actor(name, namespace="rayvl")
        except ValueError:
            raise ValueError(f"data report {name!r} does not exist: the driver creates it "
                             "(rayvl.data.report.create_report) before anything reads into it, and ends it after "
                             "(release_reports)") from None
    return _handles[name]


def release_reports(names=None) -> None:
    """Ends the driver's report actors once their counts are read (``None``: every report this process holds).
    Every process that counted keeps a handle, and an actor lives while its driver does: a driver that goes on after
    a run — a notebook, a sweep's driver, a test session — would otherwise keep every run's report alive, each an
    idle process (memory, and CPU for Ray's own threads)."""
    for name in list(_handles) if names is None else names:
        handle = _handles.pop(name, None)
        try:
            if handle is not None:
                ray.kill(handle, no_restart=True)
        except Exception as e:  # called in `finally`: never in place of the error the run or evaluation raised
            print(f"rayvl: warning: data report {name} not ended: {e}", file=sys.stderr)


def record(report_name: str | None, counts: dict, bad_shard: tuple[str, str] | None = None,
           unit: tuple | None = None, token: str | None = None) -> None:
    """Add counts to the named report. Waited for: the counts are recorded before the (last) batch they describe
    is emitted, so whoever has consumed the data also sees its counts — a fire-and-forget call could still be in
    flight. Callers batch their counts (a read task once per shard), so the round trip is not per batch."""
    if report_name:
        ray.get(report_actor(report_name).add.remote(counts, bad_shard, unit, token))


def record_async(report_name: str, counts: dict, unit: tuple | None = None, token: str | None = None) -> None:
    """Add counts without waiting: a read task's counts so far, sent before each block it emits (the calls of one
    task arrive in order, its shard's last ``record`` after them)."""
    if counts:
        report_actor(report_name).add.remote(counts, None, unit, token)


def current_token(report_name: str | None) -> str | None:
    """The worker group a read starting now counts for (a positioned read gets it from ``plan``)."""
    return ray.get(report_actor(report_name).current_token.remote()) if report_name else None


def snapshot(report_name: str) -> dict:
    return ray.get(report_actor(report_name).snapshot.remote())


# ----------------------------------------------------------------------------- how a report reads

def caption_stats(counts: dict) -> dict:
    """Average caption length (words) of the kept samples, and what the methods derive from the counts (their
    report hooks, rayvl.plugins: e.g. the caption lengths before a deformation)."""
    return {"avg_caption_words": _avg_words(counts), **plugins.report_statistics(counts)}


def _avg_words(counts: dict) -> float:
    return counts.get("caption_words", 0) / max(1, counts.get("samples_kept", 0))


def position_report(position: dict, resumed_at: list[int]) -> dict:
    """A final checkpoint's data position (data/position.py) as the data report shows it."""
    return {"rows_per_pass": {int(p): int(n) for p, n in sorted(position["rows_per_pass"].items())},
            "complete_passes": sorted(position["complete"]), "duplicates": int(position["duplicates"]),
            "resumed_at": list(resumed_at)}


def _position_line(pos: dict) -> str:
    passes = ", ".join(f"pass {p} {n} rows{' (complete)' if int(p) in pos['complete_passes'] else ''}"
                       for p, n in pos["rows_per_pass"].items())
    resumed = f"resumed at step {', '.join(map(str, pos['resumed_at']))}" if pos["resumed_at"] else "never resumed"
    return f"  trained on: {passes}; {pos['duplicates']} rows trained twice; {resumed}"


def drop_lines(report: dict) -> list[str]:
    counts = report.get("counts", {})
    lines = [f"  {k}: {v}" for k, v in sorted(counts.items())
             if k.startswith(("dropped_", "truncated_", "unreadable_"))]
    if counts.get("io_retries"):  # not a loss: each retry resumed at the byte it reached (data/shard_io.py)
        lines.append(f"  I/O errors retried: {counts['io_retries']} (each read resumed where it broke off)")
    return lines + [f"  bad shard {path}: {why}" for path, why in report.get("bad_shards", {}).items()]


def _caption_line(counts: dict) -> str:
    return f"  captions: {_avg_words(counts):.1f} words on average"


def _format_lines(counts: dict) -> list[str]:
    """``  images: jpg 3,900, png 100`` — the image members read, by format (rayvl.data.pipeline)."""
    formats = {k[len("format_"):]: v for k, v in sorted(counts.items()) if k.startswith("format_")}
    return [f"  images: {', '.join(f'{k} {v:,}' for k, v in formats.items())}"] if formats else []


def format_data_report(report: dict) -> str:
    counts = report.get("counts", {})
    per_pass = report.get("img2dataset_successes_per_pass")
    lines = [f"training: seen {counts.get('samples_seen', 0)}, kept {counts.get('samples_kept', 0)} "
             f"(all passes over the data; " + (f"a pass holds {per_pass} samples" if per_pass else
                                               "samples a pass unknown")
             + (f": {report['pass_size_from']}" if report.get("pass_size_from") else "") + ")",
             _caption_line(counts), *_format_lines(counts), *drop_lines(report)]
    if "position" in report:
        lines.insert(1, _position_line(report["position"]))
    lines += plugins.report_lines(report)  # the methods' own counts and streams
    if "eval" in report:
        held = report["eval"].get("counts", {})
        lines += [f"held-out: seen {held.get('samples_seen', 0)}, kept {held.get('samples_kept', 0)} "
                  f"(every rank reads the whole held-out split)", *drop_lines(report["eval"])]
    return "\n".join(lines)
