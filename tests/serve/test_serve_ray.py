"""`gpt2edge serve --ray`: the same app as a Ray Serve deployment, on a real local Ray instance with 2 replicas."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'gpt2edge[cluster]'")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install 'gpt2edge[cluster]'")
pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'gpt2edge[serve]'")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (dev extra)")
yaml = pytest.importorskip("yaml", reason="pyyaml is not installed (ray[serve] brings it)")

from gpt2edge.errors import ServeError  # noqa: E402
from gpt2edge.runtime import Generator  # noqa: E402
from gpt2edge.serve import ServeConfig  # noqa: E402
from gpt2edge.serve.hosting.ray_app import APP_NAME, app_builder, build_application  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray_serve.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_autoscaling_config_example_is_valid_for_ray_serve(tiny_export):
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(CONFIG.read_text())
    ServeDeploySchema.model_validate(config)  # the schema `serve deploy` checks it against
    app = config["applications"][0]
    assert app["import_path"] == "gpt2edge.serve.hosting.ray_app:app_builder"
    assert app["deployments"][0]["autoscaling_config"]["max_replicas"] > 1
    # its args build the application (pointing model_dir at a real folder)
    built = app_builder(dict(app["args"], model_dir=str(tiny_export)))
    assert type(built).__name__ == "Application"
    with pytest.raises(ServeError, match="Unknown Ray Serve app arg"):
        app_builder({"model_dir": str(tiny_export), "max_batchh": 4})
    with pytest.raises(ServeError, match="model_dir"):
        app_builder({})


@pytest.fixture(scope="module")
def ray_url(tiny_export):
    """Serve on a local Ray instance (loopback only), 2 replicas each loading the tiny export; torn down after."""
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig(model_name="tiny", max_batch=8, batch_wait_ms=50)
        serve.run(
            build_application(tiny_export, config, num_replicas=2, replica_cpus=0.5, threads=1),
            name=APP_NAME,
            route_prefix="/",
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_serve_the_same_app(ray_url, tiny_export):
    pids = set()
    deadline = time.monotonic() + 60
    for _ in range(200):  # Serve spreads requests over replicas; stop once both have answered
        pids.add(httpx.get(ray_url + "/health", timeout=30).json()["pid"])
        if len(pids) == 2 or time.monotonic() > deadline:
            break
    assert len(pids) == 2

    ref = Generator(tiny_export)
    prompts = ["The river rose and", "A", "Snow fell on the quiet hills"]
    r = httpx.post(
        ray_url + "/v1/completions", json={"prompt": prompts, "max_tokens": 10, "temperature": 0}, timeout=60
    )
    assert r.status_code == 200, r.text
    expected = [ref.generate(p, max_new_tokens=10, do_sample=False).text for p in prompts]
    assert [c["text"] for c in r.json()["choices"]] == expected

    # streaming through Ray's proxy, and the OpenAI-shaped errors
    body = {"prompt": prompts[0], "max_tokens": 10, "temperature": 0, "stream": True}
    with httpx.stream("POST", ray_url + "/v1/completions", json=body, timeout=60) as s:
        data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == expected[0]
    bad = httpx.post(ray_url + "/v1/completions", content=b"{nope", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
