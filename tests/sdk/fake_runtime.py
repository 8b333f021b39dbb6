"""A stand-in for SageMaker's runtime endpoint (moto has no
``invoke_endpoint_with_response_stream``): it answers the real boto3 client's
stream request with the bytes it is given, cut into ``PayloadPart`` events of AWS's
event-stream encoding, so that botocore decodes them as it decodes SageMaker's, and
``invoke_endpoint`` with a JSON answer. It records the requests it gets."""

import json
import struct
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STRING = 7  # event-stream header value type


def _header(name: str, value: str) -> bytes:
    name_bytes, value_bytes = name.encode(), value.encode()
    return bytes([len(name_bytes)]) + name_bytes + bytes([STRING]) + struct.pack(">H", len(value_bytes)) + value_bytes


def event_message(headers: dict[str, str], payload: bytes) -> bytes:
    """One message of AWS's event-stream encoding (prelude, headers, payload, CRCs)."""
    encoded = b"".join(_header(name, value) for name, value in headers.items())
    prelude = struct.pack(">II", 12 + len(encoded) + len(payload) + 4, len(encoded))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", zlib.crc32(message))


def payload_part(piece: bytes) -> bytes:
    return event_message({":event-type": "PayloadPart", ":message-type": "event",
                          ":content-type": "application/octet-stream"}, piece)


def model_stream_error(message: str, code: str = "ModelInvocationTimeExceeded") -> bytes:
    return event_message({":exception-type": "ModelStreamError", ":message-type": "exception",
                          ":content-type": "application/json"},
                         json.dumps({"Message": message, "ErrorCode": code}).encode())


class FakeRuntime:
    """``FakeRuntime().respond(pieces)`` then call its ``url`` with boto3."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.events: list[bytes] = []
        self.content_type = "application/jsonlines"
        self.answer = {"generated_text": "answer"}  # invoke_endpoint's
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fake.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                self.send_response(200)
                if self.path.endswith("/invocations"):  # invoke_endpoint
                    payload = json.dumps(fake.answer).encode()
                    self.send_header("Content-Type", "application/json")
                else:
                    payload = b"".join(fake.events)
                    self.send_header("Content-Type", "application/vnd.amazon.eventstream")
                    self.send_header("X-Amzn-SageMaker-Content-Type", fake.content_type)
                self.send_header("x-Amzn-Invoked-Production-Variant", "AllTraffic")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def respond(self, pieces: list[bytes], content_type: str = "application/jsonlines", error: bytes = b"") -> None:
        """The next answers: ``pieces`` as payload parts, then ``error`` (an exception message)."""
        self.events = [payload_part(piece) for piece in pieces] + ([error] if error else [])
        self.content_type = content_type

    def __enter__(self) -> "FakeRuntime":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
