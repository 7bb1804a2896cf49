"""The OpenAI-compatible HTTP server (``kiln serve``): request models, the
completion and chat handlers, metrics, and the FastAPI app."""
