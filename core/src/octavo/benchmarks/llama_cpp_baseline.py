"""llama.cpp (``llama-cpp-python``) on the same GGUF file, for ``--compare-llama-cpp``.

One request at a time, as llama.cpp's own ``llama-bench`` measures: the prompt is evaluated in
one call (prompt processing, tokens/s), then each new token is the argmax of the last logits
and is evaluated alone (decode, tokens/s). No sampler, no detokenization: the figures are the
model's compute in llama.cpp's kernels plus a ctypes call per token. The greedy tokens are
returned too, so the caller can check Octavo's against them, and where they differ
(``Divergence``) each engine's log-probabilities at that position say whether it is a near-tie.

``llama-cpp-python`` is an optional dependency (``pip install 'octavo[llama-cpp]'``; it builds
llama.cpp from source with the machine's C++ compiler, several minutes on two cores).
"""

from __future__ import annotations

import math
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


def last_logprobs(llm, prompt: list[int], generated: list[int]):
    """llama.cpp's log-probabilities (float64 numpy, natural log) of the token after
    ``prompt + generated``, reached as ``greedy_generate`` reaches it (the prompt in one call,
    then each generated token alone): the numbers llama.cpp chose its token from."""
    llm.reset()
    llm.eval(prompt)
    for token in generated:
        llm.eval([token])
    return logprobs_now(llm)


def logprobs_now(llm):
    """llama.cpp's log-probabilities (float64 numpy, natural log) of the token after what it
    has evaluated so far."""
    import llama_cpp
    import numpy as np

    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                   shape=(llm.n_vocab(),)).astype(np.float64)
    shifted = logits - logits.max()
    return shifted - math.log(float(np.exp(shifted).sum()))


# Below this many nats between two tokens, which one an engine picks is decided by rounding
# (int8 activations, the order of sums): the two engines' logprobs of the same token differ by
# several hundredths of a nat anyway (``Divergence.disagreement``; docs/benchmarks.md).
NEAR_TIE_NATS = 0.1


@dataclass(slots=True)
class Divergence:
    """The first position where Octavo's and llama.cpp's greedy tokens differ, and by how much
    each engine preferred its own token there (log-probability differences, nats)."""

    index: int
    octavo_token: int
    llama_cpp_token: int
    # Octavo's logprob of its token minus that of llama.cpp's; None when llama.cpp's token is
    # not among Octavo's top logprobs at that position.
    octavo_margin: float | None
    # llama.cpp's logprob of its token minus that of Octavo's.
    llama_cpp_margin: float
    # Median |difference| of the two engines' logprobs over Octavo's top tokens there, less
    # their median (a shift from normalising): how far apart their numbers are anyway.
    disagreement: float

    @property
    def near_tie(self) -> bool:
        return (self.octavo_margin is not None
                and max(self.octavo_margin, self.llama_cpp_margin) < NEAR_TIE_NATS)

    def as_dict(self) -> dict:
        margin = None if self.octavo_margin is None else round(self.octavo_margin, 4)
        return {"index": self.index, "octavo_token": self.octavo_token,
                "llama_cpp_token": self.llama_cpp_token, "octavo_margin": margin,
                "llama_cpp_margin": round(self.llama_cpp_margin, 4),
                "disagreement": round(self.disagreement, 4), "near_tie": self.near_tie}


def divergence(index: int, octavo_token: int, llama_cpp_token: int,
               octavo_logprobs: dict[int, float], llama_cpp_logprobs) -> Divergence:
    """Margins at a divergence from Octavo's top logprobs (token id -> logprob, its own token
    included) and llama.cpp's full log-probabilities at the same position."""
    theirs = octavo_logprobs.get(llama_cpp_token)
    octavo_margin = None if theirs is None else octavo_logprobs[octavo_token] - theirs
    llama_margin = float(llama_cpp_logprobs[llama_cpp_token] - llama_cpp_logprobs[octavo_token])
    # Each engine normalises over its own logits, which shifts all its logprobs alike: measure
    # the differences around their median, as the margins (differences of two tokens) do.
    deltas = sorted(lp - float(llama_cpp_logprobs[t]) for t, lp in octavo_logprobs.items())
    shift = deltas[len(deltas) // 2]
    disagreement = sorted(abs(d - shift) for d in deltas)[len(deltas) // 2]
    return Divergence(index, octavo_token, llama_cpp_token, octavo_margin, llama_margin,
                      disagreement)


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
