"""Capability negotiation (``octavo.backends.capabilities``): what a backend declares, the
start-up check of a configuration, the admission check of a request, and their messages."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from octavo.backends import Availability, Backend, BackendCapabilities
from octavo.backends.backend import KNOWN_DTYPES
from octavo.backends.capabilities import (
    UnsupportedByBackendError,
    check_config,
    check_head_dim,
    check_request,
    fit_max_model_len,
)
from octavo.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from octavo.sampling_params import SamplingParams

# ---- BackendCapabilities ---------------------------------------------------------------------


def test_defaults_limit_nothing_but_the_dtypes():
    """A plugin written before a field existed keeps working: every new field is permissive."""
    caps = BackendCapabilities()
    assert caps.dtypes == ("float32", "bfloat16")
    assert caps.head_dims is None and caps.block_sizes is None
    assert caps.max_num_seqs is None and caps.max_model_len is None
    assert caps.prompt_logprobs is True and caps.max_logprobs is None
    assert caps.cuda_graphs is False


def test_lists_are_kept_as_tuples():
    caps = BackendCapabilities(dtypes=["float16"], head_dims=[64, 128], block_sizes=[16])
    assert (caps.dtypes, caps.head_dims, caps.block_sizes) == (("float16",), (64, 128), (16,))
    assert hash(caps) == hash(BackendCapabilities(dtypes=("float16",), head_dims=(64, 128),
                                                  block_sizes=(16,)))


@pytest.mark.parametrize("kwargs, message", [
    ({"dtypes": ("bf16",)}, "dtypes must be a non-empty tuple of"),
    ({"dtypes": ()}, "dtypes must be a non-empty tuple of"),
    ({"dtypes": "float32"}, "dtypes must be a non-empty tuple of"),
    ({"head_dims": ()}, "head_dims must be None (any) or a non-empty tuple of positive integers"),
    ({"head_dims": (64, 0)}, "head_dims must be None"),
    ({"block_sizes": (16.0,)}, "block_sizes must be None"),
    ({"max_num_seqs": 0}, "max_num_seqs must be None (no limit) or a positive integer, got 0"),
    ({"max_model_len": True}, "max_model_len must be None (no limit) or a positive integer"),
    ({"max_logprobs": -1}, "max_logprobs must be None (no limit) or an integer >= 0, got -1"),
    ({"kv_cache_dtypes": ("fp8",)}, "kv_cache_dtypes must hold 'auto' and optionally 'fp8'"),
    ({"kv_cache_dtypes": ("auto", "fp8_e5m2")}, "kv_cache_dtypes must hold 'auto'"),
    ({"default_max_num_batched_tokens": 0}, "default_max_num_batched_tokens must be a positive"),
])
def test_a_bad_declaration_fails_at_registration(kwargs, message):
    with pytest.raises(ValueError) as info:
        BackendCapabilities(**kwargs)
    assert message in str(info.value)


def test_known_dtypes_are_the_cli_choices():
    from octavo.cli.main import build_parser

    generate = next(a for a in build_parser()._actions if a.dest == "command").choices["generate"]
    dtype = next(a for a in generate._actions if a.dest == "dtype")
    # "half" and "float" are vLLM's aliases of float16 and float32.
    assert set(dtype.choices) - {"auto", "half", "float"} == set(KNOWN_DTYPES)


def test_real_backends_declare_what_their_kernels_support():
    import octavo_cpu.plugin
    import octavo_cuda.plugin
    from octavo.kernels.triton.attention import SUPPORTED_HEAD_DIMS

    registered: list[Backend] = []
    octavo_cpu.plugin.plugin.octavo_register_backends(register=registered.append)
    octavo_cuda.plugin.plugin.octavo_register_backends(register=registered.append)
    cpu, cuda = (b.capabilities for b in registered)
    assert cpu.head_dims is None and cpu.block_sizes is None and not cpu.cuda_graphs
    assert set(cpu.dtypes) == set(KNOWN_DTYPES)
    assert cuda.head_dims == SUPPORTED_HEAD_DIMS  # the Triton kernels' list, not a copy of it
    assert set(cuda.dtypes) == set(KNOWN_DTYPES) and cuda.cuda_graphs
    assert cpu.kv_cache_dtypes == cuda.kv_cache_dtypes == ("auto", "fp8")
    # The token budget: large prompt steps keep a GPU busy; the CPU keeps decodes responsive.
    assert (cpu.default_max_num_batched_tokens, cuda.default_max_num_batched_tokens) == \
        (2048, 8192)
    for caps in (cpu, cuda):  # the sampler is the core's: every logprob count, prompt logprobs
        assert caps.prompt_logprobs and caps.max_logprobs is None
        assert caps.max_num_seqs is None and caps.max_model_len is None


# ---- check_config ----------------------------------------------------------------------------

LIMITED = BackendCapabilities(dtypes=("float32",), head_dims=(64, 128), block_sizes=(8, 32),
                              max_num_seqs=8, max_model_len=1024)


def _backend(name: str, caps: BackendCapabilities = LIMITED, available: bool = True) -> Backend:
    return Backend(name=name, device_type="cpu", priority=1, package=f"octavo-backend-{name}",
                   is_available=lambda: Availability(available, "ok" if available else "no device"),
                   capabilities=caps)


def _config(dtype=torch.float32, head_dim=64, block_size=8, max_num_seqs=8,
            max_model_len=1024, cache_dtype="auto") -> EngineConfig:
    hf_config = SimpleNamespace(num_attention_heads=4, hidden_size=4 * head_dim, head_dim=head_dim,
                                vocab_size=100)
    return EngineConfig(
        model_config=ModelConfig(model="m", gguf_file=None, model_dir=Path("."),
                                 hf_config=hf_config, dtype=dtype, max_model_len=max_model_len),
        cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs),
        parallel_config=ParallelConfig(),
    )


def test_a_supported_configuration_passes():
    assert check_config(_backend("npu"), _config()) is None
    assert check_config(_backend("npu"), _config(head_dim=128, block_size=32, max_num_seqs=1,
                                                 max_model_len=16)) is None


@pytest.mark.parametrize("overrides, expected", [
    ({"dtype": torch.bfloat16},
     "backend 'npu' does not support dtype bfloat16 (supported: float32). Use --dtype float32"),
    ({"head_dim": 96},
     ("backend 'npu' does not support head_dim 96, the model's attention head size "
      "(supported: 64, 128).")),
    ({"block_size": 16},
     "backend 'npu' does not support block_size 16 (supported: 8, 32). Use --block-size 8"),
    ({"cache_dtype": "fp8_e4m3"},
     ("backend 'npu' does not support kv_cache_dtype fp8_e4m3 (supported: auto). "
      "Use --kv-cache-dtype auto")),
    ({"max_num_seqs": 256},
     ("backend 'npu' does not support max_num_seqs 256 (supported: at most 8). "
      "Use --max-num-seqs 8")),
    ({"max_model_len": 4096},
     ("backend 'npu' does not support max_model_len 4096 (supported: at most 1024). "
      "Use --max-model-len 1024")),
])
def test_each_unsupported_value_names_backend_value_support_and_fix(overrides, expected):
    with pytest.raises(UnsupportedByBackendError) as info:
        check_config(_backend("npu"), _config(**overrides))
    assert isinstance(info.value, ValueError)  # what the CLI and the server report as such
    assert str(info.value).startswith(expected), str(info.value)


def test_fp8_kv_cache_passes_where_declared_and_bad_values_are_refused():
    fp8 = BackendCapabilities(kv_cache_dtypes=("auto", "fp8"))
    for value in ("fp8", "fp8_e4m3"):
        assert check_config(_backend("npu", fp8), _config(cache_dtype=value)) is None
    with pytest.raises(ValueError, match="e5m2 is not supported.*--kv-cache-dtype fp8"):
        CacheConfig(cache_dtype="fp8_e5m2")


def test_block_size_16_is_suggested_when_supported():
    caps = BackendCapabilities(dtypes=("float32",), block_sizes=(8, 16, 32))
    with pytest.raises(UnsupportedByBackendError, match=r"Use --block-size 16\.$"):
        check_config(_backend("npu", caps), _config(block_size=12))


def test_other_backends_are_suggested_only_if_available_and_supporting():
    others = [
        _backend("npu"),  # the selected one itself is never suggested
        _backend("wide", BackendCapabilities(dtypes=("float32", "bfloat16"))),
        _backend("narrow", BackendCapabilities(dtypes=("float32",))),
        _backend("absent", BackendCapabilities(dtypes=("bfloat16",)), available=False),
    ]
    with pytest.raises(UnsupportedByBackendError) as info:
        check_config(_backend("npu"), _config(dtype=torch.bfloat16), others=others)
    assert str(info.value).endswith("Use --dtype float32 or --device wide.")
    with pytest.raises(UnsupportedByBackendError) as info:
        check_config(_backend("npu"), _config(head_dim=96), others=others)
    assert str(info.value).endswith("Use --device wide or --device narrow.")


def test_without_a_fix_or_an_alternative_it_says_so():
    with pytest.raises(UnsupportedByBackendError) as info:
        check_config(_backend("npu"), _config(head_dim=80), others=[_backend("twin")])
    assert str(info.value).endswith("No other installed backend that runs here supports it.")


def test_a_crashing_probe_of_another_backend_does_not_hide_the_error():
    def crash() -> Availability:
        raise OSError("driver exploded")

    broken = Backend(name="broken", device_type="x", priority=5, package="p", is_available=crash)
    with pytest.raises(UnsupportedByBackendError, match="Use --dtype float32.$"):
        check_config(_backend("npu"), _config(dtype=torch.float16), others=[broken])


def test_head_dim_of_an_attention_implementation_names_it():
    check_head_dim("cuda", 64, (64, 128), kernel="triton")
    check_head_dim("cpu", 17, None)
    with pytest.raises(UnsupportedByBackendError) as info:
        check_head_dim("cuda", 32, (64, 128), kernel="triton")
    assert str(info.value).startswith(
        "attention implementation 'triton' of backend 'cuda' does not support head_dim 32")


# ---- fit_max_model_len ------------------------------------------------------------------------


def test_the_models_length_is_lowered_to_the_backends_limit():
    npu = _backend("npu")  # max_model_len 1024
    assert fit_max_model_len(npu, 32768, requested=None) == 1024
    assert fit_max_model_len(npu, 512, requested=None) == 512
    # A length the user asked for is never changed behind their back: check_config refuses it.
    assert fit_max_model_len(npu, 4096, requested=4096) == 4096
    assert fit_max_model_len(_backend("any", BackendCapabilities()), 32768, None) == 32768


# ---- check_request ----------------------------------------------------------------------------

NO_PROMPT_LOGPROBS = BackendCapabilities(prompt_logprobs=False, max_logprobs=2)


def test_requests_within_the_limits_pass():
    for params in (SamplingParams(), SamplingParams(logprobs=2), SamplingParams(logprobs=0)):
        assert check_request("npu", NO_PROMPT_LOGPROBS, params) is None
    # No declared limit: any count the sampling params allow.
    check_request("cpu", BackendCapabilities(), SamplingParams(logprobs=1000, prompt_logprobs=50))


def test_too_many_logprobs_are_refused_with_the_field_first():
    with pytest.raises(UnsupportedByBackendError) as info:
        check_request("npu", NO_PROMPT_LOGPROBS, SamplingParams(logprobs=3))
    assert str(info.value) == (
        "logprobs must be at most 2 on backend 'npu' (the most it returns per token), got 3")
    caps = BackendCapabilities(max_logprobs=1)
    with pytest.raises(UnsupportedByBackendError, match="^prompt_logprobs must be at most 1 on "
                       "backend 'npu'.*got 4$"):
        check_request("npu", caps, SamplingParams(prompt_logprobs=4))


def test_prompt_logprobs_on_a_backend_without_them():
    with pytest.raises(UnsupportedByBackendError) as info:
        check_request("npu", NO_PROMPT_LOGPROBS, SamplingParams(prompt_logprobs=0))
    message = str(info.value)
    assert message.startswith("prompt_logprobs are not supported by backend 'npu'")
    assert "got prompt_logprobs=0" in message and "leave prompt_logprobs unset" in message


def test_the_token_budget_defaults_to_the_backends_and_an_explicit_one_wins(tiny_llama):
    from octavo.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(tiny_llama), device="cpu").create_engine_config()
    assert config.scheduler_config.max_num_batched_tokens == \
        config.backend_capabilities.default_max_num_batched_tokens == 2048
    config = EngineArgs(model=str(tiny_llama), device="cpu",
                        max_num_batched_tokens=512).create_engine_config()
    assert config.scheduler_config.max_num_batched_tokens == 512
