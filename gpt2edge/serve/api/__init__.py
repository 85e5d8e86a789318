"""The HTTP side of the server: the FastAPI app, its routes, middleware and the OpenAI wire format."""
