"""Model names from the Hugging Face hub, resolved offline from a hub-shaped cache.

Every test builds the cache ``huggingface_hub`` reads (``tests/helpers/hub_cache.py``; the
first test checks huggingface_hub itself reads it) in a temporary folder, and runs with
``HF_HUB_OFFLINE=1`` unless it replaces the hub's listing and download functions by local
stand-ins (the download path); nothing reaches the network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from octavo.engine.arg_utils import EngineArgs
from octavo.model_executor import hub
from octavo.model_executor.model_files import (
    ModelNotFoundError,
    resolve_model_path,
    resolve_tokenizer_path,
)

from tests.helpers.engine import greedy, make_llm, token_ids
from tests.helpers.hub_cache import add_to_hub_cache, folder_files

REPO = "octavo-test/tiny-llama"
GGUF_REPO = "octavo-test/tiny-llama-GGUF"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache as huggingface_hub's default (HF_HUB_CACHE), with HF_HUB_OFFLINE=1;
    any attempt to reach the hub fails the test."""
    from huggingface_hub import HfApi, constants

    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub read both when imported (before this test): set its copies too.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(HfApi, "list_repo_files",
                        lambda *a, **k: pytest.fail("the hub was contacted"))
    return folder


@pytest.fixture
def online(monkeypatch):
    """Networking allowed as far as Octavo can tell (the hub calls are stood in for)."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def tiny_gguf(tmp_path: Path) -> Path:
    from tests.model_executor.test_gguf_loader import hf_weights, write_gguf

    return write_gguf(tmp_path / "tiny.gguf", "llama", hf_weights("llama", 16, tied=False), 16)


# --- the cache layout -------------------------------------------------------------------------


def test_the_test_cache_is_what_huggingface_hub_reads(cache, tiny_llama):
    from huggingface_hub import scan_cache_dir, snapshot_download, try_to_load_from_cache

    snapshot = add_to_hub_cache(cache, REPO, folder_files(tiny_llama))
    info = scan_cache_dir(cache)
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    (revision,) = repo.revisions
    assert revision.commit_hash == snapshot.name and revision.refs == frozenset({"main"})
    assert {f.file_name for f in revision.files} == set(folder_files(tiny_llama))
    assert try_to_load_from_cache(REPO, "config.json") == str(snapshot / "config.json")
    assert snapshot_download(REPO, local_files_only=True) == str(snapshot)
    assert hub.cached_snapshot(cache, REPO, None) == snapshot


# --- names -> folders, from the cache -----------------------------------------------------------


def test_llm_runs_a_hub_name_from_the_cache_offline(cache, tiny_llama):
    add_to_hub_cache(cache, REPO, folder_files(tiny_llama))
    params = greedy(8)
    prompts = ["The capital of France is", "Once upon a time"]
    by_name = make_llm(REPO, device="cpu")
    try:
        assert by_name.llm_engine.config.model_config.model == REPO  # the served name
        got = token_ids(by_name.generate(prompts, params, use_tqdm=False))
    finally:
        by_name.llm_engine.shutdown()
    by_path = make_llm(tiny_llama, device="cpu")
    try:
        assert got == token_ids(by_path.generate(prompts, params, use_tqdm=False))
    finally:
        by_path.llm_engine.shutdown()


def test_revision_picks_the_snapshot(cache, tiny_llama, tiny_model_factory):
    main = add_to_hub_cache(cache, REPO, folder_files(tiny_llama))
    tagged = add_to_hub_cache(cache, REPO, folder_files(tiny_model_factory("qwen2")),
                              revision="v2")
    assert resolve_model_path(REPO)[1] == main
    assert resolve_model_path(REPO, revision="v2")[1] == tagged
    assert resolve_model_path(REPO, revision=main.name)[1] == main  # a commit hash
    config = EngineArgs(model=REPO, revision="v2", device="cpu").create_engine_config()
    assert config.model_config.architectures == ["Qwen2ForCausalLM"]
    with pytest.raises(ModelNotFoundError, match=r"revision v3.*HF_HUB_OFFLINE=1"):
        resolve_model_path(REPO, revision="v3")


def test_download_dir_is_the_cache_searched(cache, tmp_path, tiny_llama):
    elsewhere = tmp_path / "models"
    snapshot = add_to_hub_cache(elsewhere, REPO, folder_files(tiny_llama))
    assert resolve_model_path(REPO, download_dir=elsewhere)[1] == snapshot
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model_path(REPO)
    assert str(cache) in str(error.value)


def test_unknown_name_offline_says_what_where_and_what_to_do(cache):
    with pytest.raises(ModelNotFoundError) as error:
        EngineArgs(model="octavo-test/no-such-model", device="cpu").create_engine_config()
    message = str(error.value)
    assert "\n" not in message
    for part in ("'octavo-test/no-such-model'", "no local path", repr(str(cache)),
                 "HF_HUB_OFFLINE=1", "hf download octavo-test/no-such-model", "--download-dir"):
        assert part in message, (part, message)


def test_incomplete_snapshot_is_not_used(cache, tiny_llama):
    add_to_hub_cache(cache, REPO, {"config.json": tiny_llama / "config.json"})
    with pytest.raises(ModelNotFoundError, match="incomplete .*no tokenizer file"):
        resolve_model_path(REPO)
    files = folder_files(tiny_llama)
    del files["model.safetensors"]
    add_to_hub_cache(cache, REPO, files)
    with pytest.raises(ModelNotFoundError, match="incomplete .*no \\*.safetensors weights"):
        resolve_model_path(REPO)
    # Random weights need none: config and tokenizer are enough.
    assert resolve_model_path(REPO, need_weights=False)[1].is_dir()
    config = EngineArgs(model=REPO, device="cpu", load_format="dummy").create_engine_config()
    assert config.model_config.load_format == "dummy"


def test_tokenizer_by_hub_name(cache, tiny_llama):
    tokenizer_files = {k: v for k, v in folder_files(tiny_llama).items() if "token" in k}
    snapshot = add_to_hub_cache(cache, "octavo-test/tokenizer", tokenizer_files)
    assert resolve_tokenizer_path("octavo-test/tokenizer") == snapshot
    assert resolve_tokenizer_path(tiny_llama) == tiny_llama
    # A model repository without a tokenizer is served with --tokenizer NAME.
    no_tokenizer = {k: v for k, v in folder_files(tiny_llama).items() if "token" not in k}
    add_to_hub_cache(cache, REPO, no_tokenizer)
    with pytest.raises(ModelNotFoundError, match="needs --tokenizer"):
        EngineArgs(model=REPO, device="cpu").create_engine_config()
    config = EngineArgs(model=REPO, tokenizer="octavo-test/tokenizer",
                        device="cpu").create_engine_config()
    assert config.model_config.tokenizer == snapshot
    with pytest.raises(ModelNotFoundError, match="neither a local folder nor"):
        resolve_tokenizer_path("./no/such/tokenizer")


# --- GGUF files inside a repository -------------------------------------------------------------


def test_gguf_in_a_hub_repo_by_quant_or_file_name(cache, tmp_path):
    gguf = tiny_gguf(tmp_path)
    snapshot = add_to_hub_cache(cache, GGUF_REPO, {
        "README.md": b"tiny", "tiny-llama-Q8_0.gguf": gguf, "tiny-llama-F32.gguf": gguf})
    display, folder, file = resolve_model_path(GGUF_REPO + ":Q8_0")
    assert (display, folder, file) == (GGUF_REPO + ":Q8_0", snapshot,
                                       snapshot / "tiny-llama-Q8_0.gguf")
    assert resolve_model_path(GGUF_REPO + ":f32")[2] == snapshot / "tiny-llama-F32.gguf"
    assert resolve_model_path(GGUF_REPO, gguf_file="tiny-llama-F32.gguf")[2].name == (
        "tiny-llama-F32.gguf")
    config = EngineArgs(model=GGUF_REPO + ":Q8_0", device="cpu").create_engine_config()
    assert config.model_config.gguf_file == snapshot / "tiny-llama-Q8_0.gguf"
    assert config.model_config.hf_config.num_hidden_layers == 2  # read from the GGUF
    with pytest.raises(ModelNotFoundError, match="several .gguf files.*--gguf-file"):
        resolve_model_path(GGUF_REPO)
    with pytest.raises(ModelNotFoundError, match="no .gguf file with 'Q4_K_M'"):
        resolve_model_path(GGUF_REPO + ":Q4_K_M")


def test_gguf_file_in_a_local_folder(tmp_path):
    gguf = tiny_gguf(tmp_path)
    (tmp_path / "other.gguf").write_bytes(gguf.read_bytes())
    with pytest.raises(ModelNotFoundError, match="several .gguf files"):
        resolve_model_path(tmp_path)
    assert resolve_model_path(tmp_path, gguf_file="other.gguf")[2] == tmp_path / "other.gguf"
    with pytest.raises(ModelNotFoundError, match="--gguf-file 'missing.gguf'"):
        resolve_model_path(tmp_path, gguf_file="missing.gguf")


def test_quant_is_matched_as_a_whole_token():
    files = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-IQ4_XS.gguf", "m-Q8_0.gguf", "README.md"]
    assert hub.pick_gguf(files, "q8_0", None) == "m-Q8_0.gguf"
    assert hub.pick_gguf(files, "Q4_K_M", None) == "m-Q4_K_M.gguf"
    with pytest.raises(hub._Unavailable, match="no .gguf file with 'Q4_XS'"):
        hub.pick_gguf(files, "Q4_XS", None)  # not inside IQ4_XS
    with pytest.raises(hub._Unavailable, match="no .gguf file with 'Q4_K'"):
        hub.pick_gguf(files, "Q4_K", None)  # neither Q4_K_M nor Q4_K_S
    assert hub.pick_gguf(["config.json", *files], None, None) is None  # the HF format wins
    assert hub.pick_gguf(["one.gguf"], None, None) == "one.gguf"


def test_names_that_are_not_hub_names():
    assert hub.parse_hub_name("Qwen/Qwen2.5-0.5B-Instruct") == hub.HubName(
        "Qwen/Qwen2.5-0.5B-Instruct")
    assert hub.parse_hub_name("org/name-GGUF:Q4_K_M") == hub.HubName("org/name-GGUF", "Q4_K_M")
    assert hub.parse_hub_name("gpt2") == hub.HubName("gpt2")
    for path in ("/abs/model", "./model", "~/model", "../x/y", "a/b/c", "model.gguf", ""):
        assert hub.parse_hub_name(path) is None, path
    with pytest.raises(ModelNotFoundError, match="does not exist, and it is not a Hugging Face"):
        resolve_model_path("./no-such-folder")


# --- which files are downloaded -----------------------------------------------------------------


def test_files_fetched_are_only_what_octavo_reads():
    files = ["README.md", "config.json", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json", "merges.txt", "chat_template.jinja", "modeling_x.py",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "consolidated.safetensors", "pytorch_model.bin", "original/params.json",
             "onnx/model.onnx"]
    assert hub.metadata_files(files, trust_remote_code=False) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "merges.txt", "chat_template.jinja"]
    assert "modeling_x.py" in hub.metadata_files(files, trust_remote_code=True)
    with pytest.raises(hub._Unavailable, match="only PyTorch pickles"):
        hub.weight_files(["config.json", "pytorch_model.bin"], None)


def test_a_cache_miss_downloads_metadata_then_the_indexed_shards(tmp_path, monkeypatch,
                                                                 online, tiny_llama):
    """The download path with huggingface_hub's listing and download stood in for: the
    metadata first, then exactly the shards the index names (not consolidated.safetensors,
    not the pickles), all through snapshot_download into the cache; the second resolution
    comes from the cache without contacting the hub."""
    import huggingface_hub
    from huggingface_hub import HfApi

    source = tmp_path / "repo"
    source.mkdir()
    for name, path in folder_files(tiny_llama).items():
        (source / name).write_bytes(path.read_bytes())
    (source / hub.INDEX_FILE).write_text(
        '{"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}')
    (source / "consolidated.safetensors").write_bytes(b"other format")
    (source / "pytorch_model.bin").write_bytes(b"pickle")
    cache = tmp_path / "hub"
    listed, fetched = [], []

    def list_repo_files(self, repo_id, revision=None, **kwargs):
        listed.append((repo_id, revision))
        return sorted(folder_files(source))

    def snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None, **kw):
        import fnmatch

        wanted = {name: path for name, path in folder_files(source).items()
                  if any(fnmatch.fnmatchcase(name, p) for p in allow_patterns)}
        fetched.append(sorted(wanted))
        return str(add_to_hub_cache(Path(cache_dir), repo_id, wanted, commit="a" * 40))

    monkeypatch.setattr(HfApi, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    _, folder, _ = resolve_model_path(REPO, download_dir=cache, revision="main")
    assert listed == [(REPO, "main")]
    metadata = sorted(n for n in folder_files(source) if n.endswith((".json", ".jinja")))
    assert hub.INDEX_FILE in metadata and "config.json" in metadata
    assert fetched == [metadata, ["model.safetensors"]]
    assert folder == cache / "models--octavo-test--tiny-llama" / "snapshots" / ("a" * 40)
    assert resolve_model_path(REPO, download_dir=cache, revision="main")[1] == folder
    assert len(listed) == 1  # complete in the cache: the hub is not asked again


@pytest.mark.parametrize("failure,expected", [
    ("unreachable", "could not be reached \\(ConnectionError: no route"),
    ("missing", "no repository 'octavo-test/tiny-llama' on the Hugging Face hub"),
    ("gated", "is gated on the Hugging Face hub"),
    ("revision", "has no revision 'main' on the Hugging Face hub"),
])
def test_hub_failures_are_one_line(tmp_path, monkeypatch, online, failure, expected):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    response = SimpleNamespace(headers={}, status_code=404, request=None, text="",
                               json=dict)
    errors = {
        "unreachable": lambda: ConnectionError("no route"),
        "missing": lambda: RepositoryNotFoundError("404", response=response),
        "gated": lambda: GatedRepoError("403", response=response),
        "revision": lambda: RevisionNotFoundError("404", response=response),
    }

    def list_repo_files(self, *args, **kwargs):
        raise errors[failure]()

    monkeypatch.setattr(HfApi, "list_repo_files", list_repo_files)
    with pytest.raises(ModelNotFoundError, match=expected) as error:
        resolve_model_path(REPO, download_dir=tmp_path, revision="main")
    assert "\n" not in str(error.value)


# --- the command line ---------------------------------------------------------------------------


def test_cli_generates_from_a_hub_name_with_networking_off(tmp_path, tiny_llama):
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, REPO, folder_files(tiny_llama))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
           "OCTAVO_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "octavo.cli.main", "generate", "Hello", "--max-tokens",
               "4", "--device", "cpu", "--num-gpu-blocks-override", "64"]
    done = subprocess.run([*command, "--model", REPO], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "finish_reason=length, 4 tokens" in done.stderr
    missing = subprocess.run([*command, "--model", "octavo-test/missing"], capture_output=True,
                             text=True, env=env, timeout=300, check=False)
    assert missing.returncode == 1
    errors = [line for line in missing.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "HF_HUB_OFFLINE=1" in errors[0], missing.stderr
    assert "Traceback" not in missing.stderr


def test_serve_a_hub_name_with_networking_off(tmp_path, tiny_llama):
    """`octavo serve org/name` from the cache, answering as the offline engine on the folder;
    an unknown name is one line before anything loads."""
    import httpx

    from tests.entrypoints.openai.conftest import API_KEY, SERVED_NAME, ServerProcess

    cache = tmp_path / "hub"
    add_to_hub_cache(cache, REPO, folder_files(tiny_llama))
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "OCTAVO_LOG_LEVEL": "WARNING"}
    server = ServerProcess(REPO, env=env)
    try:
        body = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 6,
                "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120,
                            headers={"Authorization": f"Bearer {API_KEY}"})
        assert answer.status_code == 200, answer.text
        served = answer.json()["choices"][0]["text"]
    finally:
        assert server.stop() == 0
    llm = make_llm(tiny_llama, device="cpu")
    try:
        expected = llm.generate(["Once upon a time"], greedy(6), use_tqdm=False)[0]
    finally:
        llm.llm_engine.shutdown()
    assert served == expected.outputs[0].text
    missing = subprocess.run(
        [sys.executable, "-m", "octavo.cli.main", "serve", "octavo-test/missing", "--port", "0"],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=300, check=False)
    assert missing.returncode == 1
    lines = [line for line in missing.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("octavo serve: error: Model 'octavo-test/missing'"), lines
    assert "HF_HUB_OFFLINE=1" in lines[-1] and "Traceback" not in missing.stderr


def test_trust_remote_code_reaches_the_config_loader_for_a_hub_name(cache, tiny_llama):
    """A hub repository whose config class ships as code (auto_map) loads only with
    trust_remote_code, and the code is read from the snapshot."""
    files: dict[str, bytes | Path] = dict(folder_files(tiny_llama))
    config = json.loads((tiny_llama / "config.json").read_text())
    config["model_type"] = "octavo_test_hub_llama"
    config["auto_map"] = {"AutoConfig": "configuration_hub.HubLlamaConfig"}
    files["config.json"] = json.dumps(config).encode()
    files["configuration_hub.py"] = (
        b"from transformers import LlamaConfig\n\n\n"
        b"class HubLlamaConfig(LlamaConfig):\n"
        b"    model_type = 'octavo_test_hub_llama'\n")
    add_to_hub_cache(cache, REPO, files)
    with pytest.raises(ValueError, match="trust_remote_code"):
        EngineArgs(model=REPO, device="cpu").create_engine_config()
    trusted = EngineArgs(model=REPO, device="cpu", trust_remote_code=True).create_engine_config()
    hf_config = trusted.model_config.hf_config
    assert type(hf_config).__name__ == "HubLlamaConfig"
    assert hf_config.model_type == "octavo_test_hub_llama"
