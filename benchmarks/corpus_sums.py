"""Corpus statistics (BoW's document frequencies, TOnICS's rows per class) two ways over the same shards, side by
side in one local Ray: a Ray Data ``groupby(key).sum()`` of each batch's partial sums (what rayvl did before), and
``rayvl.data.shards.sum_over_shards``, the same partial sums added up by the driver as they stream in (pyarrow's
``group_by``). Each way is timed twice a round — the pass itself, then the same plain read of the shards right
after it (does the pass leave something behind that slows the next execution?) — over interleaved rounds; the
first round warms Ray's worker processes up and is left out of the medians.

    .venv/bin/python benchmarks/corpus_sums.py [--shards 4] [--samples 1000] [--rounds 4] [--cpus 2]

The shards are the demo's (rayvl.data.demo), written to a temporary folder. Both ways must give the same sums.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def by_groupby(paths: list[str], fn, fn_kwargs: dict, key: str, value: str, reading) -> dict:
    """The earlier way: the partial sums grouped by a Ray Data hash shuffle, as rayvl's ``_grouped`` did."""
    from rayvl.data.shards import ShardStream, read

    rows = read(ShardStream(paths, reading, columns=("key", "txt", "json"))).map_batches(
        fn, batch_format="numpy", num_cpus=reading.read_cpus, fn_kwargs=fn_kwargs)
    grouped = rows.groupby(key, num_partitions=max(1, min(200, len(paths) // 8)))
    return {r[key]: int(r[f"sum({value})"]) for r in grouped.sum(value).iter_rows()}


def plain_read(paths: list[str], reading) -> int:
    from rayvl.data.shards import ShardStream, read

    return sum(len(b["key"]) for b in read(ShardStream(paths, reading, columns=("key", "txt"))).iter_batches(
        batch_size=None, batch_format="numpy"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--samples", type=int, default=1000, help="samples a shard")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--cpus", type=int, default=2, help="the local Ray's CPUs")
    args = p.parse_args()

    import ray

    from rayvl import session
    from rayvl.data.demo import write_demo
    from rayvl.data.shards import Reading, sum_over_shards
    from rayvl.data.specs import resolve_shards
    from rayvl.methods.bow.deformation import base_word_counts

    with tempfile.TemporaryDirectory() as tmp:
        demo = write_demo(Path(tmp) / "demo", samples=args.shards * args.samples, eval_samples=64, seed=0,
                          shard_size=args.samples)
        paths = resolve_shards(str(demo / "train"))
        session.connect(num_cpus=args.cpus, verbose=False, include_dashboard=False)
        reading = Reading()
        columns = ("key", "txt", "json")
        ways = {"Ray Data groupby": by_groupby,
                "sum_over_shards (driver fold)": lambda *a: sum_over_shards(a[0], columns, *a[1:])}
        kwargs = {"seed": 0, "fraction": 1.0}
        times = {name: {"pass": [], "next read": []} for name in ways}
        results = {}
        for r in range(args.rounds):
            for name, way in (ways.items() if r % 2 == 0 else reversed(ways.items())):
                t = time.perf_counter()
                results[name] = way(paths, base_word_counts, kwargs, "word", "df", reading)
                t1 = time.perf_counter()
                rows = plain_read(paths, reading)
                t2 = time.perf_counter()
                if r:
                    times[name]["pass"].append(t1 - t)
                    times[name]["next read"].append(t2 - t1)
                print(f"round {r}: {name}: pass {t1 - t:.2f} s, next read of {rows} rows {t2 - t1:.2f} s",
                      file=sys.stderr)
        ray.shutdown()
    same = len({tuple(sorted(v.items())) for v in results.values()}) == 1
    print(f"\ndocument frequencies over {args.shards} demo shards × {args.samples} samples, local Ray of "
          f"{args.cpus} CPUs, medians of rounds 2–{args.rounds}\n")
    print("| | the pass: s | the plain read right after it: s |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t['pass']):.2f} | {statistics.median(t['next read']):.2f} |")
    print(f"\nsame sums: {'yes' if same else 'NO'} ({len(next(iter(results.values())))} keys)")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
