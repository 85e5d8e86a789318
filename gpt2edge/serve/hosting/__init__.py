"""Hosting the app: its config, uvicorn (one machine) or Ray Serve (a cluster), connection limits, metrics."""
