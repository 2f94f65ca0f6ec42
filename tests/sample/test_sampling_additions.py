"""The sampler's token masks (``allowed_token_ids``, ``bad_words``), plugin logits processors,
and how they compose with a structured-output grammar mask; ``generation_config.json``
sampling defaults."""

from __future__ import annotations

import json
from typing import Any

import pluggy
import pytest
import torch
from octavo.errors import InvalidRequestError
from octavo.hookspecs import hookimpl
from octavo.model_executor.generation_config import load_sampling_defaults
from octavo.plugins import build_plugin_manager
from octavo.sample import GrammarRows, Sampler
from octavo.sample.builtin_logits_processors import banned_tokens
from octavo.sample.logits_processor import (
    LogitsProcessor,
    LogitsProcessorRegistry,
    LogitsProcessorRow,
)
from octavo.sampling_params import LogitsProcessorSpec, SamplingParams

from tests.sample.helpers import make_row, random_logits
from tests.sample.test_grammar_bitmask import pack

VOCAB = 100


def test_allowed_token_ids_restrict_greedy_and_random_rows_only() -> None:
    logits = random_logits(3, VOCAB, scale=3.0)
    allowed = [4, 40, 77]
    rows = [make_row(temperature=0.0, allowed_token_ids=allowed),
            make_row(temperature=0.0),
            make_row(temperature=1.0, seed=1, allowed_token_ids=allowed)]
    for seed in range(20):
        rows[2] = make_row(temperature=1.0, seed=seed, allowed_token_ids=allowed)
        tokens = Sampler()(logits, rows).sampled_token_ids.tolist()
        assert tokens[0] == max(allowed, key=lambda t: logits[0, t].item())
        assert tokens[1] == logits[1].argmax().item()
        assert tokens[2] in allowed


def test_bad_words_mask_the_last_token_only_after_the_rest_of_the_word() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 9] = 5.0  # the favourite, and the last token of every bad word below
    logits[:, 8] = 4.0
    words = [[3, 9]]  # a two-token word: 9 is banned only right after 3
    rows = [make_row(temperature=0.0, output=[1, 3]),
            make_row(temperature=0.0, output=[3, 1]),
            make_row(temperature=0.0, output=[])]
    for row in rows:
        row.params.bad_words_token_ids = words
    rows[2].params.bad_words_token_ids = [[9]]  # a one-token word: always banned
    assert Sampler()(logits, rows).sampled_token_ids.tolist() == [8, 9, 8]


def test_masks_compose_with_the_grammar_mask_and_logit_bias() -> None:
    logits = random_logits(2, VOCAB)
    grammar = GrammarRows(row_ids=[0, 1], bitmask=pack([[5, 6, 7], [5, 6, 7]]))
    rows = [make_row(temperature=0.0, allowed_token_ids=[6, 7, 8], logit_bias={8: 100.0}),
            make_row(temperature=0.0, logit_bias={5: 100.0})]
    rows[1].params.bad_words_token_ids = [[5]]
    tokens = Sampler()(logits, rows, grammar).sampled_token_ids.tolist()
    # Row 0: the grammar allows {5,6,7}, allowed_token_ids {6,7,8}: only 6 or 7, whatever the bias.
    assert tokens[0] == max([6, 7], key=lambda t: logits[0, t].item())
    # Row 1: the grammar allows {5,6,7}, the bias favours 5 but it is a bad word.
    assert tokens[1] == max([6, 7], key=lambda t: logits[1, t].item())


class _Shift(LogitsProcessor):
    """Adds ``amount`` to token ``token`` (the test's plugin processor)."""

    calls: list[int] = []

    @classmethod
    def validate_kwargs(cls, kwargs: dict[str, Any]) -> None:
        if set(kwargs) != {"token", "amount"}:
            raise ValueError("takes token and amount")

    def apply(self, logits: torch.Tensor, rows: list[LogitsProcessorRow]) -> torch.Tensor:
        _Shift.calls.append(len(rows))
        for i, row in enumerate(rows):
            logits[i, row.kwargs["token"]] += row.kwargs["amount"]
        return logits


class _ShiftPlugin:
    @hookimpl
    def octavo_register_logits_processors(self, register) -> None:
        register("shift", _Shift)


@pytest.fixture()
def registry() -> LogitsProcessorRegistry:
    pm: pluggy.PluginManager = build_plugin_manager(load_entry_points=False)
    pm.register(_ShiftPlugin(), name="shift-plugin")
    return LogitsProcessorRegistry(pm)


def test_a_plugin_processor_runs_batched_once_per_step_on_the_rows_that_select_it(
        registry) -> None:
    assert "no_repeat_ngram" in registry.classes  # the built-in one, through the same hook
    logits = random_logits(4, VOCAB)
    spec = [LogitsProcessorSpec("shift", {"token": 11, "amount": 1000.0})]
    rows = [make_row(temperature=0.0, logits_processors=spec), make_row(temperature=0.0),
            make_row(temperature=0.0, logits_processors=[{"name": "shift",
                                                         "kwargs": {"token": 12, "amount": 1e3}}]),
            make_row(temperature=0.0)]
    _Shift.calls.clear()
    tokens = Sampler(registry)(logits, rows).sampled_token_ids.tolist()
    assert _Shift.calls == [2]  # one call for both rows
    assert tokens == [11, logits[1].argmax().item(), 12, logits[3].argmax().item()]


def test_unknown_processors_and_bad_arguments_are_refused_at_admission(registry) -> None:
    with pytest.raises(InvalidRequestError, match="unknown logits processor 'nope'; registered"):
        registry.validate([LogitsProcessorSpec("nope")])
    with pytest.raises(InvalidRequestError, match="'shift': takes token and amount"):
        registry.validate([LogitsProcessorSpec("shift", {"token": 1})])
    with pytest.raises(InvalidRequestError, match="ngram_size must be an integer >= 1"):
        registry.validate([LogitsProcessorSpec("no_repeat_ngram", {"ngram_size": 0})])
    with pytest.raises(InvalidRequestError, match="positional args are not supported"):
        SamplingParams(logits_processors=[{"qualname": "shift", "args": [1]}])


@pytest.mark.parametrize(("size", "expected"), [(1, {5, 6, 7, 8}), (2, {7, 8}), (3, {7, 8})])
def test_no_repeat_ngram_bans_exactly_the_completing_tokens(size: int, expected: set) -> None:
    # Ending in 5, 6: the bigrams (6, 7), (6, 8) and the trigrams (5, 6, 7), (5, 6, 8) were
    # seen, so 7 and 8 are banned for sizes 2 and 3; size 1 bans every token seen.
    tokens = [5, 6, 7, 5, 6, 8, 5, 6]
    assert banned_tokens(tokens, size) == expected


@pytest.mark.parametrize("bad", [
    {"allowed_token_ids": []}, {"allowed_token_ids": [-1]}, {"bad_words": [""]},
    {"bad_words": [3]}, {"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2},
])
def test_bad_values_are_refused_with_the_field_named(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**bad)
    assert info.value.param == next(iter(bad))


def test_generation_config_defaults(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "eos_token_id": 2,
         "repetition_penalty": None}))
    assert load_sampling_defaults(tmp_path, "auto") == {"temperature": 0.6, "top_p": 0.9,
                                                        "top_k": 20}
    assert load_sampling_defaults(tmp_path, "vllm") == {}
    assert load_sampling_defaults(tmp_path / "x", "auto") == {}  # no file: no defaults
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError, match="the folder has no generation_config.json"):
        load_sampling_defaults(tmp_path, str(other))
    (other / "generation_config.json").write_text('{"min_p": 0.1}')
    assert load_sampling_defaults(tmp_path, str(other)) == {"min_p": 0.1}
    (other / "generation_config.json").write_text('{"top_p": "high"}')
    with pytest.raises(ValueError, match="top_p must be a number"):
        load_sampling_defaults(tmp_path, str(other))
