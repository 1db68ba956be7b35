"""Ports handed to servers that bind them later: drawn together they are distinct, and none is one of
the ports handed out before (a port drawn alone is free again once its probe closes, so two draws one
after the other can give the same port, and two servers then share it)."""

from __future__ import annotations

from clawrl.ports import free_ports


def test_ports_drawn_together_are_distinct_and_avoid_those_handed_out():
    first = free_ports(40)
    assert len(set(first)) == 40 and all(1024 <= p <= 65535 for p in first)
    second = free_ports(40, avoid=first)
    assert len(set(second)) == 40 and not set(first) & set(second)


def test_ports_come_from_below_the_ephemeral_range_and_skip_ports_in_use(monkeypatch, tmp_path):
    """An outgoing connection of any process takes a port from the ephemeral range: a port drawn there can be
    gone by the time its server binds it (seen as "address already in use" under two test processes)."""
    import socket

    from clawrl import ports

    low = ports._ephemeral_low()
    assert all(ports.PORT_FLOOR <= p < low - 22 for p in free_ports(50, span=22))
    [base] = free_ports(1, span=40)
    listening = []
    for port in (base, base + 1):
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        s.listen()
        listening.append(s)
    fake = tmp_path / "ip_local_port_range"
    fake.write_text(f"{base + 40}\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_LOW_FILE", fake)
    monkeypatch.setattr(ports, "PORT_FLOOR", base)
    try:
        drawn = free_ports(10)
        assert len(set(drawn)) == 10 and all(base + 2 <= p < base + 40 for p in drawn)
        fake.write_text(f"{base + 20}\t60999\n")  # too few below it: the kernel's draw, from above it
        assert all(p >= base + 20 for p in free_ports(10))
    finally:
        for s in listening:
            s.close()
