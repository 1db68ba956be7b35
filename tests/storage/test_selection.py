from clawrl.storage.selection import parse_version, select_batch, staleness


def s(i, v):
    return {"sample_id": f"s{i}", "weight_version": v}


def test_parse_version_treats_sglang_default_as_zero():
    assert parse_version("7") == 7 and parse_version("default") == 0 and parse_version(None) == 0


def test_staleness_counts_versions():
    assert staleness("3", 5) == 2 and staleness("5", 5) == 0


def test_select_takes_oldest_fresh_and_reports_stale():
    samples = [s(0, "0"), s(1, "1"), s(2, "4"), s(3, "5"), s(4, "5")]
    # current 5, cap 2: versions 0 and 1 are 5 and 4 steps old -> too stale
    batch, stale = select_batch(samples, current_version=5, batch_size=2, max_staleness=2)
    assert [x["sample_id"] for x in batch] == ["s2", "s3"]
    assert [x["sample_id"] for x in stale] == ["s0", "s1"]


def test_select_waits_for_a_full_batch():
    batch, stale = select_batch([s(0, "3")], current_version=3, batch_size=2, max_staleness=0)
    assert batch is None and stale == []


def test_samples_of_the_serving_champion_are_never_too_stale():
    # the gate refused versions 4 and 5: the trainer is at 5, users are still served version 3
    samples = [s(0, "2"), s(1, "3"), s(2, "3")]
    batch, stale = select_batch(samples, current_version=5, batch_size=2, max_staleness=1, serving_version=3)
    assert [x["sample_id"] for x in batch] == ["s1", "s2"] and [x["sample_id"] for x in stale] == ["s0"]
    batch, stale = select_batch(samples, current_version=5, batch_size=2, max_staleness=1)  # without it: all stale
    assert batch is None and len(stale) == 3


def test_take_order_picks_the_batch_and_the_batch_keeps_the_given_order():
    # given oldest first by time; take_order (the turns' own order, not their time) picks s3, s0, s2
    samples = [{**s(i, "1"), "take_order": r} for i, r in enumerate([2, 5, 3, 1, 4])]
    batch, stale = select_batch(samples, current_version=1, batch_size=3, max_staleness=1)
    assert [x["sample_id"] for x in batch] == ["s0", "s2", "s3"] and stale == []
    # samples without a take_order (a [hooks] sample_source's) are taken in their order
    batch, _ = select_batch([s(i, "1") for i in range(5)], current_version=1, batch_size=3, max_staleness=1)
    assert [x["sample_id"] for x in batch] == ["s0", "s1", "s2"]
