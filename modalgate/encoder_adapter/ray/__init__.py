"""The encoder pool on Ray Serve: many encoder replicas across GPUs and nodes, many gateways.

``client``: ``RayServeEncoder``, the gateway-side adapter (``--encoder ray:APP``).
``serve``: ``EncoderReplica`` and deploying the pool (``PoolConfig``, ``deploy``,
``app_builder`` for Serve config files). ``cli``: ``modalgate ray deploy``.
``contract``: what client and replicas share (names, ``PoolReply``, the wire format), so
that neither side imports the other. Nothing is imported here, and Ray only when used.
"""
