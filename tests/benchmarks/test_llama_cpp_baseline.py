"""Where Octavo's greedy tokens and llama.cpp's differ: the margins that tell a near-tie from a
real difference (``octavo.benchmarks.llama_cpp_baseline``), and the latency bench's summary
that reports them. llama.cpp itself is replaced by its log-probabilities: building
llama-cpp-python takes minutes, so CI does not install it."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from octavo.benchmarks import llama_cpp_baseline as baseline
from octavo.cli.bench import _LlamaCppTurns


def log_softmax(logits: list[float]) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def test_first_divergence():
    assert baseline.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert baseline.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert baseline.first_divergence([1, 2], [1, 2, 3]) == 2


def test_close_logprobs_are_a_near_tie():
    llama = log_softmax([2.00, 2.04, 0.0, -1.0])  # prefers token 1 by 0.04 nats
    # Octavo prefers token 0 by 0.03 nats; its logprobs are shifted by its own normalisation.
    octavo = {0: -0.70, 1: -0.73, 2: -2.80, 3: -3.72}
    d = baseline.divergence(5, 0, 1, octavo, llama)
    assert d.index == 5 and (d.octavo_token, d.llama_cpp_token) == (0, 1)
    assert d.octavo_margin == pytest.approx(0.03)
    assert d.llama_cpp_margin == pytest.approx(0.04)
    assert d.near_tie
    assert d.as_dict()["near_tie"] is True


def test_disagreement_ignores_the_shift_of_each_engines_normalisation():
    llama = log_softmax([1.0, 0.9, -1.0, -2.0, -2.5])
    shifted = {t: float(llama[t]) + 0.3 for t in range(5)}
    assert baseline.divergence(0, 0, 1, shifted, llama).disagreement == pytest.approx(0.0)
    noisy = {**shifted, 2: shifted[2] + 0.05, 3: shifted[3] - 0.05, 4: shifted[4] + 0.05}
    assert baseline.divergence(0, 0, 1, noisy, llama).disagreement == pytest.approx(0.05)


def test_a_clear_preference_is_not_a_near_tie():
    llama = log_softmax([0.0, 3.0, -1.0])
    octavo = {0: -0.1, 1: -2.5, 2: -4.0}
    d = baseline.divergence(0, 0, 1, octavo, llama)
    assert d.octavo_margin == pytest.approx(2.4)
    assert d.llama_cpp_margin == pytest.approx(3.0)
    assert not d.near_tie


def test_a_token_missing_from_octavos_top_logprobs_is_not_a_near_tie():
    llama = log_softmax([0.0, 0.01, -1.0])
    d = baseline.divergence(3, 0, 1, {0: -0.5, 2: -1.5}, llama)
    assert d.octavo_margin is None and not d.near_tie
    assert d.as_dict()["octavo_margin"] is None


def test_latency_summary_explains_each_divergence(monkeypatch, capsys):
    """The bench's summary probes both engines at the first differing position of each
    diverged request (its prompt, then the tokens both chose), and only there."""
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(__version__="test"))
    probed_llama: list[list[int]] = []
    probed_octavo: list[list[int]] = []

    def fake_last_logprobs(llm, prompt, generated):
        probed_llama.append((list(prompt), list(generated)))
        return log_softmax([1.0, 1.05, -2.0, -3.0])

    def octavo_logprobs(prompt, index):
        probed_octavo.append((list(prompt), index))
        return {0: -0.6, 1: -0.62, 2: -3.6, 3: -4.6}

    monkeypatch.setattr(baseline, "last_logprobs", fake_last_logprobs)
    turns = _LlamaCppTurns.__new__(_LlamaCppTurns)
    turns.baseline = baseline
    turns.threads = 2
    turns.llm = types.SimpleNamespace(close=lambda: None)
    turns.requests = [
        baseline.LlamaCppRequest(2, 0.1, [3, 1, 2], 0.2),  # equal
        baseline.LlamaCppRequest(2, 0.1, [3, 1, 2], 0.2),  # differs at index 1
    ]
    octavo = {"decode_tokens_per_s": 20.0, "prompt_tokens_per_s": 40.0}
    out = turns.summary(octavo, [[7, 8], [9, 10]], [[3, 1, 2], [3, 0, 2]], octavo_logprobs)
    assert out["greedy_identical_to_llama_cpp"] == "1/2"
    assert out["greedy_first_divergence"] == [None, 1]
    assert probed_octavo == [([9, 10], 1)]
    assert probed_llama == [([9, 10], [3])]  # the prompt, then the tokens both engines chose
    (d,) = out["greedy_divergences"]
    assert (d["index"], d["octavo_token"], d["llama_cpp_token"]) == (1, 0, 1)
    assert d["near_tie"] is True
    assert "divergence at token 1" in capsys.readouterr().out
