"""``octavo serve --enable-lora`` end to end with the ``openai`` client: adapters by model name,
``/v1/models``, runtime load/unload (``OCTAVO_ALLOW_RUNTIME_LORA_UPDATING=1``), and errors."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from octavo.entrypoints.openai.serving_models import (
    LoRAModulePath,
    ServingModels,
    parse_lora_modules,
)
from octavo.lora_request import LoRARequest

from tests.entrypoints.openai.conftest import API_KEY, SERVED_NAME, ServerProcess
from tests.helpers.engine import greedy, make_llm

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lora_server(lora_models):
    modules = ["qv=" + str(lora_models.adapters["qv"]),
               json.dumps({"name": "all", "path": str(lora_models.adapters["all"]),
                           "base_model_name": SERVED_NAME})]
    srv = ServerProcess(lora_models.model, "--enable-lora", "--max-loras", "2",
                        "--max-lora-rank", "16", "--async-scheduling", "--lora-modules", *modules,
                        env={"OCTAVO_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    try:
        yield srv
    finally:
        assert srv.stop(signal.SIGINT) == 0


@pytest.fixture(scope="module")
def expected(lora_models):
    """Greedy texts of the offline engine (checked against PEFT in test_lora_engine)."""
    llm = make_llm(lora_models.model, enable_lora=True, max_loras=3, max_lora_rank=16,
                   num_gpu_blocks_override=64)
    try:
        texts = {}
        for lora_id, name in enumerate([None, "qv", "all", "mlp"]):
            lora = None if name is None else LoRARequest(name, lora_id,
                                                         str(lora_models.adapters[name]))
            out = llm.generate(PROMPT, greedy(MAX_TOKENS), use_tqdm=False, lora_request=lora)
            texts[name] = out[0].outputs[0].text
        return texts
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture
def client(lora_server):
    import openai

    with openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key=API_KEY, max_retries=0,
                       timeout=120) as c:
        yield c


def _complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=0, extra_body={"ignore_eos": True}
                                     ).choices[0].text


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers(), timeout=60)


def test_models_lists_adapters_with_parent(client, lora_models) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert {SERVED_NAME, "qv", "all"} <= set(cards)
    assert cards["qv"].parent == SERVED_NAME and cards["all"].parent == SERVED_NAME
    assert cards["qv"].root == str(lora_models.adapters["qv"])
    assert getattr(cards[SERVED_NAME], "parent", None) is None


def test_model_name_picks_the_adapter(client, expected) -> None:
    assert _complete(client, SERVED_NAME) == expected[None]
    assert _complete(client, "qv") == expected["qv"]
    assert _complete(client, "all") == expected["all"]
    chat = client.chat.completions.create(
        model="qv", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert chat.model == "qv"


def test_unknown_model_is_404(client) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        _complete(client, "no-such-adapter")
    assert info.value.body["code"] == "model_not_found"


def test_load_and_unload_at_runtime(lora_server, client, lora_models, expected) -> None:
    import openai

    path = str(lora_models.adapters["mlp"])
    response = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": path})
    assert response.status_code == 200, response.text
    assert "mlp" in {m.id for m in client.models.list().data}
    assert _complete(client, "mlp") == expected["mlp"]
    again = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": path})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    gone = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "mlp"})
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "mlp")
    missing = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "mlp"})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "lora_not_found"
    # Loaded again under the same name: served again (a fresh adapter id).
    back = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": path})
    assert back.status_code == 200
    assert _complete(client, "mlp") == expected["mlp"]


def test_bad_adapter_load_is_400_and_server_serves(lora_server, client, tmp_path, expected):
    bad = _post(lora_server, "/v1/load_lora_adapter",
                {"lora_name": "bad", "lora_path": str(tmp_path / "nothing")})
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert "no such folder" in error["message"] and error["param"] == "lora_path"
    assert _complete(client, "qv") == expected["qv"]


def test_parse_lora_modules() -> None:
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) \
        == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y", "m")]
    for bad in ["noequals", "=/x", '{"name": "b"}', "{nope"]:
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="more than once"):
        parse_lora_modules(["a=/x", "a=/y"])


def test_serving_models_without_lora() -> None:
    from octavo.entrypoints.openai.errors import OpenAIError

    models = ServingModels(["base"])
    assert models.resolve(None) == ("base", None)
    with pytest.raises(OpenAIError, match="--enable-lora") as info:
        models.add_lora("x", "/x")
    assert info.value.status_code == 400


def test_serve_refuses_bad_lora_modules_before_loading(lora_models, tmp_path, capsys) -> None:
    import torch
    from octavo.cli.main import main

    threads = torch.get_num_threads()  # `serve` gives its front end one torch thread
    base = ["serve", str(lora_models.model), "--port", "0", "--dtype", "float32"]
    try:
        assert main(base + ["--enable-lora", "--lora-modules", f"x={tmp_path / 'nope'}"]) == 1
        assert "LoRA adapter 'x': no such folder" in capsys.readouterr().err
        assert main(base + ["--lora-modules", f"qv={lora_models.adapters['qv']}"]) == 1
        assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
        assert main(base + ["--enable-lora", "--max-lora-rank", "8",
                            "--lora-modules", f"mlp={lora_models.adapters['mlp']}"]) == 1
        assert "rank 16 is over the engine's max_lora_rank 8" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


def test_two_api_servers_serve_the_same_adapters_loaded_once(lora_models, expected) -> None:
    """``--api-server-count 2 --lora-modules``: both API servers know every adapter under the
    same id (same list, same order), so whichever process a request comes through it gets the
    adapter's output, and the engine core loads each adapter into a slot once."""
    modules = ["qv=" + str(lora_models.adapters["qv"]), "all=" + str(lora_models.adapters["all"])]
    server = ServerProcess(lora_models.model, "--enable-lora", "--max-loras", "2",
                           "--max-lora-rank", "16", "--api-server-count", "2",
                           "--lora-modules", *modules, env={"OCTAVO_LOG_LEVEL": "DEBUG"})
    try:
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        for _ in range(4):  # a new connection each time: both processes answer some
            for name in (SERVED_NAME, "qv", "all"):
                response = _post(server, "/v1/completions", {**body, "model": name})
                assert response.status_code == 200, response.text
                want = expected[None if name == SERVED_NAME else name]
                assert response.json()["choices"][0]["text"] == want, name
            models = httpx.get(f"{server.url}/v1/models", headers=server.headers()).json()
            assert {"qv", "all"} <= {card["id"] for card in models["data"]}
        log = server.read_log()
    except BaseException:
        server.kill()
        raise
    assert server.stop() == 0
    assert log.count("LoRA: adapter 'qv' (1) in slot") == 1, log[-3000:]
    assert log.count("LoRA: adapter 'all' (2) in slot") == 1, log[-3000:]
