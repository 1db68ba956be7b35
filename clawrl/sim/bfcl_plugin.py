"""clawrl's entry in BFCL's model registry. BFCL's own Python runs this file (its environment under
``.tools/bfcl``, made by `make bfcl`); clawrl never imports it. Only the standard library and
``bfcl_eval`` are imported here.

    python bfcl_plugin.py generate|evaluate ARGS   BFCL's CLI, with the model ``clawrl`` registered
    python bfcl_plugin.py serve                    clawrl's gate evaluator: JSON requests, one a line

The entry ``clawrl`` (model name ``clawrl-policy``) is BFCL's function-calling mode through
``/v1/chat/completions`` with ``tools``: :class:`ClawrlHandler` is BFCL's ``OpenAICompletionsHandler``
(``OPENAI_BASE_URL`` points it at the gateway) with a fixed seed and answer budget. BFCL adds no system
prompt in this mode; the prompt around the tools is the gateway's chat adapter's (``clawrl.chat``).
It is registered at run time, in this process, in BFCL's ``MODEL_CONFIG_MAPPING``: the installed
package is never changed.

``serve`` answers two requests, each a JSON object on a line of stdin, each answer a line of stdout:
``{"op": "sample", "counts": {category: n}, "seed": s}`` -> the prompts of n entries of each category
drawn with ``random.Random(f"{seed}:{category}")`` from its sorted ids (all of them, in order, for n 0
or n >= their number): ``id``, ``category``, ``messages``, ``tools`` as the handler sends them;
``{"op": "check", "id": ..., "result": ...}`` -> ``{"valid": bool, "error_type": ...}`` from BFCL's
checker, where ``result`` is what the handler records for a reply: a list of ``{name: JSON arguments}``
for tool calls, else the reply's text; ``{"op": "describe"}`` -> the handler and what it pins.
"""

from __future__ import annotations

import json
import random
import sys

from bfcl_eval.constants.enums import Language, ReturnFormat
from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING, ModelConfig
from bfcl_eval.model_handler.api_inference.openai_completion import OpenAICompletionsHandler

REGISTRY_NAME = "clawrl"
MODEL_NAME = "clawrl-policy"
SEED = 0  # every request sampled with this seed: a rerun of the same weights gives the same answers
MAX_TOKENS = 256  # the longest right answer of the AST categories (a parallel call of 4) is ~150 tokens


class ClawrlHandler(OpenAICompletionsHandler):
    """BFCL's chat-completions handler, asking with a fixed seed and answer budget, waiting as long as
    the gateway does (``clawrl.bench.bfcl.STALL_TIMEOUT_S``) and never asking twice: the OpenAI client's
    600 s and two retries turned slow answers on a busy CPU into "Request timed out" after sending each
    request three times."""

    def _build_client_kwargs(self):
        return {**super()._build_client_kwargs(), "timeout": 1800.0, "max_retries": 0}

    def generate_with_backoff(self, **kwargs):
        kwargs.pop("store", None)  # the Responses API's flag; nothing is stored by a chat completion
        return super().generate_with_backoff(**kwargs, seed=SEED, max_tokens=MAX_TOKENS)


MODEL_CONFIG_MAPPING[REGISTRY_NAME] = ModelConfig(
    model_name=MODEL_NAME, display_name="clawrl (OpenAI-compatible gateway, FC)", url="", org="clawrl",
    license="", model_handler=ClawrlHandler, is_fc_model=True,
    underscore_to_dot=True)  # the handler sends "a.b" as "a_b", the OpenAI name rule; the checker maps it back


def _handler() -> ClawrlHandler:
    return ClawrlHandler(model_name=MODEL_NAME, temperature=0.0, registry_name=REGISTRY_NAME, is_fc_model=True)


def sample(handler: ClawrlHandler, counts: dict[str, int], seed: int) -> list[dict]:
    """The prompts of ``counts[c]`` entries of each category ``c``, as the handler would send them."""
    from bfcl_eval.utils import load_dataset_entry, sort_key

    out = []
    for category, n in counts.items():
        entries = sorted(load_dataset_entry(category), key=sort_key)
        if 0 < n < len(entries):
            entries = random.Random(f"{seed}:{category}").sample(entries, n)
        for entry in entries:
            tools = handler._compile_tools({}, entry)["tools"]
            out.append({"id": entry["id"], "category": category, "messages": entry["question"][0], "tools": tools})
    return out


class Checker:
    """BFCL's verdict on one recorded result, by the entry's category (relevance or AST)."""

    def __init__(self, handler: ClawrlHandler) -> None:
        self.handler, self.prompts, self.answers = handler, {}, {}

    def _load(self, category: str) -> None:
        from bfcl_eval.utils import is_relevance_or_irrelevance, load_dataset_entry, load_ground_truth_entry

        if category in self.prompts:
            return
        entries = load_dataset_entry(category, include_prereq=False, include_language_specific_hint=False)
        self.prompts[category] = {e["id"]: e for e in entries}
        if not is_relevance_or_irrelevance(category):
            self.answers[category] = {e["id"]: e["ground_truth"] for e in load_ground_truth_entry(category)}

    def check(self, entry_id: str, result) -> dict:
        from bfcl_eval.eval_checker.eval_runner import _evaluate_single_ast_entry, _evaluate_single_relevance_entry
        from bfcl_eval.utils import extract_test_category_from_id, is_relevance_or_irrelevance

        category = extract_test_category_from_id(entry_id)
        self._load(category)
        prompt = self.prompts[category][entry_id]
        if is_relevance_or_irrelevance(category):
            out = _evaluate_single_relevance_entry(self.handler, entry_id, result, prompt, REGISTRY_NAME, category)
        else:
            out = _evaluate_single_ast_entry(self.handler, entry_id, result, self.answers[category][entry_id], prompt,
                                             REGISTRY_NAME, category, Language.PYTHON, ReturnFormat.PYTHON)
        return {"valid": bool(out["valid"]), "error_type": out.get("error_type")}


def serve() -> None:
    handler = _handler()
    checker = Checker(handler)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "sample":
                out = {"prompts": sample(handler, req["counts"], req["seed"])}
            elif req["op"] == "describe":
                out = {"handler": f"{ClawrlHandler.__name__}({OpenAICompletionsHandler.__name__})",
                       "mode": "FC", "seed": SEED, "max_tokens": MAX_TOKENS, "model_name": MODEL_NAME}
            else:
                out = checker.check(req["id"], req["result"])
        except Exception as e:  # noqa: BLE001 - the answer names it; the caller raises
            out = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve()
    else:
        from bfcl_eval.__main__ import cli

        cli()
