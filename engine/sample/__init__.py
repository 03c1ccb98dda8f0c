"""Sampling (vLLM v1's `v1/sample`): SamplingParams per request, SamplingMetadata per
microbatch (built from the persistent InputBatch), the Sampler that turns logits rows into
tokens, and the stop checks the scheduler applies to what was appended."""
