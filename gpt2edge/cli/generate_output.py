"""How `gpt2edge generate` prints: streamed or whole, one result per prompt or sequence, --json, timings."""

from __future__ import annotations

import click

from gpt2edge.cli.common import print_json


def note_ignored_knobs(sample: bool, knobs: dict) -> None:
    """Sampling options given while sampling is off: one line on stderr instead of silently switching modes."""
    given = [f"--{k.replace('_', '-')}" for k, v in knobs.items() if v is not None]
    if given and not sample:
        verb = "has" if len(given) == 1 else "have"
        click.echo(f"note: sampling is off (greedy): {', '.join(given)} {verb} no effect; add --do-sample.", err=True)


def separator(prompt: int, n_prompts: int, seq: int = 0, n_seqs: int = 1) -> None:
    """The stdout line before each of several results, so that texts with newlines of their own stay apart:
    `--- prompt 2/3 ---`, `--- sequence 1/4 ---` or `--- prompt 2/3, sequence 1/4 ---`; none for one result."""
    parts = [f"prompt {prompt + 1}/{n_prompts}"] if n_prompts > 1 else []
    parts += [f"sequence {seq + 1}/{n_seqs}"] if n_seqs > 1 else []
    if parts:
        click.echo(f"--- {', '.join(parts)} ---")


def generate_each(gen, texts: list[str], requests: list, stream: bool, as_json: bool) -> bool:
    """Each prompt on its own (requests: Generator.request of each), streamed or printed; returns whether
    Ctrl-C stopped it."""
    results = []
    for i, (text, request) in enumerate(zip(texts, requests)):
        if not as_json:
            separator(i, len(texts))
        result = _stream_one(gen, text, request) if stream else gen.generate(request)
        results.append(result)
        if not as_json and stream:
            print_finish(result)
        if not as_json and not stream:
            _print_result(text, result)
        if not as_json:
            print_timings(result.timings, len(result.token_ids))
        if result.finish_reason == "interrupted":
            break
    if as_json:
        _print_json_results(texts, results)
    return any(r.finish_reason == "interrupted" for r in results)


def _stream_one(gen, text: str, request):
    """Print the prompt, then the generated text as it is decoded; returns the GenerationResult."""
    results: list = []
    pieces = gen.stream(request, result=results)
    click.echo(text, nl=False)
    try:
        for piece in pieces:
            click.echo(piece, nl=False)
    finally:
        click.echo()  # end the line, also when Ctrl-C cut the stream
    return results[0]


def generate_batch(gen, texts: list[str], request, as_json: bool) -> bool:
    """All prompts as one left-padded batch (one request); returns whether Ctrl-C stopped it."""
    results = gen.generate(request)
    if as_json:
        _print_json_results(texts, results)
    else:
        for i, (text, r) in enumerate(zip(texts, results)):
            separator(i, len(texts))
            _print_result(text, r)
        print_timings(results[0].timings, sum(len(r.token_ids) for r in results))
    return any(r.finish_reason == "interrupted" for r in results)


def generate_search(gen, batches: list[list[str]], requests: list, as_json: bool) -> bool:
    """Beam search or several sequences per prompt, one row per sequence (prompt by prompt, best first), all
    prompts as one batch or (--sequential) a batch of one each, each printed once done; returns whether Ctrl-C
    stopped it."""
    rows: list = []
    done = 0  # prompts printed before this batch
    n_texts = sum(map(len, batches))
    for batch, request in zip(batches, requests):
        results = gen.generate(request)
        # num_return_sequences > 1 gives a list per prompt
        groups = [res if isinstance(res, list) else [res] for res in results]
        new = [(t, r) for t, group in zip(batch, groups) for r in group]
        rows += new
        if not as_json:
            for p, (t, group) in enumerate(zip(batch, groups)):
                for j, r in enumerate(group):
                    separator(done + p, n_texts, j, len(group))
                    _print_result(t, r)
            print_timings(new[0][1].timings, sum(len(r.token_ids) for _, r in new))
        done += len(batch)
        if any(r.finish_reason == "interrupted" for _, r in new):
            break
    if as_json:
        objs = [{"prompt": t, **r.to_json()} for t, r in rows]
        print_json(objs[0] if len(objs) == 1 else {"results": objs})
    return any(r.finish_reason == "interrupted" for _, r in rows)


def note_folder_search(search, instead: str) -> None:
    """generation_config.json asks for beam search or several sequences and no flag said otherwise: one line on
    stderr saying what the command does instead of what the user may expect (`instead`: how, and its fix)."""
    counts = {"num_beams": search.num_beams, "num_return_sequences": search.num_return_sequences}
    asked = [k for k, v in counts.items() if v > 1]
    flags = " ".join(f"--{k.replace('_', '-')} 1" for k in asked)
    asks = " and ".join(f"{k}={counts[k]}" for k in asked)
    click.echo(f"note: the model's generation_config.json asks for {asks}; {instead.format(flags=flags)}", err=True)


def _print_result(text: str, result) -> None:
    click.echo(text + result.text)
    print_finish(result)


def print_finish(result) -> None:
    """Why the text ended (length, eos, stop, interrupted), and a beam's score, on stderr."""
    score = "" if result.sequence_score is None else f", score {result.sequence_score:.4f}"
    click.echo(f"[finish: {result.finish_reason}{score}]", err=True)


def _print_json_results(texts: list[str], results: list) -> None:
    """One object for one prompt, else {"results": [...]} (shorter when Ctrl-C stopped a --sequential run)."""
    objs = [{"prompt": t, **r.to_json()} for t, r in zip(texts, results)]
    print_json(objs[0] if len(texts) == 1 else {"results": objs})


def print_timings(t: dict, n_tokens: int) -> None:
    spec = "acceptance_rate" in t  # speculative decoding: one decode step is one target (verify) step
    step = "ms per target step" if spec else "ms/token"
    click.echo(
        f"[{n_tokens} tokens | prefill {t['prefill_ms']:.1f} ms | decode {t['decode_ms_per_token_mean']:.2f} {step} "
        f"(mean) | sampler {t['sampler_ms_per_token_mean']:.3f} ms/token | {t['tokens_per_s']:.1f} tokens/s]",
        err=True,
    )
    if spec:
        click.echo(
            f"[speculative: {t['accepted_tokens']:.0f} of {t['draft_tokens']:.0f} draft tokens accepted "
            f"({t['acceptance_rate'] * 100:.0f} %) | {t['tokens_per_target_step']:.2f} tokens per target step | "
            f"{t['decode_ms_per_token_mean']:.2f} ms per target step | {t['target_steps']:.0f} target steps | "
            f"drafting {t['draft_ms_total']:.1f} ms]",
            err=True,
        )
