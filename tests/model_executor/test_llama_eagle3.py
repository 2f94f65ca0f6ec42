"""EAGLE-3: the target's auxiliary hidden states against transformers' ``output_hidden_states``,
the head (``octavo.model_executor.models.llama_eagle3``) against a plain re-implementation of
its formula on the same weights (a first forward over the target's aux states, then a later
one-token step fed the head's own output), the draft-to-target id mapping, and the loader's
checks (one clear line each).

Reference: ``g = fc(concat(aux))`` (or the previous row's ``p``), then transformers' own
``LlamaAttention`` (q/k/v widened to ``2 * hidden``) over ``concat(input_layernorm(embed),
hidden_norm(g))``, the residual ``g``, transformers' ``LlamaMLP`` after the post-attention norm,
``norm`` and the head's LM head; causal attention over the whole sequence. Ours runs through
the paged KV cache in chunks over non-contiguous blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from octavo.attention.base import AttentionMetadata
from octavo.attention.reference import ReferenceAttentionBackend
from octavo.config import ModelConfig
from octavo.model_executor.loader.eagle_loader import check_eagle3_head, load_eagle3_head
from octavo.model_executor.models import builtin_registry
from octavo.testing.eagle_heads import (
    default_draft_token_ids,
    eagle3_head_tensors,
    make_tiny_eagle3_head,
    write_eagle3_head,
)
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from tests.helpers.tiny import make_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 16
TOKENS = [1, 17, 250, 33, 99, 7, 301, 45, 12, 200, 5]


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def target(target_folder: Path) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(target_folder)
    model = builtin_registry().resolve(config.architectures)(config, ReferenceAttentionBackend())
    model.load_weights(load_file(str(target_folder / "model.safetensors")).items())
    return model.eval()


def head_config(folder: Path, load_format: str = "auto") -> ModelConfig:
    return ModelConfig(model=str(folder), gguf_file=None, model_dir=folder,
                       hf_config=AutoConfig.from_pretrained(folder), dtype=torch.float32,
                       max_model_len=128, load_format=load_format)


def load(folder: Path, target: torch.nn.Module):
    return load_eagle3_head(head_config(folder), target, ReferenceAttentionBackend(),
                            torch.device("cpu"))


def paged_metadata(start: int, end: int, table: list[int]) -> AttentionMetadata:
    positions = range(start, end)
    slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
    return AttentionMetadata.from_lists(slots, [0, end - start], [end], [table])


# ---- the target's auxiliary hidden states ----------------------------------------------------


def test_aux_hidden_states_are_the_streams_entering_the_layers(target_folder: Path,
                                                               target) -> None:
    """Layer i's aux state is transformers' ``hidden_states[i]`` (the embedding for 0), in
    the order asked, over two chunks through paged blocks; none is written unless asked."""
    body = target.model
    assert body.aux_hidden_states is None
    layers = (3, 0, 2)
    aux = body.set_aux_hidden_state_layers(layers, max_tokens=32, dtype=torch.float32,
                                           device=torch.device("cpu"))
    attn = body.layers["0"].self_attn
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
              for _ in body.layers]
    table = [13, 4, 9, 2]
    got = []
    try:
        with torch.inference_mode():
            for start, end in ((0, 7), (7, len(TOKENS))):
                target(torch.tensor(TOKENS[start:end]), torch.arange(start, end), caches,
                       paged_metadata(start, end, table))
                got.append(aux[: end - start].clone())
    finally:
        body.aux_hidden_state_layers, body.aux_hidden_states = (), None
    hf = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([TOKENS]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0] for i in layers], dim=-1)
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


def test_aux_layers_outside_the_target_are_refused(target) -> None:
    with pytest.raises(ValueError, match=r"auxiliary hidden-state layers \[1, 4, 2\]"):
        target.model.set_aux_hidden_state_layers((1, 4, 2), 8, torch.float32,
                                                 torch.device("cpu"))


# ---- the head --------------------------------------------------------------------------------


def reference_head(folder: Path, target, next_ids: list[int], hidden_in: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, draft-vocabulary logits)`` of every row, from the formula, given each row's hidden
    input ``g`` (``[n, hidden]``: fc(aux) or a fed-back p), float32, whole sequence."""
    config = AutoConfig.from_pretrained(folder)
    config._attn_implementation = "eager"
    tensors = load_file(str(folder / "model.safetensors"))
    hidden = config.hidden_size
    embed = tensors.get("embed_tokens.weight", target.model.embed_tokens.weight.detach())
    attn = LlamaAttention(config, 0)
    for name in ("q_proj", "k_proj", "v_proj"):
        out = tensors[f"midlayer.self_attn.{name}.weight"].shape[0]
        setattr(attn, name, torch.nn.Linear(2 * hidden, out, bias=False))
    attn.load_state_dict({k.removeprefix("midlayer.self_attn."): v for k, v in tensors.items()
                          if k.startswith("midlayer.self_attn.")})
    mlp = LlamaMLP(config)
    mlp.load_state_dict({k.removeprefix("midlayer.mlp."): v for k, v in tensors.items()
                         if k.startswith("midlayer.mlp.")})

    def norm(name: str) -> LlamaRMSNorm:
        module = LlamaRMSNorm(hidden, config.rms_norm_eps)
        module.weight.data.copy_(tensors[name])
        return module

    n = len(next_ids)
    with torch.no_grad():
        e = norm("midlayer.input_layernorm.weight")(embed[torch.tensor(next_ids)])
        x = torch.cat([e, norm("midlayer.hidden_norm.weight")(hidden_in)], dim=-1)[None]
        positions = torch.arange(n)[None]
        cos_sin = LlamaRotaryEmbedding(config)(x, positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        a = attn(x, position_embeddings=cos_sin, attention_mask=mask)[0][0]
        before = getattr(config, "norm_before_residual", False)
        r = (norm("midlayer.hidden_norm.weight")(hidden_in) if before else hidden_in) + a
        p = r + mlp(norm("midlayer.post_attention_layernorm.weight")(r))
        logits = norm("norm.weight")(p) @ tensors["lm_head.weight"].T
    return p, logits


@pytest.mark.parametrize("with_embedding,norm_before_residual", [(False, False), (True, True)])
def test_head_matches_formula_first_and_later_step(tmp_path: Path, target_folder: Path,
                                                   target, with_embedding: bool,
                                                   norm_before_residual: bool) -> None:
    folder = make_tiny_eagle3_head(tmp_path / "head", target_folder, seed=3,
                                   with_embedding=with_embedding)
    if norm_before_residual:  # some EAGLE-3 trainers' variant (a config flag)
        import json

        config = json.loads((folder / "config.json").read_text())
        config["norm_before_residual"] = True
        (folder / "config.json").write_text(json.dumps(config))
    else:
        assert not getattr(AutoConfig.from_pretrained(folder), "norm_before_residual", False)
    head = load(folder, target)
    assert (head.embed_tokens is not None) == with_embedding
    hidden = target.config.hidden_size
    aux = torch.randn(len(TOKENS), 3 * hidden, generator=torch.Generator().manual_seed(0))
    attn = head.midlayer.self_attn
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)]
    table = [13, 4, 9, 2]
    ps = []
    with torch.inference_mode():
        # The first forward over the target's rows, in two chunks (fc applied).
        for start, end in ((0, 7), (7, len(TOKENS))):
            ps.append(head(torch.tensor(TOKENS[start:end]), torch.arange(start, end), caches,
                           paged_metadata(start, end, table),
                           head.combine_hidden_states(aux[start:end])))
        p_first = torch.cat(ps)
        # A later one-token step: the next position, its token the previous proposal, its
        # hidden input the head's own p of the previous row (no fc).
        n = len(TOKENS)
        proposal = int(head.compute_logits(p_first[-1:]).argmax())
        p_step = head(torch.tensor([proposal]), torch.tensor([n]), caches,
                      paged_metadata(n, n + 1, table), p_first[-1:])
    fc = load_file(str(folder / "model.safetensors"))["fc.weight"]
    g = aux @ fc.T
    ref_p, ref_logits = reference_head(folder, target, TOKENS, g)
    torch.testing.assert_close(p_first, ref_p, atol=1e-4, rtol=1e-4)
    ref_p2, ref_logits2 = reference_head(folder, target, TOKENS + [proposal],
                                         torch.cat([g, ref_p[-1:]]))
    torch.testing.assert_close(p_step, ref_p2[-1:], atol=1e-4, rtol=1e-4)
    # Logits come over the target vocabulary: the draft logits at the target ids of the draft
    # tokens (d + d2t[d]), -inf elsewhere; the argmax maps back through d2t.
    ids = torch.tensor(default_draft_token_ids(target.config.vocab_size))
    with torch.inference_mode():
        logits = head.compute_logits(torch.cat([p_first, p_step]))
    draft_logits = torch.cat([ref_logits, ref_logits2[-1:]])
    assert logits.shape == (n + 1, target.config.vocab_size)
    torch.testing.assert_close(logits[:, ids], draft_logits, atol=1e-4, rtol=1e-4)
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[:, outside]).all()
    assert torch.equal(logits.argmax(dim=-1), ids[draft_logits.argmax(dim=-1)])
    # A sampled request's q: the draft's softmax scattered into the target vocabulary.
    q = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(q[:, ids], torch.softmax(draft_logits, dim=-1))
    assert not q[:, outside].any()


def test_full_vocabulary_head_without_d2t(tmp_path: Path, target_folder: Path,
                                          target) -> None:
    """A head over the whole target vocabulary needs no d2t: its logits are the LM head's."""
    config = AutoConfig.from_pretrained(target_folder)
    tensors = eagle3_head_tensors(config, draft_token_ids=list(range(config.vocab_size)))
    del tensors["d2t"], tensors["t2d"]
    head = load(write_eagle3_head(tmp_path / "head", config, tensors, [0, 3, 1]), target)
    p = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = head.compute_logits(p)
    torch.testing.assert_close(logits, head.norm(p) @ tensors["lm_head.weight"].T)


def test_shared_embedding_is_the_targets(tmp_path: Path, target_folder: Path,
                                         target) -> None:
    head = load(make_tiny_eagle3_head(tmp_path / "head", target_folder), target)
    ids = torch.tensor([3, 5, 7])
    torch.testing.assert_close(head.embed(ids), target.model.embed_tokens(ids))
    names = {name for name, _ in head.named_parameters()}
    assert not any("embed" in n for n in names), names
    assert "lm_head.weight" in names  # its own, over the draft vocabulary


# ---- bad heads: one clear line each ----------------------------------------------------------


def bad_head(tmp_path: Path, target_folder: Path, edit, **config_fields) -> Path:
    config = AutoConfig.from_pretrained(target_folder)
    tensors = eagle3_head_tensors(config)
    edit(tensors)
    return write_eagle3_head(tmp_path / "head", config, tensors, [0, 3, 1], **config_fields)


@pytest.mark.parametrize("edit,fields,message", [
    (lambda t: t.pop("d2t"), {}, "307-token draft vocabulary but no 'd2t'"),
    (lambda t: t.update({"fc.weight": t["fc.weight"][:, :128].contiguous()}), {},
     r"fc.weight of the EAGLE-3 head .* has shape \[64, 128\], expected \[64, 192\]"),
    (lambda t: t.pop("fc.weight"), {}, "has no 'fc.weight', so it is not an EAGLE-3 head"),
    (lambda t: None, {"draft_vocab_size": 400},
     "draft vocabulary of 400 tokens, more than the target's 384"),
    (lambda t: None, {"target_hidden_size": 32}, "trained on target hidden size 32"),
    (lambda t: None, {"eagle_aux_hidden_state_layer_ids": [1, 2, 7]},
     r"reads target layers \[1, 2, 7\], but the target has 4 layers"),
    (lambda t: t.update({"d2t": t["d2t"][:10].contiguous()}), {},
     r"'d2t' of the EAGLE-3 head .* has shape \[10\], expected \[307\]"),
    (lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:, :32].contiguous()}), {},
     r"lm_head.weight of the EAGLE-3 head .* expected \[307, 64\]"),
])
def test_bad_heads_are_one_clear_line(tmp_path: Path, target_folder: Path, target, edit,
                                      fields, message) -> None:
    folder = bad_head(tmp_path, target_folder, edit, **fields)
    with pytest.raises(ValueError, match=message) as info:
        load(folder, target)
    assert "\n" not in str(info.value)


def test_d2t_out_of_the_target_vocabulary_is_refused(tmp_path: Path, target_folder: Path,
                                                     target) -> None:
    folder = bad_head(tmp_path, target_folder,
                      lambda t: t.update({"d2t": t["d2t"] + 200}))
    with pytest.raises(ValueError, match="maps draft tokens outside the target's 384-token"):
        load(folder, target)


def test_default_aux_layers_need_a_deep_enough_target(tmp_path: Path) -> None:
    """vLLM's default (2, L // 2, L - 3) does not fit a 2-layer target: the error says to set
    eagle_aux_hidden_state_layer_ids."""
    two = make_tiny_model(tmp_path / "two", "llama")
    config = AutoConfig.from_pretrained(two)
    folder = write_eagle3_head(tmp_path / "head", config, eagle3_head_tensors(config))
    shapes = {k: tuple(v.shape) for k, v in load_file(str(folder / "model.safetensors")).items()}
    with pytest.raises(ValueError, match=r"reads target layers \[2, 1, -1\].*set "
                                         "eagle_aux_hidden_state_layer_ids"):
        check_eagle3_head(AutoConfig.from_pretrained(folder), config, shapes, str(folder))
