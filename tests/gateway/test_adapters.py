import json

import pytest

from clawrl.chat import ChatAdapter, ChatMessage, SegmentEncoder, ToolDef
from clawrl.models import load_tokenizer

TOOLS = [ToolDef.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})]


@pytest.fixture(scope="module")
def adapter(tiny_dir):
    return ChatAdapter(load_tokenizer(tiny_dir))


def test_render_matches_the_tokenizers_own_template(adapter):
    msgs = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]
    ids = adapter.render(msgs)
    expected = adapter.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == list(expected)
    assert adapter.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def _random_text(rng, specials):
    alphabet = ["a", "b", " ", "  ", "\n", "\n\n", "\t", "é", "日本", "1", "23", "'s", "!", "<", ">", "|", "im", "_"]
    return "".join(rng.choice(specials) if rng.random() < 0.1 else rng.choice(alphabet) for _ in range(rng.randint(0, 60)))


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen3"])
def test_piecewise_encoding_equals_the_tokenizers_own(model, tiny_dir, tiny_qwen3_dir):
    backend = load_tokenizer(tiny_dir if model == "tiny" else tiny_qwen3_dir).backend_tokenizer
    enc = SegmentEncoder(backend)
    specials = [t.content for t in backend.get_added_tokens_decoder().values()]
    rng = __import__("random").Random(0)
    texts = [_random_text(rng, specials) for _ in range(400)]
    for text in texts + texts:  # cold, then from the cache
        assert enc.encode(text) == backend.encode(text, add_special_tokens=False).ids, repr(text)
    assert enc.encode("") == []
    assert enc.encode("<|im_start|><|im_end|>") == backend.encode("<|im_start|><|im_end|>", add_special_tokens=False).ids


def test_piece_cache_is_bounded_by_characters(tiny_dir):
    enc = SegmentEncoder(load_tokenizer(tiny_dir).backend_tokenizer, max_cached_chars=100)
    for i in range(50):
        enc.encode(f"<|im_start|>user\nquestion number {i:04d}<|im_end|>")  # pieces of 25 and 1 chars
    assert enc._chars <= 100 and enc._chars == sum(len(k) for k in enc._cache)
    assert "user\nquestion number 0049" in enc._cache and "user\nquestion number 0000" not in enc._cache
    enc.encode("x" * 60)  # over a quarter of the budget: encoded, never cached
    assert "x" * 60 not in enc._cache


def test_a_long_conversation_renders_exactly_with_the_piece_cache(adapter):
    assert adapter._fast is not None and adapter._fast.segments is not None  # SmolLM2's tokenizer qualifies
    msgs, dicts = [ChatMessage(role="system", content="be brief")], [{"role": "system", "content": "be brief"}]
    for turn in range(12):
        for role, text in (("user", f"step {turn}: {'lorem ipsum ' * turn}?"), ("assistant", f" answer {turn}\n")):
            msgs.append(ChatMessage(role=role, content=text))
            dicts.append({"role": role, "content": text})
        expected = adapter.tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
        assert adapter.render(msgs) == list(expected)
    assert "user\nstep 0: ?" in adapter._fast.segments._cache  # history pieces are reused, not re-encoded


def test_developer_role_renders_as_system_and_text_parts_join(adapter):
    a = adapter.render([ChatMessage(role="developer", content=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]),
                        ChatMessage(role="user", content="hi")])
    b = adapter.render([ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")])
    assert a == b


def test_tools_are_rendered_into_the_system_prompt_for_templates_without_tools(adapter):
    assert adapter.native_tools is False  # SmolLM2's template knows only role + content
    text = adapter.tokenizer.decode(adapter.render([ChatMessage(role="user", content="hi")], TOOLS))
    assert "<tools>" in text and '"get_weather"' in text
    none = adapter.tokenizer.decode(adapter.render([ChatMessage(role="user", content="hi")], TOOLS, "none"))
    assert "<tools>" not in none


def test_tool_call_round_trip_keeps_the_format_in_the_prompt(adapter):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [ChatMessage(role="user", content="weather?"),
            ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]}),
            ChatMessage(role="tool", tool_call_id="call_1", content="12C")]
    text = adapter.tokenizer.decode(adapter.render(msgs, TOOLS))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n12C\n</tool_response>" in text


def test_parse_extracts_parallel_calls_and_leftover_content(adapter):
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    out = adapter.parse(text, TOOLS)
    assert out.content == "Let me check."
    assert [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert all(c["function"]["name"] == "get_weather" and c["id"].startswith("call_") for c in out.tool_calls)
    assert len({c["id"] for c in out.tool_calls}) == 2


def test_parse_ignores_undeclared_names_bad_json_and_tool_choice_none(adapter):
    bad = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert adapter.parse(bad, TOOLS).tool_calls == [] and adapter.parse(bad, TOOLS).content == bad
    broken = '<tool_call>{"name": "get_weather", "arguments": </tool_call>'
    assert adapter.parse(broken, TOOLS).tool_calls == []
    ok = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert adapter.parse(ok, TOOLS, "none").tool_calls == []
    assert adapter.parse(ok, None).tool_calls == []
    # a call cut off by EOS before its closing tag still parses
    assert len(adapter.parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}', TOOLS).tool_calls) == 1
