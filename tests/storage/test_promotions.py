"""The line of champions a rollback walks back, and the versions kept from serving on purpose."""

from __future__ import annotations

from clawrl.storage.promotions import _walk_line


def _log(*rows: tuple[str, str, str]) -> list[dict]:
    return [{"action": a, "weight_version": v, "champion_version": c} for a, v, c in rows]


def test_promoting_the_champion_again_leaves_the_line_alone_so_rollback_reaches_the_one_before():
    # gate-promote 1, gate-promote 2, `clawrl promote 2` (already the champion), rollback
    line, unserved = _walk_line(_log(("promote", "1", "0"), ("promote", "2", "1"), ("promote", "2", "2")))
    assert line == ["0", "1", "2"] and unserved == set()
    line, unserved = _walk_line(_log(("promote", "1", "0"), ("promote", "2", "1"), ("promote", "2", "2"),
                                     ("rollback", "1", "2")))
    assert line == ["0", "1"] and unserved == {"2"}


def test_refused_and_rolled_back_from_versions_are_unserved_until_promoted_again():
    log = _log(("promote", "1", "0"), ("refuse", "2", "1"), ("promote", "3", "1"), ("rollback", "1", "3"))
    assert _walk_line(log) == (["0", "1"], {"2", "3"})
    # a rollback to a version never on the line keeps the line below it; the one served away from is unserved
    assert _walk_line(log + _log(("rollback", "2", "1"))) == (["0", "1", "2"], {"3", "1"})
    assert _walk_line(log + _log(("promote", "3", "1"))) == (["0", "1", "3"], {"2"})
