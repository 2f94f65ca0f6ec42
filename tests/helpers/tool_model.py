"""A tiny Qwen2 checkpoint that really writes tool calls and think blocks.

A random-weight model writes noise, so the tests of tool calling would only ever parse
handwritten text. This model is trained (a few seconds on one CPU thread) to answer a handful
of conversations, rendered with its Hermes-style chat template, with fixed texts: tool calls in
the ``hermes``, ``llama3_json`` and ``mistral`` formats, ``<think>`` blocks for the reasoning
parsers, and plain answers. Greedy decoding then reproduces those texts token by token, so the
server's parsers run on text the engine really generated. The build checks that Hugging Face's
greedy decoding reproduces every answer with a clear margin, and fails loudly otherwise.

Its tokenizer is a byte-level BPE trained on the same conversations, with ``<tool_call>``,
``</tool_call>``, ``<think>`` and ``</think>`` as ordinary added tokens (as in Qwen's
tokenizers) and ``[TOOL_CALLS]``, ``<|python_tag|>`` as special ones (as in Mistral's and
Llama's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The model's own template: Hermes-style calls, tools listed by name and parameters;
# ``enable_thinking=False`` closes an empty think block in the prompt, as Qwen3's does.
CHAT_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}
Tools: {% for tool in tools %}{{ tool.function.name }}({{ tool.function.parameters.properties | join(', ') }}){% if not loop.last %}; {% endif %}{% endfor %}.
Call: <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{% for m in messages %}
{% if m.role == 'system' and loop.first %}
{% elif m.role == 'tool' %}
{% if loop.first or loop.previtem.role != 'tool' %}
<|im_start|>user
{% endif %}
<tool_response>{{ m.content }}</tool_response>
{% if loop.last or loop.nextitem.role != 'tool' %}
<|im_end|>
{% endif %}
{% elif m.role == 'assistant' and m.tool_calls %}
<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}
{% for call in m.tool_calls %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}
<|im_end|>
{% else %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{% endif %}
{% endif %}
"""
# DeepSeek-R1's habit: the generation prompt opens the think block.
R1_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% if enable_thinking",
    "<|im_start|>assistant\n<think>\n{% if enable_thinking")
R1_TEMPLATE_FILE = "chat_template_r1.jinja"

CITIES = ["Paris", "Tokyo", "Berlin", "Rome", "Oslo"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": CITIES},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone", "strict": True,
    "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string", "enum": ["Asia/Tokyo", "Europe/Paris"]}},
        "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[TOOL_CALLS]", "<|python_tag|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@dataclass(frozen=True)
class Case:
    """A conversation and the answer the model learns to give it."""

    tools: list[dict[str, Any]] | None
    messages: list[dict[str, Any]]
    answer: str
    template: str = CHAT_TEMPLATE


PARIS = {"city": "Paris", "unit": "celsius"}
PARIS_CALL = {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}}

CASES = {
    "paris": Case(TOOLS, [{"role": "user", "content": "What is the weather in Paris?"}],
                  hermes_call("get_weather", PARIS)),
    "tokyo": Case(TOOLS, [{"role": "user", "content": "Weather and time in Tokyo?"}],
                  hermes_call("get_weather", {"city": "Tokyo", "unit": "celsius"}) + "\n"
                  + hermes_call("get_time", {"timezone": "Asia/Tokyo"})),
    # The conversation goes on after the call: the call and its result rendered back.
    "paris_result": Case(TOOLS, [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [PARIS_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ], "It is 21 degrees in Paris."),
    "hello": Case(TOOLS, [{"role": "user", "content": "Say hello."}], "Hello! How can I help?"),
    "sky": Case(None, [{"role": "user", "content": "Why is the sky blue?"}],
                "<think>\nBlue light scatters more.\n</think>\n\nBecause of Rayleigh scattering."),
    "berlin": Case(TOOLS, [{"role": "user", "content": "Think, then get the weather in Berlin."}],
                   "<think>\nI should call get_weather.\n</think>\n\n"
                   + hermes_call("get_weather", {"city": "Berlin", "unit": "celsius"})),
    "sky_r1": Case(None, [{"role": "user", "content": "Why is the sky blue?"}],
                   "Blue light scatters more.\n</think>\n\nBecause of Rayleigh scattering.",
                   template=R1_CHAT_TEMPLATE),
    "rome_llama3": Case(TOOLS, [{"role": "user", "content": "llama3: weather in Rome?"}],
                        '<|python_tag|>{"name": "get_weather", "parameters": '
                        '{"city": "Rome", "unit": "celsius"}}'),
    "oslo_mistral": Case(TOOLS, [{"role": "user", "content": "mistral: weather in Oslo?"}],
                         '[TOOL_CALLS][{"name": "get_weather", "arguments": '
                         '{"city": "Oslo", "unit": "celsius"}}]'),
}

# Smallest gap between the best and second-best logit along every learned answer.
MIN_MARGIN = 1.0
MAX_STEPS = 500


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates get them: tool-call arguments as objects (what the server does)."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"],
                                      "arguments": json.loads(call["function"]["arguments"])}}
                for call in message["tool_calls"]]
        if message.get("content") is None:
            message["content"] = ""
        out.append(message)
    return out


def render(tokenizer: Any, case: Case) -> str:
    return tokenizer.apply_chat_template(
        _template_messages(case.messages), tools=case.tools, chat_template=case.template,
        tokenize=False, add_generation_prompt=True)


def _train_tokenizer(folder: Path) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, **_: json.dumps(value)
    corpus = [env.from_string(case.template).render(
        messages=_template_messages(case.messages), tools=case.tools, add_generation_prompt=True)
        + case.answer for case in CASES.values()]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(corpus * 5, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    (folder / R1_TEMPLATE_FILE).write_text(R1_CHAT_TEMPLATE)
    return tokenizer


def make_tool_model(folder: Path, hidden_size: int = 64, intermediate_size: int = 128) -> Path:
    """Write the trained checkpoint (config, safetensors, tokenizer, template) into ``folder``.
    Four attention heads: ``hidden_size`` 256 gives the head size 64 the GPU kernels take."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    trained = _train_tokenizer(folder)
    eos = trained.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(
        vocab_size=len(trained), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=eos, bos_token_id=None,
        pad_token_id=trained.pad_token_id)
    config.save_pretrained(folder)
    # The tokenizer as the engine loads it, next to a Qwen2 config.json (transformers then
    # picks Qwen2's tokenizer class, which splits text its own way): the ids trained on are
    # the ids served.
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sequences = _sequences(tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: one thread is fastest, and deterministic
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # Wider models need a smaller step to converge (1e-2 diverges at hidden_size 256).
        _train(model, sequences, config.pad_token_id, lr=1e-2 * min(1.0, 64 / hidden_size))
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    # What was written must still give every answer (tokenizer and weights read back).
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    margin = _smallest_margin(reloaded, _sequences(AutoTokenizer.from_pretrained(folder)))
    if margin < MIN_MARGIN:
        raise RuntimeError(f"the saved tool model lost its answers (smallest margin {margin:.2f})")
    return folder


def _sequences(tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + EOS) of every case."""
    sequences = []
    for case in CASES.values():
        prompt = tokenizer(render(tokenizer, case), add_special_tokens=False).input_ids
        answer = tokenizer(case.answer + "<|im_end|>", add_special_tokens=False).input_ids
        sequences.append((prompt, answer))
    return sequences


def _train(model: Any, sequences: list[tuple[list[int], list[int]]], pad_id: int,
           lr: float) -> None:
    """Train until every answer is the greedy one with ``MIN_MARGIN`` (or fail)."""
    length = max(len(p) + len(a) for p, a in sequences)
    input_ids = torch.full((len(sequences), length), pad_id)
    labels = torch.full((len(sequences), length), -100)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, (prompt, answer) in enumerate(sequences):
        tokens = prompt + answer
        input_ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
        labels[row, len(prompt):len(tokens)] = torch.tensor(answer)  # learn the answers only
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for step in range(MAX_STEPS):
        model.train()
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.05 and step % 10 == 0:
            model.eval()
            if _smallest_margin(model, sequences) >= MIN_MARGIN:
                return
    model.eval()
    raise RuntimeError(f"the tool model did not learn its answers in {MAX_STEPS} steps (smallest "
                       f"margin {_smallest_margin(model, sequences):.2f} < {MIN_MARGIN}); change "
                       "the seed or the steps")


@torch.no_grad()
def _smallest_margin(model: Any, sequences: list[tuple[list[int], list[int]]]) -> float:
    """Smallest gap between the answer's logit and the best other one, along every answer
    (negative: greedy decoding leaves the answer somewhere)."""
    smallest = float("inf")
    for prompt, answer in sequences:
        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(answer)[:, None])[:, 0]
        logits.scatter_(1, torch.tensor(answer)[:, None], float("-inf"))
        smallest = min(smallest, (chosen - logits.max(dim=1).values).min().item())
    return smallest
