"""``--speculative-config`` / ``speculative_config=``: vLLM's JSON shape, defaults, and a
clear ``ValueError`` for every bad value (before any model is looked up)."""

from __future__ import annotations

import pytest
from octavo.config import SpeculativeConfig
from octavo.engine.arg_utils import EngineArgs


def test_defaults_follow_vllm() -> None:
    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig.from_user(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    config = SpeculativeConfig.from_user(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.from_user(None) is None
    assert SpeculativeConfig.from_user(config) is config


@pytest.mark.parametrize("value, message", [
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method 'medusa' is not supported yet"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' needs \"model\""),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', "method 'eagle3' needs \"model\""),
    ({"method": "draft_model", "num_speculative_tokens": 2},
     "method 'draft_model' needs \"model\""),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/x",
      "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size must be 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"},
     "for methods 'draft_model', 'eagle' and 'eagle3' only"),
    ({"method": "magic", "num_speculative_tokens": 2}, "unknown method 'magic'"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"num_speculative_tokens": 2}, "needs 'method'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": True}, "must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "must not exceed prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key(s) lookahead"),
    ("{method: ngram}", "is not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_values_are_refused(value, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.from_user(value)
    # Through EngineArgs (LLM(...) and the CLI) before any model is looked up.
    with pytest.raises(ValueError, match="speculative_config"):
        EngineArgs(model="/nonexistent", speculative_config=value).create_engine_config()


def test_cli_flag_reaches_the_engine_args() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    engine_args = EngineArgs.from_cli_args(args)
    config = SpeculativeConfig.from_user(engine_args.speculative_config)
    assert (config.method, config.num_speculative_tokens) == ("ngram", 4)


def test_pipeline_parallelism_is_refused(tiny_llama) -> None:
    with pytest.raises(ValueError, match="pipeline parallelism"):
        EngineArgs(model=str(tiny_llama), pipeline_parallel_size=2, device="cpu",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                   ).create_engine_config()


def test_async_scheduling_is_turned_off(tiny_llama) -> None:
    config = EngineArgs(model=str(tiny_llama), async_scheduling=True, device="cpu",
                        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                        ).create_engine_config()
    assert config.scheduler_config.async_scheduling is False
    assert config.speculative_config.num_speculative_tokens == 2
