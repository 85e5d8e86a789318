"""Where speculative decoding's draft tokens come from: a smaller model (its own KV cache, kept in step with the
target's tokens) or prompt lookup (tokens copied from an earlier occurrence of the context's last n-gram).

A drafter proposes up to k tokens after a token history; it never decides what is emitted (the target's
verify step does), so a poor drafter costs speed, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from gpt2edge.errors import GenerationError, ModelFolderError
from gpt2edge.runtime.decoding.sampling import SamplingParams
from gpt2edge.runtime.model.contract import LM
from gpt2edge.runtime.model.folder import ModelFolder
from gpt2edge.runtime.speculative.cache import CachedSequence
from gpt2edge.runtime.speculative.rules import Dist, greedy_token, target_dist


@dataclass
class Draft:
    """Proposed tokens, and q: the distribution each was drawn from (None: deterministic drafts)."""

    tokens: list[int]
    q: list[Dist] | None = None


def lookup(history: Sequence[int], ngram: int, k: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the history's last n-gram, n from `ngram` down to 1
    (transformers' prompt_lookup_num_tokens / llama.cpp's lookup decoding). The latest occurrence with k tokens
    after it wins (recent context is the likeliest to repeat), else the one with the most tokens after it."""
    h = np.asarray(history, dtype=np.int64)
    last = np.flatnonzero(h[:-1] == h[-1])  # earlier positions of the last token: where a match can end
    for n in range(min(ngram, len(h) - 1), 0, -1):
        # an n-gram match ending at j < len(h) - 1 (so at least one token follows it): h[j - i] == h[-1 - i]
        hits = last[last >= n - 1]
        for i in range(1, n):
            hits = hits[h[hits - i] == h[-1 - i]]
        if hits.size:
            ends = hits + 1  # where the copied tokens start
            full = ends[ends + k <= len(h)]
            start = int(full[-1]) if full.size else int(ends[0])
            return h[start : start + k].tolist()
    return []


class PromptLookupDrafter:
    """Drafts from the token history alone: no second model, deterministic drafts."""

    def __init__(self, ngram: int) -> None:
        self.ngram = ngram

    def propose(
        self, history: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator, n_generated: int
    ) -> Draft:
        return Draft(lookup(history, self.ngram, k) if k > 0 else [])


class ModelDrafter:
    """Drafts k tokens autoregressively with a draft model: greedy picks under greedy decoding, else draws from
    its processed distribution q (the same temperature / top-k / top-p as the target). Its cache follows the
    target's history: before each proposal it keeps the common prefix (rolling back rejected drafts) and feeds
    the rest."""

    def __init__(self, lm: LM, length: int, dead_room: int) -> None:
        self.seq = CachedSequence(lm, length, dead_room)
        self.n_positions = lm.n_positions

    def propose(
        self, history: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator, n_generated: int
    ) -> Draft:
        """Up to k tokens after `history`, of which the last n_generated were generated (min_new_tokens)."""
        k = min(k, self.n_positions - len(history))  # the draft model's own position limit
        if k <= 0:
            return Draft([])
        seen = list(history) if params.repetition_penalty != 1.0 else []
        lp = self.seq.sync(history)
        tokens: list[int] = []
        qs: list[Dist] = []
        for i in range(k):
            seen_i = np.asarray(seen + tokens if seen else (), dtype=np.int64)
            if params.greedy:
                tokens.append(greedy_token(lp, params, seen_i, n_generated + i))
            else:
                q = target_dist(lp, params, seen_i, n_generated + i)
                tokens.append(q.sample(rng))
                qs.append(q)
            if i + 1 < k:
                lp = self.seq.feed(tokens[-1:])
        return Draft(tokens, qs or None)


def draft_warnings(target: ModelFolder, draft: ModelFolder) -> list[str]:
    """Refuse a draft whose token ids mean something else than the target's; warn when it is not smaller."""
    _check_same_vocabulary(target, draft)
    cost = [f.manifest["graph"].get("decode_weight_bytes") or f.model_bytes() for f in (target, draft)]
    if cost[1] >= cost[0]:
        return [
            f"the draft {draft.path} reads {cost[1] / 1e6:.3g} MB per decode step, the target {target.path} "
            f"{cost[0] / 1e6:.3g} MB: a draft that is not smaller makes speculative decoding slower than plain "
            "decoding."
        ]
    return []


def _check_same_vocabulary(target: ModelFolder, draft: ModelFolder) -> None:
    """Same vocabulary: the same tokenizer vocabulary (token -> id, from tokenizer.json's content), the same
    graph output size, and the same `vocab` manifest field (a vocabulary-trimmed head records it)."""
    vocab = [f.manifest.get("vocab") for f in (target, draft)]
    if vocab[0] != vocab[1]:
        which = "the draft's" if vocab[1] is not None else "the target's"
        raise ModelFolderError(
            f"The draft {draft.path} and the target {target.path} have different vocabularies ({which} head is "
            "vocabulary-trimmed; the manifests' `vocab` fields differ); use a draft made the same way as the target."
        )
    sizes = [f.dims["vocab_size"] for f in (target, draft)]
    tokens = [Tokenizer.from_file(str(f.tokenizer_path)).get_vocab(with_added_tokens=True) for f in (target, draft)]
    if sizes[0] != sizes[1] or tokens[0] != tokens[1]:
        raise ModelFolderError(
            f"The draft {draft.path} has another vocabulary than the target {target.path} ({sizes[1]} vs "
            f"{sizes[0]} outputs, tokenizer.json vocabularies {'equal' if tokens[0] == tokens[1] else 'differ'}); "
            "a draft must use the target's tokenizer (e.g. distilgpt2 or a quantized copy for gpt2)."
        )


def check_lookup(ngram: object) -> int:
    """--prompt-lookup N: the longest n-gram to match, an integer >= 1."""
    if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1:
        raise GenerationError(
            f"--prompt-lookup must be an integer >= 1 (the longest n-gram matched; 2 or 3 is typical), got {ngram!r}."
        )
    return ngram
