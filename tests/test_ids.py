"""clawrl.ids.new_id: uuid4().hex's shape, unique, and different in a forked child."""

from __future__ import annotations

import os

from clawrl.ids import new_id


def test_ids_are_32_hex_chars_and_unique():
    ids = [new_id() for _ in range(100_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and set(i) <= set("0123456789abcdef") for i in ids[:1000])
    assert any(i.startswith("0") for i in ids)  # zero-padded: leading zero bits are kept


def test_a_forked_child_does_not_repeat_the_parents_ids():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: its first id after the fork
        os.write(w, new_id().encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 64).decode()
    os.waitpid(pid, 0)
    parent = [new_id() for _ in range(1000)]
    assert len(child) == 32 and child not in parent
