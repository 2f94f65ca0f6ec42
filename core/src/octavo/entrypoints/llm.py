"""``octavo.LLM``: offline batched generation, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import itertools
import logging
from typing import Any, Sequence

from tqdm.auto import tqdm

from octavo.engine.arg_utils import EngineArgs
from octavo.engine.llm_engine import LLMEngine
from octavo.engine.output_processor import RequestOutputKind
from octavo.engine.processor import PromptType
from octavo.lora_request import LoRARequest
from octavo.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from octavo.sampling_params import BeamSearchParams, SamplingParams

ChatMessage = dict[str, Any]

logger = logging.getLogger(__name__)


def interrupted_outputs(interrupt: BaseException) -> list[RequestOutput] | None:
    """What a ``generate``/``chat`` call had produced when Ctrl-C (a ``KeyboardInterrupt``)
    stopped it, or ``None`` when ``interrupt`` did not come out of one.

    One entry per prompt, in the prompts' order: a finished prompt's output as ``generate``
    would return it; for the others, what they had generated, with ``finish_reason="abort"``
    (their requests are aborted; the engine stays usable). The interrupt itself is re-raised
    unchanged, so code that does not care sees the usual ``KeyboardInterrupt``.
    """
    return getattr(interrupt, _OUTPUTS_ATTR, None)


# Attribute of the re-raised KeyboardInterrupt that carries the outputs so far.
_OUTPUTS_ATTR = "octavo_outputs"


class LLM:
    """Load a model once, then ``generate`` or ``chat`` over batches of prompts.

    >>> llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    >>> out = llm.generate("The capital of France is", SamplingParams(temperature=0))
    >>> out[0].outputs[0].text                        # ' Paris...'

    Keyword arguments are those of ``octavo.engine.arg_utils.EngineArgs`` (``device``, ``dtype``,
    ``max_model_len``, ``block_size``, ``enable_prefix_caching``, ``max_num_seqs``, ...).
    """

    def __init__(self, model: str | None = None, device: str | None = None,
                 dtype: str = "auto", **kwargs: Any) -> None:
        args = EngineArgs(model=model, device=device, dtype=dtype, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's sampling defaults (its generation_config.json,
        unless the engine was started with ``generation_config="vllm"``)."""
        return SamplingParams(**self.llm_engine.config.model_config.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in the prompts' order.

        ``prompts``: a string, a list of token ids, a dict with ``prompt`` or
        ``prompt_token_ids``, or a list of any of those. ``sampling_params``: one for all
        prompts or one per prompt (default: ``get_default_sampling_params()``). ``priority``:
        one per prompt, lower served first (needs ``scheduling_policy="priority"``).
        ``lora_request``: the LoRA adapter to run with (needs ``enable_lora=True``), one for all
        prompts or one per prompt (``None``: the base model).
        """
        prompt_list = _as_prompt_list(prompts)
        loras = _as_lora_list(lora_request, len(prompt_list))
        params_list = _as_params_list(sampling_params, len(prompt_list),
                                      self.get_default_sampling_params)
        priorities = _as_priority_list(priority, len(prompt_list))
        request_ids = []
        # (asked, given) max_tokens of the prompts whose max_tokens was cut to fit.
        clipped: list[tuple[int, int]] = []
        try:
            for prompt, params, prio, lora in zip(prompt_list, params_list, priorities, loras):
                request_id = str(next(self._counter))
                # Only finished requests are returned: no per-step snapshots to build.
                processed = self.llm_engine.add_request(
                    request_id, prompt, params, output_kind=RequestOutputKind.FINAL_ONLY,
                    priority=prio, lora_request=lora,
                )
                request_ids.append(request_id)
                given = processed.core_requests[0].sampling_params.max_tokens
                if params.max_tokens is not None and given < params.max_tokens:
                    clipped.append((params.max_tokens, given))
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise
        if clipped:
            self._warn_clipped(clipped, len(prompt_list))
        return self._run_engine(request_ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over every prompt (in the engine: the beams share and fork their KV
        blocks); one ``BeamSearchOutput`` per prompt, in order, with ``params.beam_width``
        sequences, best score first (see ``BeamSearchParams`` for the scoring)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompt_list = _as_prompt_list(prompts)
        request_ids = []
        try:
            for prompt in prompt_list:
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, params,
                                            output_kind=RequestOutputKind.FINAL_ONLY)
                request_ids.append(request_id)
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise
        tokenizer = self.get_tokenizer()
        results = []
        for output in self._run_engine(request_ids, use_tqdm):
            results.append(BeamSearchOutput(sequences=[
                BeamSearchSequence(
                    tokens=list(output.prompt_token_ids) + list(c.token_ids),
                    logprobs=list(c.logprobs or []),
                    cum_logprob=c.cumulative_logprob or 0.0,
                    text=tokenizer.decode(list(output.prompt_token_ids) + list(c.token_ids)),
                    finish_reason=c.finish_reason,
                )
                for c in output.outputs
            ]))
        return results

    def _warn_clipped(self, clipped: list[tuple[int, int]], num_prompts: int) -> None:
        """One warning per call: max_tokens was lowered so prompt + completion fit
        ``max_model_len`` (the server refuses such requests instead)."""
        max_model_len = self.llm_engine.config.model_config.max_model_len
        asked = max(a for a, _ in clipped)
        lowest = min(g for _, g in clipped)
        logger.warning(
            "max_tokens lowered to fit max_model_len=%d for %d of %d prompt(s) (asked %d, "
            "lowered to as little as %d); pass a larger max_model_len or a smaller max_tokens "
            "to silence this", max_model_len, len(clipped), num_prompts, asked, lowest,
        )

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render conversations with the tokenizer's chat template (or ``chat_template``), then generate.

        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` dicts) are given to the
        template, which shows them to the model if it supports tools; the calls the model
        writes stay in the output text (the OpenAI server parses them).
        ``chat_template_kwargs`` are extra template variables (Qwen3's ``enable_thinking``).
        """
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, tools=tools,
                **(chat_template_kwargs or {}),
            )
            ids = tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (as vLLM's ``LLM.reset_prefix_cache``): the next
        prompts are computed whole. False, and nothing forgotten, while a request runs."""
        return self.llm_engine.reset_prefix_cache()

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req",
                   disable=not use_tqdm, dynamic_ncols=True)
        num_output_tokens = 0
        try:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict.get("elapsed") or 0.0
                        if elapsed > 0:
                            bar.set_postfix_str(f"output {num_output_tokens / elapsed:.1f} tok/s")
        except KeyboardInterrupt as interrupt:
            # Ctrl-C: keep what is done for the caller (see interrupted_outputs).
            aborted = self.llm_engine.abort_request([r for r in request_ids if r not in finished])
            finished.update((output.request_id, output) for output in aborted)
            setattr(interrupt, _OUTPUTS_ATTR, [finished[r] for r in request_ids])
            raise
        except BaseException:
            self.llm_engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise ValueError("no prompts given")
    return prompts


def _as_priority_list(priority: Any, count: int) -> list[int]:
    if priority is None:
        return [0] * count
    priority = list(priority)
    if len(priority) != count:
        raise ValueError(f"got {len(priority)} priorities for {count} prompts; give one per prompt")
    return priority


def _as_params_list(params: Any, count: int, default: Any = SamplingParams) -> list[SamplingParams]:
    if params is None:
        return [default() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, (list, tuple)):
        raise TypeError(
            "sampling_params must be a SamplingParams or a list of them, got "
            f"{type(params).__name__}"
        )
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; give one or one per prompt")
    return params


def _as_lora_list(lora: Any, count: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    if isinstance(lora, (list, tuple)):
        if len(lora) != count:
            raise ValueError(f"got {len(lora)} lora_request values for {count} prompts")
        return list(lora)
    raise TypeError(f"lora_request must be a LoRARequest, a list of them or None, got "
                    f"{type(lora).__name__}")
