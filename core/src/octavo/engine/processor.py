"""``Processor``: the one validator of requests, turning a prompt and ``SamplingParams`` into
``EngineCoreRequest``s.

Every check of a request that is not about HTTP or the OpenAI schema happens here, before
anything is queued anywhere (and before anything is made per completion): the prompt (type,
valid Unicode, token ids in the vocabulary, not empty, within ``max_model_len``), the sampling
settings against the engine's limits (``n`` at most ``max_n``, stop strings' count and length,
logprob counts) and the model (token ids named in ``stop_token_ids``/``logit_bias``), against
the backend's capabilities, and whether the request could ever fit the KV cache. ``SamplingParams`` checks its own ranges when
it is built. Every problem is an ``octavo.errors.InvalidRequestError`` carrying the engine-side
field (``param``) and a ``code``; the OpenAI server maps it to a 400, ``LLM.generate`` raises
it as the ``ValueError`` it is. The scheduler only asserts what was checked here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Union

from octavo.backends.backend import BackendCapabilities
from octavo.backends.capabilities import check_request
from octavo.config import LoRAConfig, ModelConfig
from octavo.errors import (
    CODE_CONTEXT_LENGTH_EXCEEDED,
    CODE_EMPTY_PROMPT,
    CODE_INVALID_TEXT,
    CODE_KV_CACHE_TOO_SMALL,
    CODE_TOO_MANY,
    InvalidRequestError,
    InvalidRequestTypeError,
)
from octavo.lora.peft import inspect_adapter
from octavo.lora_request import LoRARequest
from octavo.messages import EngineCoreRequest
from octavo.sample.logits_processor import LogitsProcessorRegistry
from octavo.sampling_params import BeamSearchParams, SamplingParams
from octavo.structured_output.grammar import validate as validate_structured_outputs

# A prompt: text, token ids, or a dict with "prompt" or "prompt_token_ids".
PromptType = Union[str, list[int], dict[str, Any]]

# Most stop strings one request may give, and the longest one in characters. Their matching
# costs scale with the longest (the text scanned per step), not with how many there are
# (octavo.engine.stop_strings), but both stay bounded.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_LENGTH = 1024


@dataclasses.dataclass(slots=True)
class ProcessedPrompt:
    """A request ready for the engine core, plus what the output side needs."""

    # The prompt text (None when token ids were given).
    prompt: str | None
    # Tokenized prompt.
    prompt_token_ids: list[int]
    # The user's params with all_stop_token_ids filled in (a copy of the user's).
    params: SamplingParams
    # One per completion (n of them, or best_of), each with its own resolved params; one for a
    # beam search.
    core_requests: list[EngineCoreRequest]
    # The beam search's settings (None: sampling).
    beam_search: BeamSearchParams | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheCapacity:
    """The engine's KV cache, known once the engine core has allocated it."""

    # Number of blocks.
    num_blocks: int
    # Tokens per block.
    block_size: int

    def blocks(self, num_tokens: int) -> int:
        """Blocks ``num_tokens`` tokens take."""
        return -(-num_tokens // self.block_size)

    def fits(self, num_tokens: int) -> bool:
        return self.blocks(num_tokens) <= self.num_blocks


class Processor:
    """Tokenizes and validates requests (see the module docstring for every check).

    :param backend: the selected backend's name, with its ``capabilities``; requests asking
        more than those are refused (``octavo.backends.capabilities.check_request``).
    :param clip_max_tokens: True (offline ``LLM``): a ``max_tokens`` beyond the room left in
        ``max_model_len`` is lowered to that room. False (the OpenAI server): it is refused
        with ``context_length_exceeded``, as OpenAI does.
    :param scheduling_policy: the engine's (``priority`` must be 0 unless it is "priority").
    :param max_num_seqs: the engine's sequence cap (a beam search needs ``beam_width`` at once).
    :param logits_processors: the registered logits processors requests may name (None: none).
    :param lora_config: the engine's multi-LoRA settings (None: requests may not name an
        adapter).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        eos_token_ids: set[int],
        backend: str | None = None,
        capabilities: BackendCapabilities | None = None,
        clip_max_tokens: bool = True,
        scheduling_policy: str = "fcfs",
        max_num_seqs: int | None = None,
        logits_processors: LogitsProcessorRegistry | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        # Adapters checked already: lora_int_id -> (name, path).
        self._checked_loras: dict[int, tuple[str, str]] = {}
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        if capabilities is not None and backend is None:
            raise TypeError("Processor: capabilities need the name of their backend (backend=...)")
        self.backend = backend
        self.capabilities = capabilities
        self.clip_max_tokens = clip_max_tokens
        self.scheduling_policy = scheduling_policy
        self.max_num_seqs = max_num_seqs
        self.logits_processors = logits_processors
        # Set once the engine core has allocated the KV cache (None: not checked yet).
        self.kv_cache: KVCacheCapacity | None = None

    # ---- prompts ----------------------------------------------------------------------------

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt, every token id checked."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError(
                    "a prompt dict needs a 'prompt' or 'prompt_token_ids' key", param="prompt")
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(check_text(prompt, "prompt")).input_ids)
        if isinstance(prompt, (list, tuple)):
            return None, self.check_token_ids(prompt)
        raise InvalidRequestTypeError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}",
            param="prompt",
        )

    def check_token_ids(self, token_ids: Any, param: str = "prompt") -> list[int]:
        """``token_ids`` as a list, each one an int in the vocabulary."""
        vocab = self.model_config.vocab_size
        ids = list(token_ids)
        for tid in ids:
            if isinstance(tid, bool) or not isinstance(tid, int):
                raise InvalidRequestTypeError(
                    f"prompt token ids must be integers, got {tid!r}", param=param)
            if not 0 <= tid < vocab:
                raise InvalidRequestError(
                    f"prompt token id {tid} is out of the vocabulary [0, {vocab})", param=param)
        return ids

    # ---- whole requests ---------------------------------------------------------------------

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedPrompt:
        """Validate one request and make its ``n`` (or ``best_of``) engine-core requests; the
        completions after the first fork its prompt blocks (``fork_from``)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestTypeError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}")
        self.check_lora(lora_request)
        self._check_params(params)
        self._check_priority(priority)
        text, token_ids = self.tokenize(prompt)
        text, token_ids = self._truncate(text, token_ids, params.truncate_prompt_tokens)
        max_tokens = self._check_length(len(token_ids), params.max_tokens)
        if self.kv_cache is not None:
            self._check_fits_kv_cache(len(token_ids), max_tokens)
        params = dataclasses.replace(params, all_stop_token_ids=set(self.eos_token_ids),
                                     bad_words_token_ids=self._bad_words_token_ids(params))
        arrival = arrival_time if arrival_time is not None else time.time()
        num = params.num_completions
        core_requests = [
            EngineCoreRequest(
                request_id=child_request_id(request_id, i, num),
                prompt_token_ids=token_ids,
                sampling_params=_completion_params(params, i, max_tokens),
                arrival_time=arrival,
                priority=priority,
                fork_from=child_request_id(request_id, 0, num) if i else None,
                lora_request=lora_request,
            )
            for i in range(num)
        ]
        return ProcessedPrompt(text, token_ids, params, core_requests)

    def process_any(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedPrompt:
        """``process``, or ``process_beam_search`` for a ``BeamSearchParams`` (which runs
        without a LoRA adapter)."""
        if not isinstance(params, BeamSearchParams):
            return self.process(request_id, prompt, params, arrival_time, priority, lora_request)
        if lora_request is not None:
            raise InvalidRequestError("beam search with a LoRA adapter is not supported",
                                      param="lora_request")
        return self.process_beam_search(request_id, prompt, params, arrival_time, priority)

    def process_beam_search(
        self,
        request_id: str,
        prompt: PromptType,
        params: BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> ProcessedPrompt:
        """Validate a beam search and make its one engine-core request (its beams are the
        engine core's; see ``octavo.scheduler.beam_search``)."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestTypeError(
                f"beam search params must be a BeamSearchParams, got {type(params).__name__}")
        self._check_priority(priority)
        if self.max_num_seqs is not None and params.beam_width > self.max_num_seqs:
            raise InvalidRequestError(
                f"beam_width ({params.beam_width}) must be at most max_num_seqs "
                f"({self.max_num_seqs}): every beam runs in each step", param="beam_width")
        eos = set() if params.ignore_eos else set(self.eos_token_ids)
        num_candidates = max(2, 1 + len(eos)) * params.beam_width
        if num_candidates > self.model_config.vocab_size:
            raise InvalidRequestError(
                f"beam_width {params.beam_width} needs {num_candidates} candidates per step, more "
                f"than the vocabulary's {self.model_config.vocab_size} tokens", param="beam_width")
        text, token_ids = self.tokenize(prompt)
        max_tokens = self._check_length(len(token_ids), params.max_tokens)
        if self.kv_cache is not None:
            capacity = self.kv_cache
            blocks = capacity.blocks(len(token_ids)) + params.beam_width * (
                capacity.blocks(max_tokens) + 1)
            if blocks > capacity.num_blocks:
                raise InvalidRequestError(
                    f"a beam search of width {params.beam_width} over {len(token_ids)} prompt "
                    f"tokens and up to {max_tokens} generated needs up to {blocks} KV blocks; the "
                    f"cache has {capacity.num_blocks}. Lower beam_width or max_tokens, or give the "
                    "KV cache more memory.", param="max_tokens", code=CODE_KV_CACHE_TOO_SMALL)
        # The beams' steps: greedy, with the top candidates' logprobs; EOS ends nothing by
        # itself (the search decides).
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                  logprobs=num_candidates, all_stop_token_ids=set(self.eos_token_ids))
        if self.capabilities is not None:
            assert self.backend is not None, "checked in __init__"
            check_request(self.backend, self.capabilities, sampling)
        core_request = EngineCoreRequest(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=sampling,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority, beam_search=params)
        return ProcessedPrompt(text, token_ids, sampling, [core_request], beam_search=params)

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """Check a request's adapter: LoRA enabled, its folder a PEFT adapter of this model
        within ``max_lora_rank`` (read once per adapter id), the id naming one folder."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestTypeError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}",
                param="lora_request")
        if self.lora_config is None:
            raise InvalidRequestError(
                f"request names LoRA adapter {lora_request.lora_name!r} but the engine runs "
                "without LoRA: start it with --enable-lora (LLM(enable_lora=True))",
                param="lora_request")
        key = (lora_request.lora_name, lora_request.lora_path)
        known = self._checked_loras.get(lora_request.lora_int_id)
        if known == key:
            return
        if known is not None:
            raise InvalidRequestError(
                f"lora_int_id {lora_request.lora_int_id} already names adapter {known[0]!r} at "
                f"{known[1]!r}: give adapter {key[0]!r} another id", param="lora_request")
        inspect_adapter(lora_request.lora_name, lora_request.lora_path,
                        self.lora_config.max_lora_rank, self.model_config.hf_config)
        self._checked_loras[lora_request.lora_int_id] = key

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int) or not (
                -(2**63) <= priority < 2**63):
            raise InvalidRequestTypeError(
                f"priority must be a 64-bit integer, got {priority!r}", param="priority")
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority {priority} was given but the engine schedules first come first served; "
                "start it with --scheduling-policy priority (or leave priority at 0)",
                param="priority")

    def _truncate(self, text: str | None, token_ids: list[int],
                  truncate_prompt_tokens: int | None) -> tuple[str | None, list[int]]:
        """Keep the last ``truncate_prompt_tokens`` prompt tokens (-1: ``max_model_len``); the
        text becomes the kept tokens' text when anything was cut."""
        keep = truncate_prompt_tokens
        if keep is None:
            return text, token_ids
        if keep == -1:
            keep = self.model_config.max_model_len
        if len(token_ids) <= keep:
            return text, token_ids
        kept = token_ids[len(token_ids) - keep:]
        return self.tokenizer.decode(kept), kept

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]] | None:
        """Each bad word's token sequence as generated at the start of the output and after
        a space (vLLM's rule: the spaced form only when it differs and is as long)."""
        if not params.bad_words:
            return None
        sequences: list[list[int]] = []
        for word in params.bad_words:
            plain = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            for ids in (plain, spaced):
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _check_params(self, params: SamplingParams) -> None:
        if params.n > self.model_config.max_n:
            raise InvalidRequestError(
                f"n must be at most {self.model_config.max_n} (max_n), got {params.n}",
                param="n", code=CODE_TOO_MANY,
            )
        if len(params.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(params.stop)}",
                param="stop", code=CODE_TOO_MANY,
            )
        for stop in params.stop:
            check_text(stop, "stop")
            if len(stop) > MAX_STOP_STRING_LENGTH:
                raise InvalidRequestError(
                    f"stop strings may have at most {MAX_STOP_STRING_LENGTH} characters, got one "
                    f"of {len(stop)}", param="stop", code=CODE_TOO_MANY,
                )
        vocab = self.model_config.vocab_size
        for token_id in params.allowed_token_ids or []:
            if token_id >= vocab:
                raise InvalidRequestError(
                    f"token id {token_id} in allowed_token_ids is out of the vocabulary "
                    f"[0, {vocab})", param="allowed_token_ids")
        if params.logits_processors:
            if self.logits_processors is None:
                raise InvalidRequestError("this engine has no logits processors",
                                          param="logits_processors")
            self.logits_processors.validate(params.logits_processors)
        if params.num_completions > self.model_config.max_n:
            raise InvalidRequestError(
                f"best_of must be at most {self.model_config.max_n} (max_n), got "
                f"{params.num_completions}", param="best_of", code=CODE_TOO_MANY)
        if params.max_token_id >= vocab:
            named_in_stop_ids = params.max_token_id in params.stop_token_ids
            param = "stop_token_ids" if named_in_stop_ids else "logit_bias"
            raise InvalidRequestError(
                f"token id {params.max_token_id} in {param} is out of the vocabulary [0, {vocab})",
                param=param,
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            limit = self.model_config.max_logprobs
            if value is not None and value > limit:
                raise InvalidRequestError(
                    f"{name} must be at most {limit} (max_logprobs), got {value}", param=name)
        if params.structured_outputs is not None:
            kind, text = params.structured_outputs.key()
            check_text(text, f"structured_outputs.{kind}")
            validate_structured_outputs(params.structured_outputs)
        if self.capabilities is not None:
            assert self.backend is not None, "checked in __init__"
            check_request(self.backend, self.capabilities, params)

    def _check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The effective max_tokens of a prompt of ``num_prompt_tokens`` tokens."""
        max_len = self.model_config.max_model_len
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty: give at least one token",
                                      param="prompt", code=CODE_EMPTY_PROMPT)
        room = max_len - num_prompt_tokens
        if room < 1:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_len} tokens, but the prompt has "
                f"{num_prompt_tokens}: the prompt and at least one generated token must fit. "
                "Shorten the prompt or raise max_model_len.",
                param="prompt", code=CODE_CONTEXT_LENGTH_EXCEEDED,
            )
        if max_tokens is None:
            return room
        if max_tokens > room and not self.clip_max_tokens:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_len} tokens, but "
                f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the "
                f"prompt + {max_tokens} for the completion); shorten the prompt or lower "
                "max_tokens",
                param="max_tokens", code=CODE_CONTEXT_LENGTH_EXCEEDED,
            )
        return min(max_tokens, room)

    def _check_fits_kv_cache(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request that could never fit the whole KV cache (it would wait forever)."""
        capacity = self.kv_cache
        assert capacity is not None
        worst_case = num_prompt_tokens + max_tokens
        if not capacity.fits(worst_case):
            raise InvalidRequestError(
                f"the request needs up to {worst_case} tokens of KV cache (prompt "
                f"{num_prompt_tokens} + max_tokens {max_tokens}) but the whole cache holds "
                f"{capacity.num_blocks * capacity.block_size} tokens ({capacity.num_blocks} "
                f"blocks of {capacity.block_size}). Lower max_tokens or give the KV cache more "
                "memory.",
                param="max_tokens", code=CODE_KV_CACHE_TOO_SMALL,
            )


def check_text(text: str, param: str) -> str:
    """``text`` if it is valid Unicode; lone surrogates (``"\\ud800"``, which JSON can carry)
    cannot be tokenized or encoded and are refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} is not valid Unicode: {exc.reason} at position {exc.start} "
            f"({text[exc.start:exc.end]!a})", param=param, code=CODE_INVALID_TEXT,
        ) from None
    return text


def _completion_params(params: SamplingParams, index: int, max_tokens: int) -> SamplingParams:
    """Completion ``index``'s own settings: its seed, the effective max_tokens, ``n`` of 1.

    Prompt logprobs are the same for every completion: only the first computes them (the
    others fork its prompt blocks). With ``best_of > n`` every completion reports its sampled
    tokens' logprobs (at least), which rank them.
    """
    num = params.num_completions
    logprobs = params.logprobs
    if num > params.n and logprobs is None:
        logprobs = 0
    return dataclasses.replace(
        params,
        n=1,
        best_of=None,
        seed=child_seed(params.seed, index, num),
        max_tokens=max_tokens,
        min_tokens=min(params.min_tokens, max_tokens),
        logprobs=logprobs,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
        truncate_prompt_tokens=None,
        all_stop_token_ids=params.all_stop_token_ids,
        bad_words_token_ids=params.bad_words_token_ids,
    )


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The engine-core id of completion ``index`` of ``n`` of a request."""
    return request_id if n == 1 else f"{index}_{request_id}"


def child_seed(seed: int | None, index: int, n: int) -> int | None:
    """Seed of completion ``index``: the request's seed for n == 1, else one derived from it."""
    if seed is None or n == 1:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
