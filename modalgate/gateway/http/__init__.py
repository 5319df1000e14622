"""``modalgate serve``'s own HTTP/1.1 server: the connection and its parsing
(``connection``), serve's protocol on it (``protocol``), the request cycle (``cycle``),
the body reader (``body_reader``) and the hosting under uvicorn (``server``). It reads,
frames and answers bytes; nothing in it judges a request.
"""
