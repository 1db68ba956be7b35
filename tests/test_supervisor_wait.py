"""`clawrl up`, the demo and the benches wait for the services they start on progress, not on a fixed budget:
a start that keeps using CPU or writing its log is waited for however long it takes, one that stops doing
anything is given up after ``stall_s``, one that exits is reported at once with its log."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from clawrl.ports import free_port
from clawrl.supervisor import Service, start, stop, wait_healthy

# A server that works (burns CPU) for ``delay`` seconds before it listens, or exits at once with "bad".
SERVER = """
import http.server, sys, time
delay, port = float(sys.argv[1]), int(sys.argv[2])
if delay < 0:
    print("bad: refused to start", flush=True); sys.exit(3)
end = time.monotonic() + delay
while time.monotonic() < end:
    sum(range(10000))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _service(tmp_path, delay: float) -> Service:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    svc = Service("toy", [sys.executable, str(script), str(delay), str(port)], f"http://127.0.0.1:{port}/",
                  f"http://127.0.0.1:{port}")
    start(svc, tmp_path / "logs", {})
    return svc


def test_a_start_longer_than_the_stall_limit_is_waited_for_while_it_works(tmp_path):
    svc = _service(tmp_path, delay=4.0)
    try:
        began = time.monotonic()
        wait_healthy(svc, stall_s=1.5)  # 4 s of work, never 1.5 s without progress
        assert time.monotonic() - began >= 3.5
    finally:
        stop(svc)


def test_a_start_that_makes_no_progress_is_given_up(tmp_path):
    svc = _service(tmp_path, delay=600.0)
    try:
        svc.proc.send_signal(signal.SIGSTOP)  # alive, but neither CPU nor log moves
        with pytest.raises(RuntimeError, match=r"toy not healthy at .*: no progress \(CPU, log\) for 2 s"):
            wait_healthy(svc, stall_s=2.0)
    finally:
        svc.proc.send_signal(signal.SIGCONT)
        stop(svc)


def test_a_service_that_exits_is_reported_with_its_log(tmp_path):
    svc = _service(tmp_path, delay=-1)
    with pytest.raises(RuntimeError, match=r"(?s)toy exited with code 3:\nbad: refused to start"):
        wait_healthy(svc, stall_s=600)
