"""Per-source upsampling of a ``::`` mix (rayvl.data.mix, data.upsampling_factors): what each pass reads, a pass
resumed row for row, each read of a shard cropped its own way, and the config and resume checks."""
import uuid
from collections import Counter

import numpy as np
import pytest

from rayvl.config import ConfigError, DataConfig, load_config, upsampling_factors
from rayvl.data.mix import Mix
from rayvl.data.pipeline import Rows
from rayvl.data.position import DataPosition, unit_of
from rayvl.data.shards import Reading


def test_factors_of_one_read_every_shard_once_as_its_own_slot():
    mix = Mix.of((3, 4))
    assert not mix.upsampled and mix.n_slots == 7 and mix.signature == ()
    for shuffle in (False, True):
        shards, cycles = mix.table(5, seed=1, shuffle=shuffle)
        assert shards.tolist() == list(range(7)) and cycles.tolist() == [5] * 7  # the cycle is the pass


@pytest.mark.parametrize("shuffle", [False, True])
def test_each_source_is_read_its_factor_times_a_pass_and_its_shards_equally_over_passes(shuffle):
    mix = Mix.of((3, 5, 4), (2.0, 0.4, 1.5))
    assert mix.slots == (6, 2, 6) and mix.n_slots == 14 and mix.signature == ((3, 6), (5, 2), (4, 6))
    reads: Counter = Counter()
    seen_cycles: dict[int, list[int]] = {}
    for p in range(10):
        shards, cycles = mix.table(p, seed=7, shuffle=shuffle)
        assert ((0 <= shards[:6]) & (shards[:6] < 3)).all() and ((3 <= shards[6:8]) & (shards[6:8] < 8)).all()
        assert Counter(shards[:6].tolist()) == {0: 2, 1: 2, 2: 2}  # factor 2: every shard twice, every pass
        # factor 1.5 on 4 shards: 6 reads, no shard a third time before every other has its second
        assert max(Counter(shards[8:].tolist()).values()) <= 2
        reads.update(shards.tolist())
        for s, c in zip(shards.tolist(), cycles.tolist()):
            seen_cycles.setdefault(s, []).append(c)
    # over 10 passes: factor 0.4 on 5 shards is 20 reads, 4 of each; 1.5 on 4 shards is 60, 15 of each
    assert [reads[s] for s in range(3, 8)] == [4] * 5 and [reads[s] for s in range(8, 12)] == [15] * 4
    # a shard's reads are successive cycles, never one cycle twice: each read gets draws of its own
    assert all(c == list(range(len(c))) for c in seen_cycles.values())
    if not shuffle:  # in spec order: the 0.4 source's two slots walk its shards 3, 4, 5, 6, 7, 3, …
        assert [mix.table(p, 0, False)[0][6:8].tolist() for p in range(3)] == [[3, 4], [5, 6], [7, 3]]


def test_the_draws_are_the_seeds_and_a_half_source_reads_each_half_in_turn():
    mix = Mix.of((10,), (0.5,))
    first, second = (set(mix.table(p, seed=3, shuffle=True)[0].tolist()) for p in (0, 1))
    assert len(first) == len(second) == 5 and first | second == set(range(10))  # one cycle over two passes
    assert mix.table(0, 3, True)[0].tolist() == Mix.of((10,), (0.5,)).table(0, 3, True)[0].tolist()
    assert any(mix.table(p, 3, True)[0].tolist() != mix.table(p, 4, True)[0].tolist() for p in range(4))


def test_the_factors_are_checked_naming_the_key():
    two = DataConfig(train="/a/{00000..00009}.tar::/b/x.tar,/b/y.tar", upsampling_factors="1::4.5")
    assert upsampling_factors(two) == (1.0, 4.5) and upsampling_factors(DataConfig()) == ()
    assert upsampling_factors(DataConfig(upsampling_factors="2")) == (2.0,)  # the demo is one source
    # one source's factor, which --set and YAML read as a number
    assert load_config("configs/laion_adapt.yaml", ["data.upsampling_factors=2.5"]).data.upsampling_factors == "2.5"
    for bad, said in (("1", "1 factor for 2 sources"), ("1::2::3", "3 factors for 2 sources"),
                      ("1::0", "'0'"), ("1::-2", "'-2'"), ("1::x", "'x'"), ("1::nan", "'nan'"), ("inf::1", "'inf'")):
        with pytest.raises(ConfigError, match=rf"^data\.upsampling_factors: .*{said}"):
            upsampling_factors(DataConfig(train=two.train, upsampling_factors=bad))
    with pytest.raises(ValueError, match="upsampling factors for 2 sources"):
        Mix.of((3, 4), (1.0,))


def test_a_position_over_one_mix_is_refused_by_another():
    mixed = DataPosition(4, Mix.of((1, 2), (3.0, 0.5)).signature)
    back = DataPosition(4, ((1, 3), (2, 1)))
    back.load_state_dict(mixed.state_dict())
    for other in (DataPosition(4), DataPosition(4, ((2, 3), (1, 1)))):  # same reads a pass, another mix
        with pytest.raises(ValueError, match="data.upsampling_factors"):
            other.load_state_dict(mixed.state_dict())


def test_samples_per_pass_counts_each_source_times_its_reads(demo_dir):
    from rayvl.data.shards import samples_per_pass
    from rayvl.data.specs import check

    train = demo_dir / "train"
    found = check(f"{train}/00000.tar::{train}/00001.tar,{train}/00002.tar")
    assert found.sources == (1, 2) and "2 sources mixed (1 + 2 shards)" in found.summary
    plain, _ = samples_per_pass(0, found.paths)
    mixed, how = samples_per_pass(0, found.paths, Mix.of(found.sources, (3.0, 0.5)))
    assert plain == 384 and mixed == 3 * 128 + 128 and how.startswith("upsampled")


def test_a_mixed_stream_resumed_mid_pass_reads_each_slot_once_each_read_cropped_its_own_way(ray_local, demo_dir):
    """Shard 0 three times a pass, shards 1 and 2 one of them a pass: two passes of 4 slots, stopped after 200 rows
    and resumed from the merged position — each pass's 512 rows exactly once, shard 0's keys three times a pass
    with three crops, shards 1 and 2 one in each pass."""
    import ray

    from rayvl import assets
    from rayvl.data import shards
    from rayvl.data.report import create_report, report_actor

    train = demo_dir / "train"
    paths = [str(train / f"0000{i}.tar") for i in range(3)]
    mix = Mix.of((1, 2), (3.0, 0.5))

    def consume(name, position, limit):
        ray.get(create_report(name).restore.remote(uuid.uuid4().hex, position, mix.n_slots, mix.signature))
        ds = shards.read_shards(paths, Rows(image_size=16, crop_scale_min=0.3, train=True, seed=3,
                                            tokenizer_path=str(assets.text_model_path("minilm-l6")), max_tokens=8),
                                Reading(read_cpus=0.5, batch_size=32, shuffle=True, report_name=name, passes=2,
                                        seed=3, positioned=True), columns=["row", "key", "image"], mix=mix)
        got = []
        for batch in ds.iter_batches(batch_size=20, batch_format="numpy"):
            got += list(zip(batch["row"].tolist(), batch["key"].tolist(), batch["image"]))
            if limit and len(got) >= limit:
                break
        return got

    first_name, second_name = (f"mix-test-{uuid.uuid4().hex[:6]}" for _ in range(2))
    pos = DataPosition(mix.n_slots, mix.signature)
    before = consume(first_name, None, 200)
    pos.trained(np.array([r for r, _, _ in before]))
    pos.merge(pos.take_pending())
    actor = report_actor(first_name)
    pos.report, pos.execution = ray.get(actor.settle.remote(pos.settle(ray.get(actor.unit_rows.remote(
        list(pos.partial))))))
    after = consume(second_name, pos.state_dict(), 0)
    pos.trained(np.array([r for r, _, _ in after]))
    pos.merge(pos.take_pending())
    assert pos.duplicates == 0 and dict(pos.rows_per_pass) == {0: 512, 1: 512}
    pos.settle(ray.get(report_actor(second_name).unit_rows.remote(list(pos.partial))))
    assert pos.complete == [0, 1]

    rows = {r: (k, img) for r, k, img in before + after}  # the rows trained on, once each by id
    by_pass = {p: Counter(k for r, (k, _) in rows.items() if unit_of(np.int64(r))[0] == p) for p in (0, 1)}
    keys_of = {i: {k for k in by_pass[0] | by_pass[1] if k.startswith(f"{i:05d}")} for i in range(3)}
    assert all(len(keys_of[i]) == 128 for i in range(3))  # img2dataset keys: shard number, then row
    for p in (0, 1):
        assert {by_pass[p][k] for k in keys_of[0]} == {3}
    halves = [{k for k in keys_of[1] | keys_of[2] if by_pass[p][k]} for p in (0, 1)]
    assert {frozenset(h) for h in halves} == {frozenset(keys_of[1]), frozenset(keys_of[2])}
    crops = [img for r, (k, img) in rows.items() if k == min(keys_of[0]) and unit_of(np.int64(r))[0] == 0]
    assert len(crops) == 3 and len({c.tobytes() for c in crops}) == 3


def test_the_dry_run_counts_the_upsampled_pass_and_a_budget_in_passes_by_it(demo_dir, tmp_path):
    from rayvl.dry_run import describe

    train = demo_dir / "train"
    cfg = load_config("configs/laion_adapt.yaml", [
        f"data.train={train}/00000.tar::{train}/00001.tar,{train}/00002.tar", f"data.eval={demo_dir / 'eval'}",
        "data.upsampling_factors=3::0.5", "train.max_passes=2", "train.warmup_steps=2",
        f"train.storage_path={tmp_path}"])
    said = describe(cfg)
    assert "a pass reads 4 shards: source 1: 1 shard × 3 = 3 reads; source 2: 2 shards × 0.5 = 1 read" in said
    assert "512 samples a pass (upsampled" in said  # 3 × 128 + 256 × 1/2: the demo's shards hold 128
    assert "8 steps a pass; train.max_steps=16 is 2.00 passes" in said  # 2 workers × 32 a step
    # the demo as the run writes it: 4 shards of 1,000; 0.5 reads 2 of them a pass
    demo = describe(load_config("configs/laion_adapt.yaml", ["data.upsampling_factors=0.5"]))
    assert "2,000 samples a pass (the demo's training split × 2/4 shards" in demo


def test_a_factor_the_shard_count_cannot_give_is_refused_and_so_is_a_resume_that_moves_the_slots(tmp_path):
    """1.4 on one shard would read it once (1×), 0.1 on 4 shards once (0.25×): refused, naming the factors a source
    can take. A resume with other factors is refused; with a fractional factor so is another seed or shuffle (they
    draw which shards a slot reads), with whole factors a new seed is the user's to choose."""
    from rayvl.train.datasets import mix_of
    from rayvl.train.run_dir import check_resumable

    two = ["data.train=/a/{0..2}.tar::/b/0.tar"]
    with pytest.raises(ConfigError, match=r"^data\.upsampling_factors: source 2 of data.train has 1 shard: factor 1\.4 "
                                          r"would read 1 a pass \(1×\) .* give 1 or 2, or split"):
        mix_of(load_config(None, two + ["data.upsampling_factors=1::1.4"]), (3, 1))
    with pytest.raises(ConfigError, match=r"the demo's training split has 4 shards: factor 0\.1 .* give 0\.25$"):
        mix_of(load_config(None, ["data.upsampling_factors=0.1"]), (4,))
    assert mix_of(load_config(None, two + ["data.upsampling_factors=2::1.05"]), (3, 1)).slots == (6, 1)

    def resume(started: list[str], now: list[str], sources=()):
        meta = {"step": 5, "config": load_config(None, two + started).to_dict()}
        check_resumable(load_config(None, two + now), meta, str(tmp_path), sources)

    resume(["data.upsampling_factors=1::1"], [])  # all ones is no mix
    resume(["data.upsampling_factors=1::3"], ["data.upsampling_factors=1.0::3", "train.seed=7"])
    # with the shard counts (as a run's plan has them): factors that give the same slots are the same position,
    # and a seed draws nothing where every pass is whole cycles or the shards are read in spec order
    resume(["data.upsampling_factors=1::1.04"], ["train.seed=7"], (3, 1))
    resume(["data.upsampling_factors=1::0.5", "data.shuffle_files=false"],
           ["data.upsampling_factors=1::0.5", "data.shuffle_files=false", "train.seed=7"], (3, 4))
    with pytest.raises(ConfigError, match=r"^train.seed: 7 differs from 0"):
        resume(["data.upsampling_factors=1::0.5"], ["data.upsampling_factors=1::0.5", "train.seed=7"], (3, 4))
    for started, now, key in ((["data.upsampling_factors=1::3"], ["data.upsampling_factors=1::2"],
                               "data.upsampling_factors"),
                              (["data.upsampling_factors=1::0.5"], ["data.upsampling_factors=1::0.5", "train.seed=7"],
                               "train.seed"),
                              (["data.upsampling_factors=1::0.5"],
                               ["data.upsampling_factors=1::0.5", "data.shuffle_files=false"], "data.shuffle_files")):
        with pytest.raises(ConfigError, match=rf"^{key}: .* the value the run started with .* data position"):
            resume(started, now)
