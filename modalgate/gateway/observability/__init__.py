"""Metrics, logs and request ids: how the gateway reports what it did."""
