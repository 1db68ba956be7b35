"""A real Codex CLI session (npm package ``@openai/codex``, its native binary) against ``clawrl serve``.

Runs when ``make codex-test`` has installed Codex CLI into ``.tools/`` (``make test`` then runs it
too); skips otherwise. Codex is configured with what a user pastes: the config.toml ``clawrl serve
--print-config codex`` prints (docs/codex.md), run for real and used as printed - clawrl as a custom
model provider over the Responses API (``wire_api = "responses"``, the only wire API this Codex
speaks), the context clawrl serves, the key from the environment. The served model is
``tiny-long`` (random init, 32k context: Codex's own prompt is ~40 KB); the turns that need a
capable model - the shell tool call and the answer after its output - come from a generate hook
(tests/utils/codex_hook.py), everything else from the engine.

The task: list the files of a workspace. Codex sends the request (its developer instructions, nine
tools of which two are not functions, its thread id as ``prompt_cache_key``), runs the ``ls`` the
model asks for in its shell tool, sends the output back and prints the answer. The session log must
hold one session (Codex's thread), the tool call's next state must be the command's output, and both
turns must be trainable main turns with aligned log-probs.
"""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest

from tests.utils.gateway_process import REPO, agent_serve, printed_config

CODEX = REPO / ".tools/codex/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
CONTEXT = 32768
CODEX_RUN_S = 1800  # a generous cap on one `codex exec` (minutes on 2 busy cores)

pytestmark = pytest.mark.skipif(not CODEX.is_file(), reason=(
    "Codex CLI is not installed: `make codex-test` installs it into .tools/ and runs this test"))


@pytest.fixture
def clawrl_serve(tmp_path, model_cache):
    with agent_serve(tmp_path, model_cache, "tests.utils.codex_hook:generate", CONTEXT) as server:
        yield server


def run_codex(server, tmp_path, *config: str) -> list[dict]:
    """``codex exec`` against ``server`` asked to list a workspace of two files (``config``: more -c
    overrides); its JSONL events."""
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "alpha.txt").write_text("a\n")
    (workspace / "beta.txt").write_text("b\n")
    home = tmp_path / "codex-home"
    home.mkdir()
    printed = printed_config(server, "codex")
    assert f"model_context_window = {CONTEXT}\n" in printed  # the context clawrl serves
    (home / "config.toml").write_text(printed)
    env = {**os.environ, "CODEX_HOME": str(home), "CLAWRL_API_KEY": "sk-clawrl", "NO_COLOR": "1"}
    out = subprocess.run([str(CODEX), "exec", "--json", "--skip-git-repo-check", "--sandbox", "danger-full-access",
                          *config,
                          "Please list the files in this directory and tell me the first one."],
                         cwd=workspace, env=env, capture_output=True, text=True, timeout=CODEX_RUN_S)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_codex_exec_session_through_clawrl(clawrl_serve, tmp_path):
    from clawrl.storage.catalog import run_query
    from tests.utils.codex_hook import ANSWER

    events = run_codex(clawrl_serve, tmp_path)
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    command = next(i for i in items if i["type"] == "command_execution")
    assert command["command"].endswith("ls") and "alpha.txt" in command["aggregated_output"]
    assert [i["text"] for i in items if i["type"] == "agent_message"] == [ANSWER.format(name="alpha.txt")]
    thread = next(e["thread_id"] for e in events if e.get("type") == "thread.started")

    # one session: Codex's thread (its prompt_cache_key), both turns main and trainable (the session
    # log is read first: the gateway then writes what it holds to the tables run_query reads)
    log = httpx.get(f"{clawrl_serve.url}/v1/sessions/{thread}", timeout=30).json()["turns"]
    data_root = clawrl_serve.env["CLAWRL__STORAGE__DATA_ROOT"]
    turns = run_query(data_root, "select * from turns order by turn_index").to_pylist()
    assert {t["session_id"] for t in turns} == {thread}
    main = [t for t in turns if t["turn_type"] == "main"]
    assert len(main) == 2 and json.loads(main[0]["tool_calls"])[0]["function"] == {
        "name": "exec_command", "arguments": '{"cmd": "ls"}'}
    assert main[1]["text"] == ANSWER.format(name="alpha.txt")
    for t in main:
        assert json.loads(t["request_params"])["api"] == "responses"
        assert len(t["output_ids"]) == len(t["rollout_logprobs"]) > 0 and t["weight_version"] == "0"
    # the tools a model can call were offered; the hosted web search and the sub-agent namespace were not
    offered = {t["function"]["name"] for t in json.loads(main[0]["request_tools"])}
    assert "exec_command" in offered and not {"web_search", "multi_agent_v1"} & offered
    # the tool call's next state is the command's output, as Codex sent it back
    assert [t["has_next_state"] for t in log if t["turn_type"] == "main"] == [True, None]
    [ns] = run_query(data_root, f"select * from next_states where turn_id = '{main[0]['turn_id']}'").to_pylist()
    [tool] = json.loads(ns["messages"])
    assert tool["role"] == "tool" and "alpha.txt" in tool["content"] and "beta.txt" in tool["content"]
    assert "tools of type 'web_search' are left out" in (tmp_path / "serve.log").read_text()


def test_codex_compaction_is_a_side_turn_of_its_thread(clawrl_serve, tmp_path):
    """Codex compacts when a response's usage passes model_auto_compact_token_limit (its ~6.5k-token prompt
    passes 6000 at once): between the tool call and the answer it sends a compaction request
    (request_kind "compaction" in x-codex-turn-metadata), then the turn again with its summary in
    place of the tool call. The compaction is a side turn of the same thread; the tool call's next state
    is the summary message that followed its request, not the whole conversation."""
    from clawrl.storage.catalog import run_query
    from tests.utils.codex_hook import ANSWER, SUMMARY

    events = run_codex(clawrl_serve, tmp_path, "-c", "model_auto_compact_token_limit=6000")
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    assert [i["text"] for i in items if i["type"] == "agent_message"] == [ANSWER.format(name="alpha.txt")]
    thread = next(e["thread_id"] for e in events if e.get("type") == "thread.started")
    log = httpx.get(f"{clawrl_serve.url}/v1/sessions/{thread}", timeout=30).json()["turns"]
    assert [(t["turn_type"], t["text"]) for t in log][1:] == [
        ("side", SUMMARY.format(names="alpha.txt and beta.txt")), ("main", ANSWER.format(name="alpha.txt"))]
    assert log[0]["turn_type"] == "main" and log[0]["has_next_state"] and log[1]["has_next_state"] is None
    data_root = clawrl_serve.env["CLAWRL__STORAGE__DATA_ROOT"]
    [ns] = run_query(data_root, "select * from next_states where turn_index = 0").to_pylist()
    [summary] = json.loads(ns["messages"])
    assert ns["reason"] == "next_request_realigned" and summary["role"] == "user"
    assert SUMMARY.format(names="alpha.txt and beta.txt") in str(summary["content"])
