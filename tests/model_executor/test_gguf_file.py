"""One parse of a GGUF file per process: ``read_gguf`` against ``gguf.GGUFReader``, the cache,
the HF config and tokenizer built from it against transformers' own, and ``LLM()`` on the
default model reading the file once (with one INFO line per start-up phase)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from octavo.model_executor.loader import gguf_file as gguf_file_module
from octavo.model_executor.loader.gguf_file import read_gguf
from octavo.model_executor.loader.gguf_hf import gguf_hf_config, gguf_hf_tokenizer

from tests.model_executor.test_gguf_loader import hf_weights, write_gguf


def _tiny(tmp_path: Path, arch: str = "llama") -> Path:
    head_dim = 16
    weights = hf_weights(arch, head_dim, tied=arch != "llama")
    return write_gguf(tmp_path / f"{arch}.gguf", arch, weights, head_dim, quantize=("mlp",))


def _fields(reader: gguf.GGUFReader) -> dict:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # the header, which GGUFReader lists as fields
        value = field.contents()
        out[name] = value
    return out


def test_read_gguf_matches_gguf_reader(tmp_path):
    path = _tiny(tmp_path)
    ours = read_gguf(path)
    reference = gguf.GGUFReader(path)
    assert ours.metadata == pytest.approx(_fields(reference))
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for info, tensor in zip(ours.tensors, reference.tensors):
        assert info.shape == tuple(tensor.shape.tolist()) and info.qtype == tensor.tensor_type
        assert np.array_equal(ours.tensor_data(info).view(np.uint8),
                              np.asarray(tensor.data).reshape(-1).view(np.uint8)), info.name


def test_read_gguf_parses_once_until_the_file_changes(tmp_path, monkeypatch):
    path = _tiny(tmp_path)
    parses = []
    real_parse = gguf_file_module._parse
    monkeypatch.setattr(gguf_file_module, "_parse", lambda p: parses.append(p) or real_parse(p))
    first = read_gguf(path)
    assert read_gguf(str(path)) is first and read_gguf(tmp_path / "." / path.name) is first
    assert len(parses) == 1
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # "rewritten"
    assert read_gguf(path) is not first
    assert len(parses) == 2


def test_not_a_gguf_file_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="bad.gguf.*is not a GGUF file"):
        read_gguf(bad)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(_tiny(tmp_path).read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(truncated)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_equals_transformers(tmp_path, arch):
    from transformers import AutoConfig

    path = _tiny(tmp_path, arch)
    ours = gguf_hf_config(read_gguf(path))
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(ours) is type(theirs)
    assert ours.to_dict() == theirs.to_dict()


def _gguf_with_tokenizer(path: Path, arch: str, tokenizer_json: Path) -> Path:
    """A GGUF holding a byte-level BPE tokenizer (as llama.cpp writes SmolLM2's or Qwen's)
    taken from a tokenizer.json, and one tensor."""
    import json

    spec = json.loads(tokenizer_json.read_text())
    tokens = {index: token for token, index in spec["model"]["vocab"].items()}
    special = {added["id"]: added["content"] for added in spec["added_tokens"]}
    tokens.update(special)
    vocab = [tokens.get(i, f"<unused{i}>") for i in range(max(tokens) + 1)]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch != "llama" else "smollm")
    writer.add_token_list(vocab)
    writer.add_token_types([3 if i in special else 1 for i in range(len(vocab))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                             "{{ m['content'] }}<|im_end|>\n{% endfor %}")
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tokenizer_equals_transformers(tmp_path, tiny_llama, arch):
    from transformers import AutoTokenizer

    path = _gguf_with_tokenizer(tmp_path / f"{arch}.gguf", arch, tiny_llama / "tokenizer.json")
    parsed = read_gguf(path)
    ours = gguf_hf_tokenizer(parsed, gguf_hf_config(parsed))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(ours) is type(theirs) and len(ours) == len(theirs)
    for text in ["Hello world! hello", " The capital of France is",
                 "<|im_start|>user\nhi<|im_end|>", "ünï 日本 🙂"]:
        ids = ours(text).input_ids
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == \
        theirs.apply_chat_template(messages, tokenize=False)
    assert (ours.bos_token, ours.eos_token_id, ours.pad_token_id) == \
        (theirs.bos_token, theirs.eos_token_id, theirs.pad_token_id)


@pytest.mark.slow
def test_smollm2_config_and_tokenizer_equal_transformers(smollm2_gguf):
    from transformers import AutoConfig, AutoTokenizer

    parsed = read_gguf(smollm2_gguf)
    config = gguf_hf_config(parsed)
    assert config.to_dict() == AutoConfig.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name).to_dict()
    ours = gguf_hf_tokenizer(parsed, config)
    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    assert type(ours) is type(theirs) and len(ours) == len(theirs)
    texts = ["The capital of France is", " leading space", "<|im_start|>user\nhi<|im_end|>",
             "ünïcödé 日本語 🙂", "tabs\t\tand\n\nnewlines", ""]
    for text in texts:
        ids = ours(text).input_ids
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "all_special_tokens"):
        assert getattr(ours, name) == getattr(theirs, name), name


@pytest.fixture
def octavo_logs(monkeypatch, caplog):
    """caplog that sees the ``octavo`` tree (``configure_logging`` stops propagation)."""
    from octavo.logger import configure_logging

    configure_logging()  # first, so the engine's own call does not undo what follows
    monkeypatch.setattr(logging.getLogger("octavo"), "propagate", True)
    caplog.set_level(logging.INFO, logger="octavo")
    return caplog


@pytest.mark.slow
def test_default_model_start_up_reads_the_file_once_and_logs_each_phase(
        smollm2_gguf, monkeypatch, octavo_logs):
    import octavo
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    gguf_file_module.clear_gguf_cache()
    parses = []
    real_parse = gguf_file_module._parse
    monkeypatch.setattr(gguf_file_module, "_parse", lambda p: parses.append(p) or real_parse(p))

    def forbidden(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", forbidden)
    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", forbidden)
    llm = octavo.LLM(kv_cache_memory_bytes=64 * 2**20)
    assert parses == [smollm2_gguf.resolve()]
    messages = [r.getMessage() for r in octavo_logs.records]
    for start in ("config: ", "tokenizer: ", "weights: loaded ", "backend cpu: ",
                  "engine ready in "):
        assert any(m.startswith(start) for m in messages), (start, messages)
    ready = next(m for m in messages if m.startswith("engine ready in "))
    assert all(phase in ready for phase in ("config", "tokenizer", "weights + KV cache"))
    out = llm.generate("The capital of France is",
                       octavo.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
