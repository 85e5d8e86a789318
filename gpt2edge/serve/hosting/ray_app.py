"""Past one machine: the same FastAPI app as a Ray Serve deployment (extra `cluster`).

Every replica builds the app on its own (serve.ingress with a builder function) and loads the export folder from
the same path, so the folder must exist at that path on every node. Each replica batches on its own scheduler
thread exactly as `gpt2edge serve` does; Ray Serve's proxy spreads requests over the replicas.

    gpt2edge serve DIR --ray --replicas 2                          # local Ray instance, or --ray-address auto
    serve run gpt2edge.serve.hosting.ray_app:app_builder model_dir=DIR      # Ray's own CLI
    serve deploy deploy/ray_serve.yaml                              # existing cluster, autoscaling config
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpt2edge.errors import ServeError
from gpt2edge.serve.config import DEFAULT_MAX_BATCH, ServeConfig

APP_NAME = "gpt2edge"
DEPLOYMENT_NAME = "gpt2edge"


def build_application(
    model_dir: str | Path,
    config: ServeConfig,
    *,
    device: str = "cpu",
    threads: int | None = None,
    verify: bool = True,
    num_replicas: int | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    replica_cpus: float = 1.0,
):
    """A bound Ray Serve application (pass it to serve.run). num_replicas None leaves it to Serve or the config
    file; ONNX Runtime threads default to the replica's CPUs so replicas on one node do not oversubscribe."""
    from ray import serve

    model_dir = str(Path(model_dir).resolve())
    threads = threads if threads is not None else max(1, int(replica_cpus))

    def build_app():  # runs in each replica, which loads the folder when the app starts
        from gpt2edge.serve.api.app import create_app
        from gpt2edge.serve.scheduling.continuous import load_scheduler

        return create_app(lambda: load_scheduler(model_dir, config, device, threads, verify), config)

    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {"num_cpus": replica_cpus},
        # Serve's default (5) would starve the batcher: admit what one scheduler can batch and queue
        "max_ongoing_requests": (config.max_batch or DEFAULT_MAX_BATCH) + config.max_queue,
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    elif num_replicas is not None:
        options["num_replicas"] = num_replicas
    return serve.deployment(**options)(serve.ingress(build_app)()).bind()


_CONFIG_ARGS: dict[str, Callable[[str], Any]] = {
    "max_batch": int,
    "max_queue": int,
    "max_n": int,
    "batch_wait_ms": float,
    "scheduler": str,
    "prefill_tokens": int,
    "deterministic": lambda v: str(v).lower() in ("1", "true", "yes"),
    "prefix_cache_bytes": int,
    "slot_save_path": str,  # each replica's own folder (a path on its node): slots are per replica
}
_REPLICA_ARGS: dict[str, Callable[[Any], Any]] = {
    "device": str,
    "threads": int,
    "verify": lambda v: str(v).lower() not in ("0", "false", "no"),
    "replica_cpus": float,
}


def app_builder(args: dict[str, Any]):
    """Application builder for Ray's CLI and config files: `args` holds model_dir and optional server limits
    (model_name, max_batch, max_queue, max_n, max_body_kb, batch_wait_ms, scheduler, prefill_tokens,
    deterministic, prefix_cache_bytes, slot_save_path, device, threads, verify, replica_cpus). Values may be
    strings (`serve run ... max_batch=16`)."""
    args = dict(args)
    model_dir = args.pop("model_dir", None)
    if not model_dir:
        raise ServeError("The Ray Serve app needs args.model_dir: the export folder (same path on every node).")
    config_kw: dict[str, Any] = {"model_name": str(args.pop("model_name", "") or Path(model_dir).name)}
    if "max_body_kb" in args:
        config_kw["max_body_bytes"] = int(args.pop("max_body_kb")) * 1024
    replica_kw: dict[str, Any] = {}
    for key in list(args):
        if key in _CONFIG_ARGS:
            config_kw[key] = _CONFIG_ARGS[key](args.pop(key))
        elif key in _REPLICA_ARGS:
            replica_kw[key] = _REPLICA_ARGS[key](args.pop(key))
    if args:
        known = ["model_dir", "model_name", "max_body_kb", *_CONFIG_ARGS, *_REPLICA_ARGS]
        raise ServeError(f"Unknown Ray Serve app arg(s): {', '.join(sorted(args))}; known: {', '.join(known)}.")
    return build_application(model_dir, ServeConfig(**config_kw), **replica_kw)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_on_ray(
    application,
    host: str,
    port: int,
    address: str | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Start (or join, with `address`) Ray, deploy, and block until Ctrl-C or SIGTERM; then delete the app (and
    stop the local Ray instance, so no Ray process outlives the command)."""
    import ray
    from ray import serve

    signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop takes the same clean path as Ctrl-C
    ray.init(address=address, include_dashboard=False, ignore_reinit_error=True)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application, name=APP_NAME, route_prefix="/")
        if on_ready is not None:
            on_ready(f"http://{host}:{port}")
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        if address is None:  # the local instance is ours: stop it
            serve.shutdown()
            ray.shutdown()
