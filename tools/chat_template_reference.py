"""Chat prompts rendered by transformers' apply_chat_template, for moelora's chat templates.

  python tools/chat_template_reference.py TEMPLATES_DIR MODEL_DIR OUT_DIR

TEMPLATES_DIR holds the real templates (llama.cpp's models/templates from the PyPI
llama-cpp-python sdist: Qwen3, Qwen3.5, Step-3.5-Flash, GPT-OSS); MODEL_DIR a tokenizer
(tokenizer.json + tokenizer_config.json, whose special tokens the templates see, and its own
chat_template.jinja, rendered over the same corpus when present). Writes
OUT_DIR/cases.jsonl (the input lines of `moelora-tokenizer chat MODEL_DIR`) and
OUT_DIR/expected.jsonl (transformers' prompt, or {"error": ...} where it raises), one line per
case: every template over a corpus of conversations (system prompts, multi-turn, tool calls and
results, reasoning, thinking on and off, Unicode) and flags, and short templates that exercise
the Jinja features one by one. Test-only (tests/integration/chat_template_test.sh).
"""

import json
import os
import sys

from transformers import AutoTokenizer

TEMPLATES = {
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "qwen3_5": "Qwen3.5-4B.jinja",
    "step3p5": "StepFun3.5-Flash.jinja",
    "gpt_oss": "openai-gpt-oss-120b.jinja",
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "description": "Forecast days", "default": 1},
                "hourly": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "coords": {"type": "array", "items": {"type": "number"}, "nullable": True},
                "extra": {"type": "object", "properties": {"lang": {"type": "string"}}},
                "mode": {"oneOf": [{"type": "string"}, {"type": "integer"}], "default": "auto"},
                "ratio": {"type": "number", "default": 0.5},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "top_k": {"type": ["integer", "null"]}},
            "required": ["query"],
        },
    },
}
NO_PARAMS_TOOL = {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {}}}

UNICODE = "Grüße, 世界! 🌸🛑 café naïve — ‘quotes’ «ελληνικά» עברית \u3000end\u00a0"


def conversations():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "tags": ["a", "b"],
                                                              "extra": {"lang": "fr"}, "hourly": True,
                                                              "ratio": 0.25}}}
    call_str = {"id": "call_2", "type": "function",
                "function": {"name": "search", "arguments": '{"query": "moelora", "top_k": 3}'}}
    return {
        "user": [{"role": "user", "content": "Hello!"}],
        "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
        "multi_turn": [
            {"role": "system", "content": "Be helpful.\n"},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "  And 3+3?  "},
        ],
        "think_in_content": [
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "<think>\nBecause of reasons.\n</think>\n\nIt is so."},
            {"role": "user", "content": "Really?"},
        ],
        "reasoning_field": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "thinking about Q1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "\nthinking about Q2\n"},
        ],
        "thinking_field": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A", "thinking": "some thought"},
        ],
        "tool_round": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
            {"role": "assistant", "content": "It is 21 degrees."},
            {"role": "user", "content": "Thanks"},
        ],
        "tool_pending": [
            {"role": "user", "content": "Find moelora"},
            {"role": "assistant", "content": "Let me search.", "tool_calls": [call_str]},
            {"role": "tool", "tool_call_id": "call_2", "content": "result one"},
            {"role": "tool", "tool_call_id": "call_2", "content": "result two"},
        ],
        "tool_response_user": [
            {"role": "user", "content": "<tool_response>\nold\n</tool_response>"},
            {"role": "user", "content": "real question"},
        ],
        "unicode": [
            {"role": "system", "content": UNICODE},
            {"role": "user", "content": UNICODE + "\n\ttabs\r\nand CRLF"},
            {"role": "assistant", "content": "Ответ: " + UNICODE},
            {"role": "user", "content": "Encore 🙂"},
        ],
        "content_parts": [
            {"role": "system", "content": [{"type": "text", "text": "System part."}]},
            {"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]},
        ],
        "developer": [
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Hello"},
        ],
        "assistant_last": [
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "hi", "thinking": "greet"},
        ],
        "system_late": [
            {"role": "user", "content": "a"},
            {"role": "system", "content": "late system"},
        ],
        "empty": [],
        "null_content": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ],
    }


FLAGS = [
    {"add_generation_prompt": True},
    {"add_generation_prompt": False},
    {"add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False}},
    {"add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": True}},
    {"add_generation_prompt": True, "tools": [WEATHER_TOOL, SEARCH_TOOL, NO_PARAMS_TOOL]},
    {"add_generation_prompt": True, "tools": [WEATHER_TOOL],
     "chat_template_kwargs": {"reasoning_effort": "high", "model_identity": "You are Moe.",
                              "builtin_tools": ["browser", "python"]}},
]

# Short templates, one feature each (with the context they render).
SNIPPETS = [
    ("  {% if true %}\n  x\n  {% endif %}\n  y {{- ' z' }}\n", {}),
    ("a  {%- if 1 -%}  b  {%- endif -%}  c\n\n", {}),
    ("{# c #}\n  {#- d -#}  e\n{{ 1 }}\n  {# f #}\ng\n", {}),
    ("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}"
     "{{ loop.length }}{{ loop.revindex }}{{ loop.previtem }}{{ loop.nextitem }};{% endfor %}", {"xs": [1, 2, 3]}),
    ("{% for k, v in d|items %}{{ k }}={{ v }},{% endfor %}{% for k in d %}{{ k }}{% endfor %}"
     "{% for k, v in d.items() %}{{ v }}{% endfor %}", {"d": {"b": 1, "a": [1, "x"]}}),
    ("{% for x in xs if x > 1 %}{{ x }}{{ loop.index }}{% else %}none{% endfor %}"
     "{% for x in [] %}{% else %}empty{% endfor %}", {"xs": [1, 2, 3]}),
    ("{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}"
     "{{ x }}{% endfor %}", {"xs": [1, 2, 3, 4, 5]}),
    ("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}"
     "{% if true %}{% set y = 3 %}{% endif %}{{ y }}"
     "{% set ns = namespace(a=1) %}{% for i in [1,2] %}{% set ns.a = ns.a + i %}{% endfor %}{{ ns.a }}", {}),
    ("{% macro m(a, b='d', c=none) %}[{{ a }}|{{ b }}|{{ c }}|{{ g }}]{% endmacro %}"
     "{{ m(1) }}{{ m(1, 2) }}{{ m(a=3, c=4) }}{{ m('x')|length }}", {"g": "G"}),
    ("{% set s %}block {{ 1 + 1 }}{% endset %}[{{ s }}]{% set a, b = 1, 2 %}{{ a }}{{ b }}", {}),
    ("{{ 2 ** 62 }} {{ (-1) ** 5 }} {{ 0 ** 0 }} {{ 7 // -2 }} {{ -9223372036854775807 - 1 }}", {}),
    ("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2.5 }} {{ 3 * 'ab' }}"
     " {{ 'a' ~ 1 ~ none ~ true }} {{ 1 == 1.0 }} {{ true == 1 }} {{ [1] + [2] }}", {}),
    ("{{ f }} {{ f * 3 }} {{ g }} {{ h }} {{ i }} {{ j }} {{ k }} {{ 1e20 }} {{ 1.5e-7 }} {{ 100.0 }} {{ 0.1 + 0.2 }}",
     {"f": 0.1, "g": 1e16, "h": 123456789.125, "i": -0.0, "j": 1e-4, "k": 12345678901234567890}),
    ("{{ xs }} {{ d }} {{ none }} {{ s|string }} {{ [none, true, 1.5, 'it\\'s', \"q\\\"\"] }}",
     {"xs": [1, "a", [2]], "d": {"k": "v", "n": None}, "s": ["x"]}),
    ("{{ d|tojson }}|{{ d|tojson(indent=2) }}|{{ d|tojson(sort_keys=true) }}|{{ u|tojson }}|"
     "{{ u|tojson(ensure_ascii=true) }}|{{ [1.0, 2, none, false, 'a\\nb\\t\\u0001'] | tojson }}|{{ {}|tojson }}",
     {"d": {"z": 1, "a": {"b": [1, 2, {}], "c": []}, "f": 2.50}, "u": "é🌸\"\\"}),
    ("{{ s.startswith('ab') }}{{ s.endswith(('x', 'yz')) }}{{ s.split('b') }}{{ s.split() }}{{ t.split(none, 1) }}"
     "{{ s.strip('az') }}{{ t.strip() }}|{{ t.lstrip() }}|{{ t.rstrip() }}|{{ s.replace('b', 'B') }}{{ s.upper() }}"
     "{{ s.title() }}{{ s.find('c') }}{{ s.count('b') }}{{ ','.join(['a', 'b']) }}",
     {"s": "abcbyz", "t": "  one two\u3000three \n"}),
    ("{{ s[1:] }}{{ s[::-1] }}{{ s[-2:] }}{{ xs[1:] }}{{ xs[::-1] }}{{ xs[-1] }}{{ xs[5] is defined }}"
     "{{ xs[1:2] }}{{ s[0] }}{{ xs[:-1] }}{{ xs[::2] }}", {"s": "héllo", "xs": [1, 2, 3, 4]}),
    ("{{ xs|length }}{{ s|length }}{{ d|length }}{{ xs|first }}{{ xs|last }}{{ xs|join('-') }}{{ s|upper }}"
     "{{ s|lower }}{{ ' a '|trim }}{{ xs|reverse|list }}{{ u|default('dflt') }}{{ ''|default('e', true) }}"
     "{{ s|replace('l', 'L') }}{{ '12'|int + 1 }}{{ '1.5'|float }}{{ -3|abs }}{{ xs|map('string')|join }}"
     "{{ ms|map(attribute='r')|join(',') }}{{ ms|selectattr('r', 'equalto', 'u')|list|length }}"
     "{{ ms|rejectattr('r', 'equalto', 'u')|map(attribute='r')|first }}{{ [1, 1, 2]|unique|list }}"
     "{{ 'a\\nb'|indent(2, true) }}",
     {"xs": [1, 2, 3], "s": "Héllo", "d": {"a": 1}, "ms": [{"r": "u"}, {"r": "a"}, {"r": "u"}]}),
    ("{{ n is none }}{{ u is defined }}{{ u is undefined }}{{ s is string }}{{ d is mapping }}{{ xs is iterable }}"
     "{{ s is iterable }}{{ d is sequence }}{{ 1 is number }}{{ true is number }}{{ 1 is integer }}{{ 1.5 is float }}"
     "{{ true is boolean }}{{ false is false }}{{ 0 is false }}{{ n is not none }}{{ 3 is odd }}{{ 4 is even }}"
     "{{ 6 is divisibleby 3 }}{{ 'a' is in 'cat' }}{{ s is lower }}{{ x is sameas false }}",
     {"n": None, "s": "str", "d": {}, "xs": [], "x": False}),
    ("{{ 'b' in 'abc' }}{{ 2 in [1, 2] }}{{ 'k' in d }}{{ 'v' in d }}{{ 'z' not in d }}{{ u is defined and u.x }}"
     "{{ (1 or 2) }}{{ (0 or 'x') }}{{ (1 and 'y') }}{{ ([] or {}) }}{{ not [] }}{{ 'yes' if d else 'no' }}"
     "{{ 'a' if false }}|{{ d.k }}{{ d['k'] }}{{ d.missing }}{{ d.get('k') }}{{ d.get('zz', 9) }}{{ d.keys()|list }}",
     {"d": {"k": "v"}}),
    ("{{ u.attr }}", {}),
    ("{{ 'a' + 1 }}", {}),
    ("{{ raise_exception('custom failure') }}", {}),
    ("{{ n|tojson }}{{ [u]|length }}{{ u|trim }}{{ u|length }}{% for x in u %}never{% endfor %}{{ u|items|list }}",
     {"n": None}),
    ("{{ 'x' ~ u ~ 'y' }}{{ u == u }}{{ none == u }}{{ bos_token }}{{ eos_token }}{{ pad_token }}", {}),
    ("{{ \"dq\" 'sq' }} {{ '\\x41\\u00e9\\\\' }} {{ \"it's\" }}\r\n{{ 1 }}\r\n", {}),
    ("{%- set a = [1, 2] -%}\n{{ a }}\n   {%+ if true %}kept{% endif %}\n  {{ 'v' }}  {% if 1 %}i{% endif %}\n", {}),
    ("{{ range(3)|list }}{{ range(1, 7, 2)|list }}{{ dict(a=1)|tojson }}{{ {'x': 1, 'y': [2]}['y'][0] }}"
     "{{ (1, 2)|list }}{{ [1, 2, 3]|selectattr('real') is defined }}", {}),
]


def main():
    templates_dir, model_dir, out_dir = sys.argv[1:4]
    os.makedirs(out_dir, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cases = []
    templates = {}
    for name, file in TEMPLATES.items():
        with open(os.path.join(templates_dir, file), encoding="utf-8") as f:
            templates[name] = f.read()
    if tok.chat_template:
        templates["model"] = None  # MODEL_DIR's own (chat_template.jinja): no override
    for name, template in templates.items():
        for conv_name, messages in conversations().items():
            for flags in FLAGS:
                case = {"id": f"{name}/{conv_name}/{json.dumps(flags, sort_keys=True)[:80]}",
                        "messages": messages}
                if template is not None:
                    case["chat_template"] = template
                case.update(flags)
                cases.append(case)
    for k, (template, context) in enumerate(SNIPPETS):
        cases.append({"id": f"snippet/{k}", "chat_template": template,
                      "messages": [{"role": "user", "content": "m"}], "chat_template_kwargs": context})
    with open(os.path.join(out_dir, "cases.jsonl"), "w", encoding="utf-8") as fc, \
            open(os.path.join(out_dir, "expected.jsonl"), "w", encoding="utf-8") as fe:
        for case in cases:
            try:
                text = tok.apply_chat_template(
                    case["messages"], tools=case.get("tools"), tokenize=False,
                    add_generation_prompt=case.get("add_generation_prompt", False),
                    chat_template=case.get("chat_template"), **case.get("chat_template_kwargs", {}))
                expected = text
            except Exception as e:  # noqa: BLE001 - the template's own error is the reference
                expected = {"error": f"{type(e).__name__}: {e}"}
            fc.write(json.dumps(case, ensure_ascii=False) + "\n")
            fe.write(json.dumps(expected, ensure_ascii=False) + "\n")
    print(f"{len(cases)} cases rendered by transformers into {out_dir}")


if __name__ == "__main__":
    main()
