"""Judge engines behind SGLang's router (``[prm] engine_url`` names the router; `clawrl up --judge-engines 2`
starts the same), separate from the policy engines: two `clawrl engine` processes holding the initial
weights; a judge run's PRM votes spread over both (by the engines' own request counts), no weights are
loaded in the judging process, and with one engine SIGKILLed the next run is judged whole by the other,
without a judge error."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from clawrl.config import dump_toml
from clawrl.gateway.routes import create_app
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.e2e.test_engine_router import engines_behind_router
from tests.utils.gateway_process import serve_env
from tests.utils.gateway_server import running_gateway
from tests.utils.samples import two_turn_session
from tests.utils.waiting import HANG_S


def _done(url: str) -> int:
    """Requests an engine process finished, by its own count (SGLang's /server_info internal_states)."""
    return httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]["requests_done"]


def _log_sessions(s, tiny_engine, tag: str, n: int) -> None:
    store = DataStore(s.storage.data_root)
    with running_gateway(create_app(s, engine=tiny_engine, tokenizer=tiny_engine.tokenizer, store=store)) as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        for i in range(n):
            two_turn_session(client, f"{tag}-{i}", f"Name a primary color ({i}).",
                             "thanks, that's great!" if i % 2 else "no, that's wrong, answer in one word")
    store.close()


def _votes(s, run_hash: str) -> int:
    rows = run_query(s.storage.data_root,
                     f"select raw_outputs from verdicts where judge_config_hash = '{run_hash}'").to_pylist()
    return sum(len(json.loads(r["raw_outputs"])) for r in rows)


@pytest.mark.timeout(HANG_S)
def test_judge_votes_spread_over_the_judge_engines_and_a_dead_one_is_left_out(
        prefect_harness, make_settings, tiny_engine, model_cache, tmp_path, monkeypatch):
    from clawrl.engine import embedded
    from clawrl.flows import common
    from clawrl.flows.judge import judge_flow

    env = serve_env(tmp_path / "engines", model_cache, engine__max_context_len="2048")
    with engines_behind_router(tmp_path, {"judge0": env, "judge1": env}) as (engines, router_url):
        urls = [e.url for e in engines]
        s = make_settings({"server.open_mode": True, "prm.backend": "engine", "prm.engine_url": router_url,
                           "prm.judge_samples": 2, "prm.max_new_tokens": 8, "ppo.advantage_estimator": "grpo",
                           "engine.max_context_len": 2048})
        conf = tmp_path / "judge.toml"
        conf.write_text(dump_toml(s))
        _log_sessions(s, tiny_engine, "a", 4)

        def no_loading(*a, **k):
            raise AssertionError("a judge run loaded model weights")

        monkeypatch.setattr(embedded.EmbeddedEngine, "__init__", no_loading)
        common.close_all()  # no frozen engine made earlier in this process
        before = [_done(u) for u in urls]
        out = judge_flow(config_path=str(conf))
        served = [_done(u) - b for u, b in zip(urls, before)]
        assert out["judged"] == 8 and out["fates"].get("judge_error", 0) == 0, out
        votes = _votes(s, out["judge_config_hash"])
        assert votes == 2 * 4  # two votes for each of the 4 turns with a next state
        assert sum(served) == votes and min(served) >= 1, served  # both engines judged

        engines[1].kill()
        _log_sessions(s, tiny_engine, "b", 2)
        before = [_done(urls[0])]
        out = judge_flow(config_path=str(conf))
        assert out["judged"] == 4 and out["fates"].get("judge_error", 0) == 0, out
        assert _votes(s, out["judge_config_hash"]) == votes + 2 * 2
        assert _done(urls[0]) - before[0] == 2 * 2  # the dead engine's share went to the live one
