"""The gate itself: the ASGI middleware and the one decision it takes per request."""
