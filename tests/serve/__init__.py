"""gpt2edge.serve: the OpenAI-compatible server (api/, scheduling/, hosting/), over real HTTP."""
