"""`gpt2edge serve`: an OpenAI-compatible completions server with batching, on the torch-free runtime.

Needs the `serve` extra (FastAPI, uvicorn); Ray Serve deployment (gpt2edge.serve.hosting.ray_app) needs `cluster`.
Importing this package is cheap: the app lives in gpt2edge.serve.api.app / gpt2edge.serve.hosting.server,
imported when used.
"""

from gpt2edge.serve.config import ServeConfig

__all__ = ["ServeConfig"]
