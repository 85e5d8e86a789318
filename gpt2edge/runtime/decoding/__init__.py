"""Decoding strategies on a model: the NumPy sampler and its logits processors (sampling, processors,
sampling_params), the greedy / sampling loop (generate), several samples per prompt (expand), beam search (beam,
beam_search), and recorded log-probs (logprobs). Nothing is imported here: import the module."""
