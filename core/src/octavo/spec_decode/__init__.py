"""Speculative decoding: proposers that guess a request's next tokens, and the rejection
sampler that keeps the longest prefix of a guess the target model's own sampling agrees with.

How a step runs (``--speculative-config``, ``octavo.config.SpeculativeConfig``):

1. after a request's tokens of a step are recorded, the scheduler asks the proposer for up to
   ``num_speculative_tokens`` draft tokens (``Request.spec_token_ids``);
2. the next step schedules the request's last token plus its drafts (``1 + k`` tokens, KV slots
   for all of them; ``SchedulerOutput.scheduled_spec_decode_tokens``), and the model runner
   computes logits at all ``1 + k`` positions in one forward (attention with several query
   tokens over the paged cache, as for a prefill chunk after a cached prefix);
3. ``rejection_sampler.rejection_sample`` accepts drafts while the target agrees and emits
   one more token of the target's own (``1 .. k + 1`` tokens per request);
4. the scheduler rolls ``num_computed_tokens`` back past the rejected drafts: their KV slots
   are written again by the next step before anything reads them.
"""
