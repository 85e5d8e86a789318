"""`gpt2edge serve`: the OpenAI-compatible server (uvicorn) or its Ray Serve deployment."""

from __future__ import annotations

from pathlib import Path

import click

from gpt2edge.cli.common import DEVICES, THREADS, THREADS_HELP, finite_range, friendly_errors, main


def _host(ctx, param, value: str) -> str:
    """An empty address binds every interface: refused, so that an unset variable never exposes the server."""
    if not value.strip():
        raise click.BadParameter("is empty; give an address: 127.0.0.1 (this machine) or 0.0.0.0 (every interface).")
    return value


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
    default=16,
    show_default=True,
    help="Rows (prompts x n) decoded together.",
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
@click.option("--device", type=DEVICES, default="cpu", show_default=True)
@click.option("--threads", type=THREADS, default=None, help=THREADS_HELP)
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the model files (large models).")
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
    device,
    threads,
    no_verify,
    use_ray,
    replicas,
    replica_cpus,
    ray_address,
) -> None:
    """Serve MODEL_DIR over HTTP: OpenAI-compatible /v1/completions (batched, SSE streaming), /v1/models, /health."""
    from gpt2edge.extras import require_extra
    from gpt2edge.serve import ServeConfig

    if not use_ray and (replicas is not None or ray_address is not None):
        raise click.UsageError("--replicas and --ray-address need --ray.")
    name = model_name or Path(model_dir).resolve().name
    config = ServeConfig(name, max_batch, max_queue, max_n, max_body_kb * 1024, batch_wait_ms)
    ready = lambda url: click.echo(f"serving {name} on {url} (OpenAI API at {url}/v1; Ctrl-C stops)")
    if use_ray:
        if port == 0:
            raise click.BadParameter("Ray Serve needs a fixed port", param_hint="--port")
        require_extra("cluster", "serve --ray")
        from gpt2edge.runtime import ModelFolder
        from gpt2edge.serve.ray_app import build_application, run_on_ray

        ModelFolder.open(model_dir, verify=not no_verify)  # a bad folder fails here, not in every replica
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
    from gpt2edge.serve.server import local_app, serve_forever

    serve_forever(local_app(model_dir, config, device, threads, not no_verify), host, port, on_ready=ready)
