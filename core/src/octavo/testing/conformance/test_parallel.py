"""The backend split over two ranks (tensor parallelism) gives what one rank gives.

Run where the backend can have two ranks here (on the host: two worker processes; on GPUs:
two visible devices); elsewhere the plan leaves it out and the run's header says so. In float32
greedy ids must be equal; in a 16-bit dtype the choices are checked against Hugging Face
within the dtype's tolerance (the sums of a split matmul round differently).
"""

from __future__ import annotations

from octavo.testing.compare import GreedyEquivalence
from octavo.testing.engine_checks import assert_no_leaks, greedy, prompts_of_lengths, token_ids
from octavo.testing.engines import open_llm

NUM_TOKENS = 12
PROMPTS = prompts_of_lengths([5, 17, 33], seed=11)


def test_tensor_parallel_equals_one_rank(octavo_plan, octavo_tiny_llama,
                                         octavo_tensor_parallel_size):
    with open_llm(octavo_plan, octavo_tiny_llama) as llm:
        reference = token_ids(llm.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False))
    with open_llm(octavo_plan, octavo_tiny_llama,
                  tensor_parallel_size=octavo_tensor_parallel_size) as llm:
        split = token_ids(llm.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False))
        assert_no_leaks(llm)
    GreedyEquivalence(octavo_tiny_llama, octavo_plan.model_dtype).check(
        PROMPTS, split, reference, f"tensor parallel {octavo_tensor_parallel_size}")
