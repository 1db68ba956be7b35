"""Ready-to-paste client configurations for the agents docs/ describes (``clawrl serve --print-config
NAME``): this gateway's URL, its served model name and context window, the key read from an
environment variable the user sets (never the key itself)."""

from __future__ import annotations

import json
from enum import Enum

KEY_ENV = "CLAWRL_API_KEY"  # the variable the printed configs read the client's key from


def openclaw_config(base_url: str, model: str, context: int, max_tokens: int) -> str:
    """OpenClaw's provider block (``~/.openclaw/openclaw.json``, JSON5 of which JSON is a part)."""
    return json.dumps({
        "models": {"providers": {"clawrl": {
            "baseUrl": f"{base_url}/v1", "apiKey": f"${{{KEY_ENV}}}", "api": "openai-completions",
            "models": [{"id": model, "name": "clawrl", "reasoning": False, "input": ["text"], "contextWindow": context,
                        "maxTokens": max_tokens, "compat": {"supportsPromptCacheKey": True}}]}}},
        "agents": {"defaults": {"model": {"primary": f"clawrl/{model}"}}}}, indent=2)


def codex_config(base_url: str, model: str, context: int, max_tokens: int) -> str:
    """Codex CLI's ``~/.codex/config.toml`` (a custom provider over the Responses API)."""
    return (f'model = "{model}"\nmodel_provider = "clawrl"\nmodel_context_window = {context}\n\n'
            f'[model_providers.clawrl]\nname = "clawrl"\nbase_url = "{base_url}/v1"\n'
            f'env_key = "{KEY_ENV}"  # export {KEY_ENV}=<one of the gateway\'s API keys>\nwire_api = "responses"\n')


def openai_config(base_url: str, model: str, context: int, max_tokens: int) -> str:
    """Any program on the openai SDK: a client, and a session named by ``prompt_cache_key``."""
    return (f'import os\nfrom openai import OpenAI\n\nclient = OpenAI(base_url="{base_url}/v1", '
            f'api_key=os.environ["{KEY_ENV}"])\n'
            f'r = client.responses.create(model="{model}", input="Plan my week", max_output_tokens={max_tokens},\n'
            f'                            prompt_cache_key="alice-42")  # the session; context: {context} tokens\n'
            'print(r.output_text, r.model_extra["session_id"], r.model_extra["weight_version"])\n')


AGENT_CONFIGS = {"openclaw": openclaw_config, "codex": codex_config, "openai": openai_config}
Agent = Enum("Agent", {name: name for name in AGENT_CONFIGS}, type=str)  # the CLI's choices
