"""`gpt2edge generate`: the checks on how its options combine, and the dispatch to the runtime.

The options themselves are declared in gpt2edge.cli.generate_options.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gpt2edge.cli.common import friendly_errors, main, verify_mode, warnings_to_stderr
from gpt2edge.cli.generate_options import generate_options
from gpt2edge.cli.generate_output import (
    generate_batch,
    generate_each,
    generate_search,
    note_folder_search,
    note_ignored_knobs,
)

ONE_SEQUENCE = dict(num_beams=1, num_return_sequences=1)  # said explicitly: generation_config.json may ask for more


@main.command()
@generate_options
@friendly_errors
def generate(
    model_dir,
    prompts,
    prompt_files,
    batch_files,
    file_format,
    sequential,
    max_new_tokens,
    min_new_tokens,
    do_sample,
    temperature,
    top_k,
    top_p,
    repetition_penalty,
    min_p,
    typical_p,
    no_repeat_ngram_size,
    presence_penalty,
    frequency_penalty,
    logit_bias,
    stop_token_ids,
    ban,
    seed,
    stop,
    escape,
    ignore_eos,
    truncate,
    num_beams,
    num_return_sequences,
    length_penalty,
    early_stopping,
    device,
    threads,
    no_verify,
    full_verify,
    no_stream,
    as_json,
    logprobs,
    interactive,
    draft,
    prompt_lookup,
    draft_tokens,
    json_schema,
    json_object,
    regex,
    grammar,
    choice,
) -> None:
    """Generate text from the export folder MODEL_DIR (no PyTorch needed).

    One prompt streams; several run as one left-padded batch (--sequential: one after another), each printed
    under a `--- prompt i/n ---` line. -f FILE is one prompt (the whole file), --batch-file FILE one per line or
    JSONL. Ctrl-C stops, prints what was generated, says [interrupted] on stderr and exits with status 130.
    """
    from gpt2edge.cli.escapes import process_escapes
    from gpt2edge.prompt_input import collect_prompts, read_prompt_file

    files = prompt_files + batch_files
    constraint = constraint_of(json_schema, json_object, regex, grammar, choice)  # read and checked before the model
    _check_generate_modes(prompts, files, as_json, no_stream, logprobs, interactive, truncate, sequential)
    _check_interactive_search(interactive, num_beams, num_return_sequences, length_penalty, early_stopping)
    try:
        # prompts are read and checked before the model is loaded
        read_stdin = lambda: read_prompt_file(sys.stdin.buffer)  # noqa: E731  (bounded: stdin may never end)
        # -i without -p starts from an empty context (its turns come from stdin)
        if escape:  # llama.cpp's -e: "\\n" typed in -p / --stop means a newline
            prompts = tuple(p if p == "-" else process_escapes(p) for p in prompts)
            stop = tuple(process_escapes(s) for s in stop)
        texts = (
            []
            if interactive and not prompts
            else collect_prompts(prompts, prompt_files, file_format, read_stdin, batch_files)
        )
        speculative = dict(draft=draft, prompt_lookup=prompt_lookup, draft_tokens=draft_tokens)
        verify = verify_mode(no_verify, full_verify)
        gen = load_generator(model_dir, verify, device, threads, speculative)
        from gpt2edge.runtime.call_params import CONFIG_KEYS
        from gpt2edge.runtime.decoding.beam import search_params

        if getattr(gen.graph, "approximate", None):  # sparse-head --mode cluster: say so before any output
            click.echo(f"note: {model_dir} has an approximate LM head ({gen.graph.rec.mode}): not the model's own "
                       "distribution", err=True)  # fmt: skip
        # the CLI always passes the mode: the folder's generation_config decides it unless a flag does
        sample = do_sample if do_sample is not None else gen.sampling_params().do_sample
        knobs = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, seed=seed)
        note_ignored_knobs(sample, knobs)
        options = click.get_current_context().params
        kwargs = {k: options[k] for k in CONFIG_KEYS if k in options}  # the record's knobs (bad_words_ids: --ban)
        kwargs.update(stop_token_ids=stop_token_ids or None, do_sample=sample, ban=ban, seed=seed, stop=stop,
                      ignore_eos=ignore_eos, truncate=truncate)  # fmt: skip
        if constraint is not None:
            kwargs["constraint"] = constraint
        if interactive:
            from gpt2edge.interactive import run_interactive

            del kwargs["truncate"]  # a session drops its oldest tokens instead
            folder = search_params(gen.defaults, num_beams=num_beams, num_return_sequences=num_return_sequences)
            if folder.expands:  # generation_config.json's (-i refuses counts above 1 as flags)
                note_folder_search(folder, "-i continues one sequence per turn, so each turn decodes one (pass "
                                   "{flags} to drop this note).")  # fmt: skip
            kwargs.update(ONE_SEQUENCE)  # what a session decodes (it refuses more)
            sys.exit(run_interactive(gen, texts[0] if texts else None, kwargs))
        kwargs["logprobs"] = logprobs
        search = dict(  # beam search / several sequences per prompt: printed once complete
            num_beams=num_beams,
            num_return_sequences=num_return_sequences,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        stream = not (no_stream or as_json)
        # generation_config.json may ask for beams or several sequences too: Generator.generate follows it
        merged = search_params(gen.defaults, **search)
        # each call resolved once, every prompt checked to fit before the first one is generated (--sequential
        # would otherwise fail midway): generate() and stream() take these requests as they are
        if merged.expands:
            batches = [[t] for t in texts] if sequential else [texts]
            requests = [gen.request(b, **kwargs, **search) for b in batches]
            if stream and not search_params({}, **search).expands:  # the folder, not a flag, turned streaming off
                note_folder_search(merged, "each sequence prints once complete, not streamed (pass {flags} to stream "
                                   "one sequence).")  # fmt: skip
            interrupted = generate_search(gen, batches, requests, as_json)
        elif sequential or len(texts) == 1:  # one sequence per prompt, said over the folder's num_beams
            requests = [gen.request(t, **kwargs, **ONE_SEQUENCE) for t in texts]
            interrupted = generate_each(gen, texts, requests, stream, as_json)
        else:
            interrupted = generate_batch(gen, texts, gen.request(texts, **kwargs, **ONE_SEQUENCE), as_json)
    except KeyboardInterrupt:
        interrupted = True
    if interrupted:
        click.echo("[interrupted]", err=True)
        sys.exit(130)  # the shell's code for SIGINT: scripts can tell an interrupted run from a finished one


def load_generator(model_dir, verify, device, threads, speculative: dict):
    """The folder's Generator, its graph loading on a thread while the decoding modules are imported and the
    tokenizer loads (a cold start: gpt2edge.runtime.open_model.GraphLoading); library warnings on stderr."""
    from gpt2edge.runtime.open_model import GraphLoading

    with warnings_to_stderr():
        loading = GraphLoading(model_dir, verify, device=device, threads=threads, spin=speculative["draft"] is None)
        try:
            from gpt2edge.runtime.generator import Generator

            return Generator(model_dir, device=device, threads=threads, verify=verify, loading=loading, **speculative)
        except BaseException:
            loading.wait()  # no session left building while the error (or Ctrl-C) ends the process
            raise


def constraint_of(json_schema, json_object, regex, grammar, choice):
    """The one constraint the flags ask for (None for none); two at once is a usage error. A --json-schema value
    that names an existing file is read from it, else it is the schema's text."""
    given = {"--json-schema": json_schema, "--json-object": json_object or None, "--regex": regex}
    given.update({"--grammar": grammar, "--choice": list(choice) or None})
    named = [k for k, v in given.items() if v is not None]
    if len(named) > 1:
        raise click.UsageError(f"Give one constraint at a time, not {' and '.join(named)}.")
    if not named:
        return None  # and the decoding modules the constraints import load later, beside the graph (GraphLoading)
    from gpt2edge.runtime.constraints import Constraint

    if json_schema is not None:
        text = _read_text(Path(json_schema), "--json-schema") if _is_file(json_schema) else json_schema
        return Constraint.json_schema(text)
    if grammar is not None:
        return Constraint.grammar(_read_text(grammar, "--grammar"), grammar.name)
    if regex is not None:
        return Constraint.regex(regex)
    if choice:
        return Constraint.choice(list(choice))
    return Constraint.json_object() if json_object else None


def _is_file(value: str) -> bool:
    """A --json-schema value is a path when it does not look like JSON and names a file."""
    from gpt2edge.runtime.constraints import ConstraintError

    if value.lstrip().startswith(("{", "[", "true", "false")):
        return False
    if not Path(value).is_file():
        raise ConstraintError(f"--json-schema {value[:80]!r} is neither a JSON Schema's text nor a file.")
    return True


def _read_text(path: Path, flag: str) -> str:
    """A constraint file as UTF-8 text, read at most one byte past the size limit (a huge file is not loaded)."""
    from gpt2edge.runtime.constraints.spec import MAX_TEXT_BYTES, ConstraintError

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)
    except OSError as e:
        raise ConstraintError(f"{flag}: cannot read {path}: {e.strerror}.") from None
    if len(data) > MAX_TEXT_BYTES:
        raise ConstraintError(f"{flag}: {path} is over the {MAX_TEXT_BYTES:,}-byte limit of a constraint.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConstraintError(f"{flag}: {path} is not UTF-8 text.") from None


def _check_generate_modes(prompts, prompt_files, as_json, no_stream, logprobs, interactive, truncate, sequential):
    """Option combinations generate refuses, before the model is loaded."""
    if interactive and (
        len(prompts) > 1 or prompt_files or as_json or no_stream or logprobs is not None or truncate or sequential
    ):
        raise click.UsageError(
            "-i takes at most one -p and no -f, --batch-file, --json, --no-stream, --logprobs, --truncate or "
            "--sequential."
        )
    if interactive and prompts == ("-",):
        raise click.UsageError("-i reads its turns from stdin; give the first prompt as text, not '-'.")
    if logprobs is not None and not as_json:
        raise click.UsageError("--logprobs needs --json (the log-probs are part of the JSON output).")


def _check_interactive_search(interactive, num_beams, num_return_sequences, length_penalty, early_stopping):
    """A session continues one sequence: beam search options given with -i would be silently dropped (a count
    of 1 says one sequence, as -i decodes)."""
    counts = dict(num_beams=num_beams, num_return_sequences=num_return_sequences)
    knobs = dict(length_penalty=length_penalty, early_stopping=early_stopping)
    given = [k for k, v in counts.items() if v not in (None, 1)] + [k for k, v in knobs.items() if v is not None]
    names = [f"--{k.replace('_', '-')}" for k in given]
    if interactive and names:
        raise click.UsageError(f"-i continues one sequence per turn; drop {', '.join(names)} (beam search and "
                               "several sequences run without -i).")  # fmt: skip
