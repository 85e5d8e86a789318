"""`gpt2edge serve`: the OpenAI-compatible server (uvicorn) or its Ray Serve deployment."""

from __future__ import annotations

from pathlib import Path

import click

from gpt2edge.cli.common import (
    DEVICE_HELP,
    DEVICES,
    FULL_VERIFY_HELP,
    THREADS,
    THREADS_HELP,
    finite_range,
    friendly_errors,
    main,
    verify_mode,
)
from gpt2edge.serve.config import SCHEDULERS


def _host(ctx, param, value: str) -> str:
    """An empty address binds every interface: refused, so that an unset variable never exposes the server."""
    if not value.strip():
        raise click.BadParameter("is empty; give an address: 127.0.0.1 (this machine) or 0.0.0.0 (every interface).")
    return value


class _Bytes(click.ParamType):
    """A size: bytes, or with a unit (512M, 2G; gpt2edge.budget.memory.parse_size)."""

    name = "bytes"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        from gpt2edge.budget.memory import parse_size

        try:
            return parse_size(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a size; give bytes or e.g. 512M, 2G.", param, ctx)


BYTES = _Bytes()


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    callback=_host,
    help="Address to bind; 0.0.0.0 exposes the server.",
)
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port (0: any free port, printed)."
)
@click.option("--model-name", default=None, help="Name in /v1/models and requests [default: the folder's name].")
@click.option(
    "--max-batch",
    type=click.IntRange(min=1),
    default=None,
    help="Rows (prompts x n) decoded together [default: 64, fewer if their KV cache over the whole context would "
    "not fit in memory; a value that would not fit is refused].",
)
@click.option(
    "--max-queue", type=click.IntRange(min=1), default=128, show_default=True, help="Requests waiting; more get 429."
)
@click.option(
    "--max-n", type=click.IntRange(min=1), default=8, show_default=True, help="Largest n (choices) per request."
)
@click.option(
    "--max-body-kb",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Largest request body (413 past it).",
)
@click.option(
    "--batch-wait-ms",
    type=finite_range(0, 1000),
    default=50.0,
    show_default=True,
    help="Longest wait for a new batch to fill (see docs/serve.md).",
)
@click.option(
    "--scheduler",
    type=click.Choice(SCHEDULERS),
    default="continuous",
    show_default=True,
    help="continuous: requests join the running batch at the next step; next-batch: they wait for it to end.",
)
@click.option("--prefill-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Continuous: prompt tokens that join the batch per decode step (bounds the others' stall).")
@click.option("--deterministic", is_flag=True,
              help="Every request gets the tokens and log-probs it gets alone, whatever else runs (slower).")
@click.option("--prefix-cache-bytes", type=BYTES, default="0", show_default=True,
              help="Continuous: keep earlier prompts' KV up to this size (e.g. 512M) and reuse it; 0 = off.")
@click.option("--slot-save-path", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder of POST /slots/{id}?action=save|restore files (needs --prefix-cache-bytes) [default: off].")
@click.option("--api-key", envvar="GPT2EDGE_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (401 otherwise; also $GPT2EDGE_API_KEY). Never logged.")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Jinja chat template for /v1/chat/completions [default: the folder's own].")
@click.option("--header-timeout", type=finite_range(0, 3600, min_open=True), default=10.0, show_default=True,
              help="Seconds for a request's headers to arrive (then 408, closed).")
@click.option("--body-timeout", type=finite_range(0, 3600, min_open=True), default=30.0, show_default=True,
              help="Seconds for a request's body to arrive (then 408).")
@click.option("--keep-alive", type=finite_range(0, 3600, min_open=True), default=5.0, show_default=True,
              help="Seconds an idle keep-alive connection stays open.")
@click.option("--max-connections", type=click.IntRange(min=1), default=512, show_default=True,
              help="Open connections; one more gets 503 and is closed.")
@click.option("--max-header-kb", type=click.IntRange(min=1), default=16, show_default=True,
              help="Largest request head (request line + headers; 400 past it).")
@click.option("--shutdown-timeout", type=finite_range(0, 3600), default=10.0, show_default=True,
              help="On SIGTERM / Ctrl-C: seconds running requests get to finish before they are cancelled.")
@click.option("--device", type=DEVICES, default="cpu", show_default=True, help=DEVICE_HELP)
@click.option("-t", "--threads", type=THREADS, default=None, help=THREADS_HELP)
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the model files (large models).")
@click.option("--verify", "full_verify", is_flag=True, help=FULL_VERIFY_HELP)
@click.option("--ray", "use_ray", is_flag=True, help="Deploy on Ray Serve (extra `cluster`) instead of uvicorn.")
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=None,
    help="With --ray: replicas, each loading MODEL_DIR [default: 1].",
)
@click.option(
    "--replica-cpus",
    type=finite_range(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="With --ray: CPUs per replica.",
)
@click.option("--ray-address", default=None, help="With --ray: join this cluster (e.g. auto) [default: start one].")
@friendly_errors
def serve(
    model_dir,
    host,
    port,
    model_name,
    max_batch,
    max_queue,
    max_n,
    max_body_kb,
    batch_wait_ms,
    scheduler,
    prefill_tokens,
    deterministic,
    prefix_cache_bytes,
    slot_save_path,
    api_key,
    chat_template,
    header_timeout,
    body_timeout,
    keep_alive,
    max_connections,
    max_header_kb,
    shutdown_timeout,
    device,
    threads,
    no_verify,
    full_verify,
    use_ray,
    replicas,
    replica_cpus,
    ray_address,
) -> None:
    """Serve MODEL_DIR over HTTP: OpenAI-compatible /v1/completions and /v1/chat/completions (continuous batching,
    SSE streaming), /v1/models, /health, /metrics, /tokenize, /detokenize."""
    from gpt2edge.extras import require_extra
    from gpt2edge.serve import ServeConfig

    if not use_ray and (replicas is not None or ray_address is not None):
        raise click.UsageError("--replicas and --ray-address need --ray.")
    name = model_name or Path(model_dir).resolve().name
    config = ServeConfig(
        name, max_batch, max_queue, max_n, max_body_kb * 1024, batch_wait_ms, scheduler,
        header_timeout_s=header_timeout, body_timeout_s=body_timeout, keep_alive_s=keep_alive,
        max_connections=max_connections, max_header_bytes=max_header_kb * 1024, shutdown_timeout_s=shutdown_timeout,
        api_key=api_key, prefill_tokens=prefill_tokens, deterministic=deterministic,
        prefix_cache_bytes=prefix_cache_bytes, slot_save_path=None if slot_save_path is None else str(slot_save_path),
        chat_template=None if chat_template is None else str(chat_template),
    )  # fmt: skip
    ready = lambda url: click.echo(f"serving {name} on {url} (OpenAI API at {url}/v1; Ctrl-C stops)")
    if use_ray:
        if port == 0:
            raise click.BadParameter("Ray Serve needs a fixed port", param_hint="--port")
        require_extra("cluster", "serve --ray")
        from gpt2edge.runtime import ModelFolder
        from gpt2edge.serve.hosting.ray_app import build_application, run_on_ray

        # a bad folder fails here, not in every replica; they find the record this full check leaves
        ModelFolder.open(model_dir, verify=verify_mode(no_verify, full_verify))
        app = build_application(
            model_dir,
            config,
            device=device,
            threads=threads,
            verify=not no_verify,
            num_replicas=replicas or 1,
            replica_cpus=replica_cpus,
        )
        run_on_ray(app, host, port, address=ray_address, on_ready=ready)
        return
    require_extra("serve", "serve")
    from gpt2edge.runtime.open_model import GraphLoading
    from gpt2edge.serve.hosting.startup import SchedulerLoading, bind_socket, log_lines

    # a bad folder: one error line before the port is taken; a port in use: one before the model loads
    loading = GraphLoading(model_dir, verify_mode(no_verify, full_verify), device, threads, spin=False, start=False)
    sock = bind_socket(host, port)
    log_lines()  # before the load starts: its warnings (a stale optimized-graph cache) in the log's one-line form
    # the session and the scheduler are built on threads while the server's modules import here (a cold start),
    # and the model goes on loading while the server answers (/health: "loading"); a failed load stops it
    loading.start()
    scheduling = SchedulerLoading(loading, config)
    try:
        from gpt2edge.serve.hosting.server import loading_app, serve_forever

        serve_forever(lambda on_error: loading_app(scheduling, config, on_error), sock, on_ready=ready)
    finally:
        # a Ctrl-C or SIGTERM during the load (serve_forever returns after it) or an error: the process must not
        # end while ONNX Runtime builds the session (it aborts)
        if not scheduling.done():
            click.echo("stopping: waiting for the model load to end (Ctrl-C again quits at once)", err=True)
        scheduling.wait()
