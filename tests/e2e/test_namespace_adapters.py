"""Per-user learning as a user drives it: `clawrl serve` with two keys and CLAWRL__PPO__ADAPTERS=namespace, turns
from key A only, `clawrl judge`, then `clawrl train --engine-url <gateway>/engine`; afterwards the log-probs
/v1/completions returns for a fixed text (echo, logprobs) have changed for A and are bit-identical for B.

It needs the serving half of per-namespace adapters: the embedded engine serving LoRA adapters by name
(``load_lora_adapter``, ``lora_path`` per request). Without it the test is skipped, saying so."""

from __future__ import annotations

import subprocess
import sys

import pytest
from openai import OpenAI

from clawrl.config import dump_toml
from clawrl.ids import namespace_for_key
from clawrl.storage.catalog import run_query
from tests.utils.gateway_process import ServerProcess, free_port, serve_env
from tests.utils.samples import two_turn_session
from tests.utils.waiting import HANG_S, run_to_end

TEXT = "The capital of France is Paris, and the capital of Italy is Rome."
KEYS, ADMIN = ("key-alpha-1", "key-beta-2"), "admin-key-3"


def fixed_text_logprobs(client: OpenAI) -> list[float]:
    """The served model's log-probs of TEXT's tokens (the first has none)."""
    r = client.completions.create(model="clawrl-policy", prompt=TEXT, max_tokens=1, temperature=0, echo=True,
                                  logprobs=0)
    return r.choices[0].logprobs.token_logprobs[1:-1]  # the prompt's, after its first token; not the sampled one


@pytest.mark.timeout(HANG_S)
def test_training_one_keys_adapter_changes_its_logprobs_and_leaves_the_other_keys_bit_identical(
        prefect_harness, make_settings, tmp_path, model_cache):
    from clawrl.engine.embedded import EmbeddedEngine

    if not hasattr(EmbeddedEngine, "load_lora_adapter"):
        pytest.skip("needs the embedded engine's multi-LoRA serving (load_lora_adapter, lora_path per request)")
    from prefect.settings import PREFECT_API_URL

    port = free_port()
    s = make_settings({"server.api_port": port, "ppo.rollout_batch_size": 2, "ppo.advantage_estimator": "grpo",
                       "ppo.kl_coef": 0.0, "ppo.lr": 1e-3, "gate.enabled": False, "prm.backend": "rule",
                       "engine.max_context_len": 512})
    conf = tmp_path / "clawrl.toml"
    conf.write_text(dump_toml(s))
    env = {**serve_env(s.storage.data_root, model_cache, server__open_mode="false", ppo__adapters="namespace"),
           "CLAWRL_API_KEYS": ",".join(KEYS), "CLAWRL_ADMIN_KEYS": ADMIN,
           "PREFECT_API_URL": str(PREFECT_API_URL.value()), "COLUMNS": "300"}  # the session's Prefect server

    def clawrl(*args: str) -> subprocess.CompletedProcess:
        return run_to_end([sys.executable, "-m", "clawrl.cli", *args], env=env)

    gw = ServerProcess(["serve", "-c", str(conf), "--port", str(port)], port, env, tmp_path / "serve.log")
    gw.start()
    try:
        gw.wait_ready()
        alpha, beta = (OpenAI(base_url=f"{gw.url}/v1", api_key=k, max_retries=0) for k in KEYS)
        before = {"A": fixed_text_logprobs(alpha), "B": fixed_text_logprobs(beta)}
        assert before["A"] == before["B"]  # neither has an adapter yet: both get the base
        two_turn_session(alpha, "a-1", "What is the capital of France?", "thanks, perfect!")  # +1
        two_turn_session(alpha, "a-2", "Name a primary color.", "no, shorter please")  # -1

        judged = clawrl("judge", "-c", str(conf))
        assert judged.returncode == 0, judged.stdout + judged.stderr
        trained = clawrl("train", "-c", str(conf), "--engine-url", f"{gw.url}/engine")
        assert trained.returncode == 0, trained.stdout + trained.stderr
        a = namespace_for_key(KEYS[0])
        [line] = [x for x in trained.stdout.splitlines() if x.startswith("adapter ")]
        assert line.startswith(f"adapter {a}@v1: ") and line.endswith("sync: 1 worker holds " + f"{a}@v1"), line

        after = {"A": fixed_text_logprobs(alpha), "B": fixed_text_logprobs(beta)}
        assert after["B"] == before["B"]  # bit-identical: B's requests never touch A's adapter
        assert after["A"] != before["A"] and len(after["A"]) == len(before["A"])
    finally:
        assert gw.stop() in (0, -15)
    rows = run_query(s.storage.data_root, "SELECT namespace, adapter, count(*) AS n FROM turns "
                                          "WHERE request_params LIKE '%completions%' GROUP BY ALL").to_pylist()
    b = namespace_for_key(KEYS[1])  # every turn records the adapter that served it
    assert sorted((r["namespace"], r["adapter"] or "", r["n"]) for r in rows) == sorted(
        [(a, "", 1), (a, f"{a}@v1", 1), (b, "", 2)])
