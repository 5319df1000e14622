"""The floor of an ext_proc processor in Python: a servicer that judges nothing and answers
each message with CONTINUE (one message each way: the body alone), on grpcio's asyncio
server or its synchronous (thread-pool) server. P7 runs it in place of ``modalgate
extproc`` to tell the protocol's and the binding's cost from the gate's.

    python benchmarks/_extproc_floor.py aio|sync LISTEN HTTP_PORT
"""

from __future__ import annotations

import asyncio
import http.server
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent import futures

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

ROOM = 65 << 20


def _answer(request: ext_proc.ProcessingRequest) -> ext_proc.ProcessingResponse:
    if request.WhichOneof("request") == "request_body":
        return ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())
    return ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())


class AsyncFloor(ext_proc_grpc.ExternalProcessorServicer):
    async def Process(
        self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest], context: object
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        async for request in request_iterator:
            yield _answer(request)


class SyncFloor(ext_proc_grpc.ExternalProcessorServicer):
    def Process(
        self, request_iterator: Iterator[ext_proc.ProcessingRequest], context: object
    ) -> Iterator[ext_proc.ProcessingResponse]:
        for request in request_iterator:
            yield _answer(request)


def _ready_port(port: int) -> None:
    """An HTTP port that answers once the processor listens (what P7 waits on)."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", port), http.server.BaseHTTPRequestHandler
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()


def main() -> None:
    kind, listen, http_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    options = [("grpc.max_receive_message_length", ROOM), ("grpc.max_send_message_length", ROOM)]
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=options)
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(SyncFloor(), server)
        server.add_insecure_port(listen)
        server.start()
        _ready_port(http_port)
        server.wait_for_termination()
        return

    async def run() -> None:
        server = grpc.aio.server(options=options)
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(AsyncFloor(), server)
        server.add_insecure_port(listen)
        await server.start()
        _ready_port(http_port)
        await server.wait_for_termination()

    asyncio.run(run())


if __name__ == "__main__":
    main()
