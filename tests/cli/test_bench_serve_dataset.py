"""``octavo bench serve``'s prompt ids stay inside the model's vocabulary."""

from __future__ import annotations

import json

from octavo.cli.bench_serve import _prompt_vocab_size


def test_prompt_ids_stay_below_the_smaller_of_tokenizer_and_model_vocabulary(tmp_path) -> None:
    # A tokenizer holding more ids than the model's embedding (its extra ids get a 400).
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    assert _prompt_vocab_size(str(tmp_path), 151937) == 151936
    assert _prompt_vocab_size(str(tmp_path), 1000) == 1000
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 500}}))
    assert _prompt_vocab_size(str(tmp_path), 1000) == 500


def test_without_a_local_config_the_tokenizer_decides(tmp_path) -> None:
    assert _prompt_vocab_size(str(tmp_path / "missing"), 1000) == 1000
    assert _prompt_vocab_size("org/name", 1000) == 1000
