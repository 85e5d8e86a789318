"""Hosting the app: uvicorn (one machine) or Ray Serve (a cluster), and the connection limits."""
