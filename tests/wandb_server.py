"""A stand-in wandb server on 127.0.0.1 that fails on cue, for the failure battery.

It speaks just enough of wandb's API for `wandb.init` to create a run and for the run to upload
(the GraphQL operations wandb 0.31 sends, the file stream, file uploads, its telemetry), and fails
in one of the ways a real server does.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

# How the server behaves.
ERRORS = "every request gets HTTP 500"
SILENT = "accepts connections and never answers"
REFUSES_RUNS = "says who the key belongs to, then HTTP 500 to everything else"
FAILS_MID_RUN = "takes the run and its first upload, then HTTP 500 to everything"


class WandbServer:
    """`with WandbServer(behaviour) as server:` serves on `server.url` until the block ends."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.requests: list[str] = []  # "METHOD path operation", in arrival order
        self.refused: list[str] = []  # those answered with an error
        self.failing = threading.Event()  # set: the server has started to fail
        self.stopped = threading.Event()  # releases the handlers held by a silent server
        if behaviour in (ERRORS, SILENT):
            self.failing.set()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"

    def __enter__(self) -> Self:
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopped.set()
        self._http.shutdown()
        self._http.server_close()

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        request = json.loads(body) if path == "/graphql" else {}
        operation = request.get("operationName") or ""
        self.requests.append(f"{method} {path} {operation}".strip())
        if self.failing.is_set() or (self.behaviour == REFUSES_RUNS and operation != "Viewer"):
            self.refused.append(self.requests[-1])
            return 500, {"error": "down"}
        if self.behaviour == FAILS_MID_RUN and path.endswith("/file_stream"):
            self.failing.set()  # the run is live and has uploaded once: fail from here on
        if path == "/graphql":
            return 200, {"data": _graphql_data(operation, request.get("variables") or {}, self.url)}
        return 200, {}


def _graphql_data(operation: str, variables: dict[str, Any], url: str) -> dict[str, Any]:
    if operation == "Viewer":
        return {"viewer": {"id": "u1", "entity": "tester", "username": "tester", "email": None, "flags": "{}",
                           "teams": {"edges": []}}}  # fmt: skip
    if operation == "UpsertBucket":
        project = {"id": "p1", "name": variables.get("project"), "entity": {"id": "e1", "name": "tester"}}
        name = variables.get("name")
        bucket = {"id": "b1", "name": name, "displayName": name, "description": None, "config": "{}",
                  "sweepName": None, "project": project, "historyLineCount": 0}  # fmt: skip
        return {"upsertBucket": {"bucket": bucket, "inserted": True}}
    if operation == "CreateRunFiles":
        files = [{"name": name, "uploadUrl": f"{url}/uploads/{name}"} for name in variables.get("files", [])]
        return {"createRunFiles": {"runID": "b1", "uploadHeaders": [], "files": files}}
    if operation == "ServerFeaturesQuery":
        return {"serverInfo": {"features": []}}
    if operation == "OrganizationCoreWeaveOrganizationID":
        return {"entity": {"organization": None}}
    return {}


def _handler_for(server: WandbServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def handle_any(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if server.behaviour == SILENT:
                server.requests.append(f"{self.command} {self.path}")
                server.stopped.wait(timeout=300)  # hold the connection open, unanswered
                return
            status, content = server.answer(self.command, self.path, body)
            data = json.dumps(content).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = handle_any

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the requests are kept in `server.requests`

    return Handler
