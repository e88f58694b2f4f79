"""Chat template rendering matches transformers' apply_chat_template."""

import datetime
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.errors import StrataError
from app.text.chat_template import ChatTemplate, ChatTemplateError
from app.text.tiny import CHATML_TEMPLATE, write_tiny_tokenizer

QWEN3_STYLE_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call functions to answer the user.' }}
    {{- ' Their signatures, in <tools></tools> tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nReturn each call as {"name": ..., "arguments": ...}' }}
    {{- ' in <tool_call></tool_call> tags.' }}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
        and not (message.content.startswith('<tool_response>')
                 and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n') %}
            {%- set reasoning = reasoning.split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
            {{- content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if content or not loop.first %}
                    {{- '\\n' }}
                {%- endif %}
                {%- set call = tool_call.function if tool_call.function else tool_call %}
                {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
                {%- if call.arguments is string %}
                    {{- call.arguments }}
                {%- else %}
                    {{- call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — température included.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. 東京"}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user only": [{"role": "user", "content": "Hello there!"}],
    "system user assistant": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3? 🤔"},
    ],
    "multi-turn unicode": [
        {"role": "user", "content": "Translate 'cat' to Japanese."},
        {"role": "assistant", "content": "猫 (neko)"},
        {"role": "user", "content": "Thanks — and 'dog'?"},
        {"role": "assistant", "content": "犬 (inu) 🐕"},
    ],
}

QWEN3_CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    **CONVERSATIONS,
    "reasoning in content": [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "<think>\nIt has no divisors but 1 and 7.\n</think>\n\nYes."},
    ],
    "reasoning field and alias": [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "Earlier question"},
        {"role": "assistant", "content": "Earlier answer", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Is 9 prime?"},
        {"role": "assistant", "content": "No, 9 = 3 × 3.", "reasoning": "9 is 3 squared."},
    ],
    "tool calls": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}},
            ],
        },
        {"role": "tool", "content": "18°C, sunny"},
        {"role": "tool", "content": "22°C, cloudy"},
        {"role": "assistant", "content": "Paris: 18°C and sunny. Tokyo: 22°C and cloudy."},
        {"role": "user", "content": "<tool_response>\nlate result\n</tool_response>"},
    ],
}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """transformers' view of the tiny tokenizer, used as the reference renderer."""
    out_dir: Path = tmp_path_factory.mktemp("tiny")
    write_tiny_tokenizer(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


def ours(source: str) -> ChatTemplate:
    """A ChatTemplate with the tiny tokenizer's special tokens."""
    return ChatTemplate(source, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def reference(hf: PreTrainedTokenizerBase, source: str, messages: list[dict], **kwargs: Any) -> str:
    """transformers' rendering of `messages` with `source`."""
    return hf.apply_chat_template(messages, chat_template=source, tokenize=False, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chatml_matches_transformers(
    hf_tokenizer: PreTrainedTokenizerBase, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    got = ours(CHATML_TEMPLATE).render(messages, add_generation_prompt=add_generation_prompt)
    assert got == reference(
        hf_tokenizer, CHATML_TEMPLATE, messages, add_generation_prompt=add_generation_prompt
    )


def test_chatml_shape() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = ours(CHATML_TEMPLATE).render(messages, add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("name", QWEN3_CONVERSATIONS)
def test_qwen3_style_matches_transformers(
    hf_tokenizer: PreTrainedTokenizerBase,
    name: str,
    with_tools: bool,
    add_generation_prompt: bool,
    enable_thinking: bool | None,
) -> None:
    messages = QWEN3_CONVERSATIONS[name]
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    tools = [WEATHER_TOOL] if with_tools else None
    got = ours(QWEN3_STYLE_TEMPLATE).render(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra
    )
    want = reference(
        hf_tokenizer,
        QWEN3_STYLE_TEMPLATE,
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        **extra,
    )
    assert got == want


def test_qwen3_style_details() -> None:
    template = ours(QWEN3_STYLE_TEMPLATE)
    text = template.render(QWEN3_CONVERSATIONS["tool calls"], tools=[WEATHER_TOOL])
    assert '"description": "City name, e.g. 東京"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18°C, sunny\n</tool_response>\n<tool_response>\n22°C, cloudy" in text
    no_think = template.render(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, enable_thinking=False
    )
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_raise_exception_surfaces_as_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="^Unexpected message role: robot$") as info:
        ours(QWEN3_STYLE_TEMPLATE).render([{"role": "robot", "content": "beep"}])
    assert isinstance(info.value, StrataError)


def test_raise_exception_matches_transformers_condition(hf_tokenizer: PreTrainedTokenizerBase) -> None:
    source = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    )
    with pytest.raises(Exception, match="first message must be user"):
        reference(hf_tokenizer, source, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        ours(source).render([{"role": "assistant", "content": "x"}])
    assert ours(source).render([{"role": "user", "content": "x"}]) == "ok"


def test_syntax_error_is_one_line() -> None:
    with pytest.raises(ChatTemplateError) as info:
        ours("{% for message in messages %}\n{{ message.content }}\n")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("chat template syntax error at line")


def test_runtime_errors_become_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="^chat template failed: "):
        ours(CHATML_TEMPLATE).render([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    with pytest.raises(ChatTemplateError):
        ours("{% set _ = messages.append(1) %}").render([])
    with pytest.raises(ChatTemplateError):
        ours("{% set ns = namespace(_hidden=1) %}").render([])


@pytest.mark.parametrize(
    "source",
    [
        "{{ tools | tojson }}",
        "{{ tools | tojson(indent=2) }}",
        "{{ tools | tojson(sort_keys=true) }}",
        "{{ tools | tojson(separators=(',', ':')) }}",
        "{{ tools | tojson(ensure_ascii=true) }}",
        "{{ {'b': '<&>', 'a': 'é'} | tojson }}",
    ],
)
def test_tojson_matches_transformers(hf_tokenizer: PreTrainedTokenizerBase, source: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    got = ours(source).render(messages, tools=[WEATHER_TOOL])
    assert got == reference(hf_tokenizer, source, messages, tools=[WEATHER_TOOL])


@pytest.mark.parametrize(
    "source",
    [
        "{{ bos_token }}|{{ bos_token is defined }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is none }}",
        "{{ documents is none }}|{{ tools is none }}|{{ add_generation_prompt }}",
        "{% for m in messages %}{{ m | tojson }}{% endfor %}",
        (
            "{% for m in messages %}{% for x in m %}{% if x == 'skip' %}{% continue %}{% endif %}{{ x }},"
            "{% endfor %}{% endfor %}"
        ),
        "{{ dict(a=1) | tojson }}{{ dict.fromkeys(['x'], 0) | tojson }}",
        "  {% if true %}\n  indented\n  {% endif %}\n",
    ],
)
def test_environment_matches_transformers(hf_tokenizer: PreTrainedTokenizerBase, source: str) -> None:
    messages = [
        {"role": "assistant", "content": None, "skip": 1, "tool_calls": [{"name": "f", "arguments": {}}]},
        {"role": "user", "content": "q", "thinking": "t"},
    ]
    assert ours(source).render(messages) == reference(hf_tokenizer, source, messages)


def test_extra_kwargs_reach_the_template() -> None:
    template = ours("{{ eos_token }}|{{ custom }}")
    assert template.render([], custom="value") == "<|im_end|>|value"
    assert template.render([], eos_token="</s>", custom=1) == "</s>|1"


def test_strftime_now() -> None:
    assert ours("{{ strftime_now('%Y') }}").render([]) in {
        str(datetime.date.today().year),
        str(datetime.date.today().year + 1),
    }


def test_messages_are_not_modified() -> None:
    messages = [{"role": "assistant", "content": None, "reasoning": "r"}]
    ours("{{ messages | tojson }}").render(messages)
    assert messages == [{"role": "assistant", "content": None, "reasoning": "r"}]
