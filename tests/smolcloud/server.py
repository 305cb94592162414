"""HTTP routes of the loopback smol cloud: the ``/v1`` API ``CloudTransport`` calls, and an admin view.

``http.server``'s ThreadingHTTPServer is enough: the SDK speaks plain HTTP/1.1 with keep-alive
(its ``_CloudConnectionPool``, transport.py:2496-2619), one request per connection at a time,
and the one streaming route (server-sent events) is a response written line by line; a resumable
exec's read is a long poll, a handler thread waiting. No dependency is added for a test server.
"""

from __future__ import annotations

import json
import re
import select
import socket
import threading
import uuid
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from pytest_smolvm.backends.base import Cancel
from tests.smolcloud import wire
from tests.smolcloud.machines import Machine, Store, iso

MAX_BODY = wire.MAX_FILE_BYTES + (1 << 20)
DEFAULT_CPUS = 1
DEFAULT_MEMORY_MB = 1024
DEFAULT_DISK_GB = 20
MACHINE = r"/v1/machines/(?P<id>[^/]+)"
GROUP = re.compile(r"\(\?P<(\w+)>[^()]*\)")  # how /_smolcloud/calls names a route: {id}, {exec}, {path}


def record(store: Store, machine: Machine) -> dict[str, Any]:
    """A machine as GET /v1/machines/{id} and the list return it: the fields the SDK reads
    (transport.py:1223-1280 state/ready/readyAt/url, 1571-1577 ports, 3413-3448 the list, 3061-3068
    sizes)."""
    ready = store.ready(machine)
    body: dict[str, Any] = {
        "id": machine.id, "name": machine.name, "state": machine.state, "ready": ready,
        "readyAt": iso(machine.created_at) if ready else None, "labels": dict(machine.labels),
        "source": {"type": "image", "reference": machine.image}, "ephemeral": False,
        "forkable": machine.forkable, "branchable": machine.forkable, "createdAt": iso(machine.created_at),
        "resources": {"cpus": machine.cpus or DEFAULT_CPUS, "memoryMb": machine.memory_mb or DEFAULT_MEMORY_MB,
                      "diskGb": machine.disk_gb or DEFAULT_DISK_GB},
        "ports": [], "url": None, "ttlSeconds": machine.ttl_seconds,
    }
    if machine.source_id:
        body["sourceMachineId"] = machine.source_id
    return body


class CloudServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's listen backlog is 5. Hundreds of concurrent clients open their exec streams
    # together (a batch of 32 branches becomes ready at once) and the one accepting thread lags
    # on a busy host: past the backlog the kernel dropped connections and the SDK saw them reset.
    # A real control plane sits behind a load balancer; this is the server's own limit, not a model.
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], store: Store, *, legacy_fork_routes: bool = False,
                 legacy_exec_routes: bool = False) -> None:
        super().__init__(address, Handler)
        self.store = store
        self.legacy_fork_routes = legacy_fork_routes
        self.legacy_exec_routes = legacy_exec_routes
        # API calls per token, keyed as the SDK sends them ("POST /v1/machines/{id}/branches/batch"):
        # how many round trips a run cost, for the concurrency benchmark and tests of batching.
        self.calls: dict[str, dict[str, int]] = {}
        self.calls_lock = threading.Lock()

    def count(self, owner: str, call: str) -> None:
        with self.calls_lock:
            mine = self.calls.setdefault(owner, {})
            mine[call] = mine.get(call, 0) + 1


Route = tuple[str, re.Pattern[str], Callable[["Handler", dict[str, str]], None]]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's pool expects
    # Each answer goes out as it is written, as any real HTTP service sends it: with Nagle's
    # algorithm on, a body written after its headers waited out the client's delayed ACK.
    disable_nagle_algorithm = True
    server: CloudServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: a test run makes thousands of calls

    # ------------------------------------------------------------------ plumbing

    def _dispatch(self, method: str) -> None:
        self.request_id = uuid.uuid4().hex[:16]
        parts = urlsplit(self.path)
        self.query = parse_qs(parts.query)
        self.body_bytes = b""
        try:
            length = int(self.headers.get("content-length") or 0)
            if length > MAX_BODY:
                self.close_connection = True
                raise wire.ApiError(413, "payload_too_large", "request body too large")
            self.body_bytes = self.rfile.read(length) if length else b""
            if not parts.path.startswith("/_smolcloud/"):
                self._authenticate()
            for verb, pattern, handler in ROUTES:
                match = pattern.fullmatch(parts.path)
                if match and verb == method:
                    if not parts.path.startswith("/_smolcloud/"):
                        self.server.count(self.token, f"{method} {call_name(pattern)}")
                    handler(self, match.groupdict())
                    return
            raise wire.ApiError(404, "route_not_found", f"no route for {method} {parts.path}")
        except wire.ApiError as exc:
            self._error(exc)
        except Exception as exc:
            self._error(wire.ApiError(500, "internal", f"{type(exc).__name__}: {exc}"))

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _authenticate(self) -> None:
        scheme, _, token = (self.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise wire.ApiError(401, "unauthorized", "missing or malformed Authorization: Bearer <key>")
        self.token = token.strip()

    def _hung_up(self) -> bool:
        """An injected hang-up (--fail OP:N:drop|lost): the connection closes, no answer is sent."""
        if not self.server.store.faults.take_hang_up():
            return False
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)
        return True

    def _send(self, status: int, payload: bytes, content_type: str,
              headers: dict[str, str] | None = None) -> None:
        if self._hung_up():
            return
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(payload)))
        self.send_header("x-request-id", self.request_id)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _json(self, status: int, value: Any) -> None:
        self._send(status, json.dumps(value).encode(), "application/json")

    def _no_content(self) -> None:
        if self._hung_up():
            return
        self.send_response(HTTPStatus.NO_CONTENT)
        self.send_header("x-request-id", self.request_id)
        self.send_header("content-length", "0")
        self.end_headers()

    def _error(self, exc: wire.ApiError) -> None:
        headers = {"retry-after": str(exc.retry_after)} if exc.retry_after is not None else {}
        self._send(exc.status, json.dumps(exc.body()).encode(), "application/problem+json", headers)

    def _body(self) -> Any:
        if not self.body_bytes:
            return None
        if "application/json" not in (self.headers.get("content-type") or ""):
            raise wire.bad_request("expected a JSON body (content-type: application/json)")
        try:
            return json.loads(self.body_bytes)
        except ValueError:
            raise wire.bad_request("the body is not valid JSON") from None

    def _machine(self, args: dict[str, str]) -> Machine:
        return self.server.store.get(self.token, args["id"])

    # ------------------------------------------------------------------ machines

    def create(self, args: dict[str, str]) -> None:
        request = wire.parse_create(self._body())
        machine = self.server.store.create(self.token, request)
        self._json(201, record(self.server.store, machine))

    def list(self, args: dict[str, str]) -> None:
        self.server.store.faults.check("list")
        wanted = wire.parse_label_filter(self.query)
        machines = self.server.store.listing(self.token, wanted)
        self._json(200, {"machines": [record(self.server.store, m) for m in machines]})

    def get(self, args: dict[str, str]) -> None:
        self._json(200, record(self.server.store, self._machine(args)))

    def delete(self, args: dict[str, str]) -> None:
        machine = self._machine(args)
        self.server.store.delete(machine)
        if self.query.get("includeUsage") == ["true"]:
            self._json(200, {"machineId": machine.id, "from": iso(machine.created_at), "to": iso(machine.created_at),
                             "usage": {}, "cost": {}})
        else:
            self._no_content()

    def start(self, args: dict[str, str]) -> None:
        machine = self._machine(args)
        if self.query.get("forkable") not in (None, ["true"]):
            raise wire.bad_request("start: forkable must be true when given")
        self.server.store.start(machine)
        self._json(200, record(self.server.store, machine))

    def stop(self, args: dict[str, str]) -> None:
        machine = self._machine(args)
        self.server.store.stop(machine)
        self._json(200, record(self.server.store, machine))

    def logs(self, args: dict[str, str]) -> None:
        machine = self._machine(args)
        tail = wire.parse_tail(self.query)
        lines = list(machine.log)[-tail:] if tail else []
        self._send(200, ("\n".join(lines) + "\n" if lines else "").encode(), "text/plain; charset=utf-8")

    # ------------------------------------------------------------------ exec

    def exec(self, args: dict[str, str]) -> None:
        machine = self._machine(args)
        mode = wire.output_mode(self.query)
        request = wire.parse_exec(self._body())
        exit_code, stdout, stderr, complete = self.server.store.exec(machine, request)
        self._json(200, wire.exec_response(exit_code, stdout, stderr, mode, request.user, complete))

    def exec_stream(self, args: dict[str, str]) -> None:
        """Server-sent events as ``CloudTransport._sse_events`` parses them (transport.py:1474-1523),
        sent as the output arrives. A client that goes away (``ExecStream.kill`` shuts its socket
        down) cancels the command, which the namespace guest then kills."""
        machine = self._machine(args)
        if "text/event-stream" not in (self.headers.get("accept") or ""):
            raise wire.bad_request("exec/stream: accept must be text/event-stream")
        request = wire.parse_exec(self._body())
        if request.background:
            raise wire.bad_request("exec/stream: a background command has no stream")
        self.server.store.running(machine, "exec")  # refused before the stream starts, as a status
        self.close_connection = True
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.send_header("x-request-id", self.request_id)
        self.end_headers()
        self.wfile.flush()
        cancel = Cancel()
        write_lock = threading.Lock()

        def send(event: str) -> None:
            with write_lock:
                try:
                    self.wfile.write(event.encode())
                    self.wfile.flush()
                except OSError:
                    cancel.cancel()

        def on_output(stream: str, chunk: bytes) -> None:
            text = chunk.decode("utf-8", "replace")
            send(f"event: {stream}\n" + "".join(f"data: {line}\n" for line in text.split("\n")) + "\n")

        done = threading.Event()
        watcher = threading.Thread(target=_watch_disconnect, args=(self.connection, cancel, done), daemon=True)
        watcher.start()
        try:
            exit_code, _out, _err, _complete = self.server.store.exec(machine, request, on_output, cancel)
        except wire.ApiError as exc:
            send(f"event: error\ndata: {exc.message}\n\n")
            return
        finally:
            done.set()
        send(f"event: exit\ndata: {json.dumps({'exitCode': exit_code})}\n\n")

    # ------------------------------------------------------------------ resumable execs

    def _execs_route(self) -> None:
        # A 404 on the start is what sends the SDK to the plain exec (transport.py:2248-2249).
        if self.server.legacy_exec_routes:
            raise wire.ApiError(404, "route_not_found", "this control plane predates resumable execs")

    def execs_start(self, args: dict[str, str]) -> None:
        """Start a resumable exec and answer as a read after 0: what came by the first output or the
        end, waiting up to waitSeconds. A failure before any output is the start's status, as the
        plain exec answers it (transport.py:2311-2319 then raises it, 2299-2304)."""
        self._execs_route()
        machine = self._machine(args)
        start = wire.parse_exec_start(self._body())
        record = self.server.store.exec_start(machine, start)
        record.wait(0, start.wait)
        failure = record.start_failure()
        if failure is not None:
            self.server.store.forget_abandoned(machine, record)
            raise failure
        self._json(200, record.answer(0))

    def execs_read(self, args: dict[str, str]) -> None:
        """The output after ``after``, waiting up to ``wait`` s for some (transport.py:2347-2353);
        what came before ``after`` the client has, so the node drops it."""
        self._execs_route()
        machine = self._machine(args)
        after, wait = wire.parse_exec_read(self.query)
        record = self.server.store.exec_record(machine, args["exec"])
        record.release(after)
        record.wait(after, wait)
        self._json(200, record.answer(after))

    def execs_delete(self, args: dict[str, str]) -> None:
        """Kill the command if it runs, and forget it (``forget``, transport.py:2355-2363)."""
        self._execs_route()
        self.server.store.exec_forget(self._machine(args), args["exec"])
        self._no_content()

    # ------------------------------------------------------------------ files

    def _file_path(self, args: dict[str, str]) -> str:
        # _encode_path (transport.py:244-247) quotes each segment and keeps "/", so an absolute
        # path arrives as files//etc/hosts.
        path = "/".join(unquote(segment) for segment in args["path"].split("/"))
        if not path.startswith("/"):
            path = "/" + path
        if "\0" in path or path.rstrip("/") == "":
            raise wire.bad_request(f"files: bad path {path!r}")
        return path

    def file_get(self, args: dict[str, str]) -> None:
        data = self.server.store.read_file(self._machine(args), self._file_path(args))
        self._send(200, data, "application/octet-stream")

    def file_put(self, args: dict[str, str]) -> None:
        if "application/octet-stream" not in (self.headers.get("content-type") or ""):
            raise wire.bad_request("files: PUT takes application/octet-stream")
        self.server.store.write_file(self._machine(args), self._file_path(args), self.body_bytes)
        self._no_content()

    # ------------------------------------------------------------------ branches

    def _branch_route(self, legacy: bool) -> None:
        if not legacy and self.server.legacy_fork_routes:
            raise wire.ApiError(404, "route_not_found", "this control plane predates branch routes")

    def branch(self, args: dict[str, str]) -> None:
        legacy = self.path.split("?")[0].endswith("/fork")
        self._branch_route(legacy)
        source = self._machine(args)
        request = wire.parse_branch(self._body(), legacy=legacy)
        [child] = self.server.store.branch(self.token, source, request)
        self._json(201, record(self.server.store, child))

    def branch_batch(self, args: dict[str, str]) -> None:
        legacy = self.path.split("?")[0].endswith("/fork-batch")
        self._branch_route(legacy)
        source = self._machine(args)
        request = wire.parse_branch_batch(self._body())
        clones = self.server.store.branch(self.token, source, request)
        self._json(201, {"clones": [record(self.server.store, c) for c in clones]})

    # ------------------------------------------------------------------ admin (not part of the API)

    def admin_machines(self, args: dict[str, str]) -> None:
        store = self.server.store
        with store.lock:
            machines = list(store.machines.values())
        self._json(200, {"machines": [{**record(store, m), "request": m.request, "owner": m.owner,
                                       "frozen": m.frozen, "children": sorted(m.children),
                                       "execs": exec_records(m),
                                       "network": {"mode": m.network.mode, "cidrs": list(m.network.cidrs),
                                                   "hosts": list(m.network.hosts)}}
                                      for m in machines]})

    def admin_history(self, args: dict[str, str]) -> None:
        with self.server.store.lock:
            self._json(200, {"history": list(self.server.store.history)})

    def admin_calls(self, args: dict[str, str]) -> None:
        """``{"calls": {"POST /v1/machines": n, ...}}``: the API calls ``?owner=TOKEN`` made."""
        owner = (self.query.get("owner") or [""])[0]
        with self.server.calls_lock:
            self._json(200, {"calls": dict(self.server.calls.get(owner, {}))})

    def admin_faults(self, args: dict[str, str]) -> None:
        store = self.server.store
        self._json(200, {"counts": store.faults.counts(),
                         "fired": [f.__dict__ for f in store.faults.fired]})


def exec_records(machine: Machine) -> list[dict[str, Any]]:
    """A machine's resumable execs for the admin view: how much output each keeps (``end - base``)."""
    with machine.execs_lock:
        records = list(machine.execs.values())
    return [{"id": r.id, "base": r.base, "end": r.end, "done": r.done, "exitCode": r.exit_code} for r in records]


def call_name(pattern: re.Pattern[str]) -> str:
    """A route as /_smolcloud/calls names it: ``/v1/machines/{id}/execs/{exec}``."""
    return GROUP.sub(r"{\1}", pattern.pattern)


def _route(method: str, pattern: str, handler: Callable[[Handler, dict[str, str]], None]) -> Route:
    return method, re.compile(pattern), handler


ROUTES: list[Route] = [
    _route("POST", r"/v1/machines", Handler.create),
    _route("GET", r"/v1/machines", Handler.list),
    _route("GET", MACHINE, Handler.get),
    _route("DELETE", MACHINE, Handler.delete),
    _route("POST", MACHINE + r"/start", Handler.start),
    _route("POST", MACHINE + r"/stop", Handler.stop),
    _route("GET", MACHINE + r"/logs", Handler.logs),
    _route("POST", MACHINE + r"/exec", Handler.exec),
    _route("POST", MACHINE + r"/exec/stream", Handler.exec_stream),
    _route("POST", MACHINE + r"/execs", Handler.execs_start),
    _route("GET", MACHINE + r"/execs/(?P<exec>[^/]+)", Handler.execs_read),
    _route("DELETE", MACHINE + r"/execs/(?P<exec>[^/]+)", Handler.execs_delete),
    _route("GET", MACHINE + r"/files/(?P<path>.+)", Handler.file_get),
    _route("PUT", MACHINE + r"/files/(?P<path>.+)", Handler.file_put),
    _route("POST", MACHINE + r"/branches", Handler.branch),
    _route("POST", MACHINE + r"/fork", Handler.branch),
    _route("POST", MACHINE + r"/branches/batch", Handler.branch_batch),
    _route("POST", MACHINE + r"/fork-batch", Handler.branch_batch),
    _route("GET", r"/_smolcloud/machines", Handler.admin_machines),
    _route("GET", r"/_smolcloud/faults", Handler.admin_faults),
    _route("GET", r"/_smolcloud/history", Handler.admin_history),
    _route("GET", r"/_smolcloud/calls", Handler.admin_calls),
]


def _watch_disconnect(connection: socket.socket, cancel: Cancel, done: threading.Event) -> None:
    """Cancel the command once the client's end of a stream is closed (it sends nothing more).

    poll, not select: a server holding a few hundred machines has descriptors past select's
    FD_SETSIZE (1024), where select raises ValueError and every stream then looked hung up."""
    watch = select.poll()
    watch.register(connection, select.POLLIN)
    while not done.is_set():
        try:
            readable = watch.poll(200)
            if readable and not connection.recv(1, socket.MSG_PEEK):
                cancel.cancel()
                return
        except (OSError, ValueError):
            cancel.cancel()
            return


def reaper(store: Store, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        store.reap()
