"""The upstream side: the reverse proxy, its connection pool, the balancer over
per-model routes, and the forwarder that picks a route."""
