"""Ports handed to servers that bind them later: drawn together they are distinct, and none is one of
the ports handed out before (a port drawn alone is free again once its probe closes, so two draws one
after the other can give the same port, and two servers then share it)."""

from __future__ import annotations

from clawrl.serving import free_ports


def test_ports_drawn_together_are_distinct_and_avoid_those_handed_out():
    first = free_ports(40)
    assert len(set(first)) == 40 and all(1024 <= p <= 65535 for p in first)
    second = free_ports(40, avoid=first)
    assert len(set(second)) == 40 and not set(first) & set(second)
