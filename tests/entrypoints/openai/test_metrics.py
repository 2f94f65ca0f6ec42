"""``/metrics`` parses with prometheus_client's parser and moves as requests run."""

from __future__ import annotations

from octavo.entrypoints.openai.metrics import METRICS

from tests.entrypoints.openai.conftest import SERVED_NAME, metrics, wait_idle


def test_every_metric_is_exported_and_moves(server, client) -> None:
    before = wait_idle(server)
    for name, kind, _ in METRICS:
        suffix = {"counter": "_total", "histogram": "_count"}.get(kind, "")
        if name == "request_success":
            assert 'octavo:request_success_total{finished_reason="length"}' in before
        elif name == "num_preemptions":
            for mode in ("recompute", "swap"):
                assert f'octavo:num_preemptions_total{{mode="{mode}"}}' in before
        elif name == "spec_decode_num_accepted_tokens_per_pos":
            continue  # a series per draft position, once speculation has run (test_spec_decode)
        else:
            assert f"octavo:{name}{suffix}" in before, name
    resp = client.completions.create(model=SERVED_NAME, prompt=["Hello world", "Hello there"], max_tokens=5,
                                     temperature=0, extra_body={"ignore_eos": True})
    after = wait_idle(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["octavo:prompt_tokens_total"] == resp.usage.prompt_tokens
    assert delta["octavo:generation_tokens_total"] == 10
    assert delta['octavo:request_success_total{finished_reason="length"}'] == 2
    assert delta["octavo:time_to_first_token_seconds_count"] == 2
    assert delta["octavo:inter_token_latency_seconds_count"] == 8
    assert delta["octavo:e2e_request_latency_seconds_count"] == 2
    assert delta["octavo:e2e_request_latency_seconds_sum"] > 0
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "time_per_output_token_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_params_n", "request_params_max_tokens"):
        assert delta[f"octavo:{name}_count"] == 2, name
    assert delta["octavo:request_generation_tokens_sum"] == 10
    assert delta["octavo:request_params_max_tokens_sum"] == 10
    assert delta["octavo:request_prefill_time_seconds_sum"] > 0
    assert delta["octavo:iteration_tokens_total_count"] >= 1
    assert delta["octavo:prefix_cache_queries_total"] >= resp.usage.prompt_tokens - 2
    # The same prompt again: its full blocks come from the prefix cache.
    hits_before = metrics(server)["octavo:prefix_cache_hits_total"]
    client.completions.create(model=SERVED_NAME, prompt="Hello world " * 20, max_tokens=2)
    client.completions.create(model=SERVED_NAME, prompt="Hello world " * 20, max_tokens=2)
    after = metrics(server)
    assert after["octavo:prefix_cache_hit_rate"] > 0
    assert after["octavo:prefix_cache_hits_total"] - hits_before >= 32  # two full blocks
