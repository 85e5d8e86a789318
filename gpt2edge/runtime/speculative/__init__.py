"""Speculative decoding: the Speculator that drives a target with a draft (speculator), the drafters (a draft
model or prompt lookup: drafters), the acceptance rules (rules) and the draft's rollback-able cache (cache).
Nothing is imported here: import the module."""
