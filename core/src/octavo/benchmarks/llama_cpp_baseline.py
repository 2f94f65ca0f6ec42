"""llama.cpp (``llama-cpp-python``) on the same GGUF file, for ``--compare-llama-cpp``.

One request at a time, as llama.cpp's own ``llama-bench`` measures: the prompt is evaluated in
one call (prompt processing, tokens/s), then each new token is the argmax of the last logits
and is evaluated alone (decode, tokens/s). No sampler, no detokenization: the figures are the
model's compute in llama.cpp's kernels plus a ctypes call per token. The greedy tokens are
returned too, so the caller can check Octavo's against them.

``llama-cpp-python`` is an optional dependency (``pip install 'octavo[llama-cpp]'``; it builds
llama.cpp from source with the machine's C++ compiler, several minutes on two cores).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = ("pip install llama-cpp-python (or `pip install 'octavo[llama-cpp]'`; it "
                "compiles llama.cpp, a few minutes)")


@dataclass(slots=True)
class LlamaCppRequest:
    """What one request measured."""

    # Prompt tokens evaluated, and the seconds that took.
    prompt_tokens: int
    prompt_s: float
    # Greedy output tokens (the first comes from the prompt's logits).
    output_ids: list[int]
    # Seconds from the first output token to the last (output_len - 1 single-token evals).
    decode_s: float


@dataclass(slots=True)
class LlamaCppResult:
    """Means over the timed requests."""

    requests: list[LlamaCppRequest]
    n_threads: int
    version: str

    @property
    def prompt_tokens_per_s(self) -> float:
        return (sum(r.prompt_tokens for r in self.requests)
                / max(sum(r.prompt_s for r in self.requests), 1e-9))

    @property
    def decode_tokens_per_s(self) -> float:
        steps = sum(len(r.output_ids) - 1 for r in self.requests)
        return steps / max(sum(r.decode_s for r in self.requests), 1e-9)

    @property
    def ms_per_output_token(self) -> float:
        return 1000.0 / self.decode_tokens_per_s


def load_llama_cpp(gguf_file: Path, n_threads: int, n_ctx: int):
    """A ``llama_cpp.Llama`` on ``gguf_file`` (CPU only, quiet); ImportError with the install
    hint when the package is missing."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ImportError(f"--compare-llama-cpp needs llama-cpp-python: {INSTALL_HINT}") from exc
    return llama_cpp.Llama(model_path=str(gguf_file), n_ctx=n_ctx, n_batch=512,
                           n_threads=n_threads, n_threads_batch=n_threads, n_gpu_layers=0,
                           logits_all=False, verbose=False)


def greedy_generate(llm, prompt: list[int], output_len: int) -> LlamaCppRequest:
    """Evaluate ``prompt`` then ``output_len`` greedy tokens (EOS ignored), timed."""
    import llama_cpp
    import numpy as np

    n_vocab = llm.n_vocab()

    def argmax_last() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                       shape=(n_vocab,))
        return int(logits.argmax())

    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    output = [argmax_last()]
    first = time.perf_counter()
    while len(output) < output_len:
        llm.eval([output[-1]])
        output.append(argmax_last())
    end = time.perf_counter()
    return LlamaCppRequest(len(prompt), first - start, output, end - first)


def run_llama_cpp_latency(gguf_file: Path, prompts: list[list[int]], output_len: int,
                          n_threads: int, num_warmup: int = 1) -> LlamaCppResult:
    """Each prompt alone (the first ``num_warmup`` untimed), ``output_len`` greedy tokens."""
    import llama_cpp

    n_ctx = max(len(p) for p in prompts) + output_len + 8
    llm = load_llama_cpp(gguf_file, n_threads, n_ctx)
    try:
        for prompt in prompts[:num_warmup]:
            greedy_generate(llm, prompt, min(output_len, 8))
        requests = [greedy_generate(llm, p, output_len) for p in prompts[num_warmup:]]
    finally:
        llm.close()
    return LlamaCppResult(requests, n_threads, getattr(llama_cpp, "__version__", "?"))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two greedy outputs (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
