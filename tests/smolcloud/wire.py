"""The smol cloud wire format, as smolmachines 1.37.3's ``smol/transport.py`` sends and parses it.

Every shape here is read from that file (line numbers in the comments); nothing is invented
beyond what the SDK shows. Requests are validated strictly: a field of the wrong type, or one
the SDK never sends, is a 400, so a client bug cannot pass here and fail on the real service.
"""

from __future__ import annotations

import base64
import math
import re
from dataclasses import dataclass, field
from typing import Any

SDK_VERSION = "1.37.3"  # the smolmachines version these shapes were read from
TEXT_CAP = 1 << 20  # transport.py:1324-1325: "The cloud caps the text fields at 1 MiB and flags the cut"
OUTPUT_MODES = ("text", "b64", "both")  # types.py ExecOptions.output
MAX_FILE_BYTES = 100 * 1024 * 1024  # transport.py:74 CLOUD_MAX_FILE_BYTES


class ApiError(Exception):
    """An HTTP error in the shape ``_cloud_error`` (transport.py:2179-2208) parses.

    The SDK reads ``code`` (only ``machine_interrupted`` is special) and ``retryable`` from a
    JSON body, the status (404 -> NOT_FOUND, 401 -> UNAUTHORIZED, else SMOLVM_ERROR), the
    ``retry-after`` header and ``x-request-id``.
    """

    def __init__(self, status: int, code: str, message: str, *, retryable: bool | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retryable = retryable
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        problem: dict[str, Any] = {"code": self.code, "message": self.message, "status": self.status}
        if self.retryable is not None:
            problem["retryable"] = self.retryable
        return problem


def bad_request(message: str) -> ApiError:
    return ApiError(400, "invalid_request", message)


def not_found(what: str) -> ApiError:
    return ApiError(404, "not_found", f"{what} not found")


def conflict(message: str) -> ApiError:
    return ApiError(409, "conflict", message)


def interrupted(message: str) -> ApiError:
    # transport.py:2190-2192: problem code "machine_interrupted" -> SmolError MACHINE_INTERRUPTED
    return ApiError(409, "machine_interrupted", message)


# --------------------------------------------------------------------------- field checks


def _only(body: dict[str, Any], allowed: set[str], what: str) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise bad_request(f"{what}: unknown field(s) {', '.join(extra)}")


def _opt(body: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and kind in (int, (int, float)):
        raise bad_request(f"{what}: {key} must be a number, got a boolean")
    if not isinstance(value, kind):
        raise bad_request(f"{what}: {key} has the wrong type ({type(value).__name__})")
    return value


def _str_map(value: Any, key: str, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in value.items()):
        raise bad_request(f"{what}: {key} must be an object of strings")
    return dict(value)


def _ports(value: Any, what: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(p, dict) and isinstance(p.get("port"), int)
                                              for p in value):
        raise bad_request(f"{what}: ports must be a list of {{port}} objects")
    return list(value)


def require_object(body: Any, what: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"{what}: the body must be a JSON object")
    return body


# --------------------------------------------------------------------------- create


@dataclass(frozen=True)
class Network:
    mode: str  # "open" | "blocked" | "allowCidrs"
    cidrs: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class CreateRequest:
    name: str | None
    image: str
    cpus: int | None
    memory_mb: int | None
    disk_gb: int | None
    ttl_seconds: int | None
    auto_stop_seconds: int | None
    forkable: bool
    network: Network
    labels: dict[str, str]
    env: dict[str, str]
    workdir: str | None
    raw: dict[str, Any] = field(repr=False)


CREATE_FIELDS = {"name", "source", "resources", "autoStopSeconds", "ttlSeconds", "forkable", "network",
                 "ports", "env", "workdir", "command", "credentials", "labels", "cacheDisk"}


def parse_create(body: Any) -> CreateRequest:
    """``POST /v1/machines`` as ``make_transport`` builds it (transport.py:2898-2953)."""
    what = "create machine"
    body = require_object(body, what)
    _only(body, CREATE_FIELDS, what)
    source = body.get("source")
    if not isinstance(source, dict) or source.get("type") != "image" \
            or not isinstance(source.get("reference"), str) or not source["reference"]:
        raise bad_request(f"{what}: source must be {{type: image, reference: <image>}}")
    resources = require_object(body.get("resources") or {}, f"{what}: resources")
    _only(resources, {"diskGb", "cpus", "memoryMb", "diskDurability"}, f"{what}: resources")
    cpus = _opt(resources, "cpus", int, what)
    memory = _opt(resources, "memoryMb", int, what)
    disk = _opt(resources, "diskGb", int, what)
    if (cpus is not None and cpus < 1) or (memory is not None and memory < 64) or (disk is not None and disk < 1):
        raise bad_request(f"{what}: resources out of range ({resources})")
    ttl = _opt(body, "ttlSeconds", int, what)
    auto_stop = _opt(body, "autoStopSeconds", int, what)
    for key, value in (("ttlSeconds", ttl), ("autoStopSeconds", auto_stop)):
        if value is not None and value < 1:
            raise bad_request(f"{what}: {key} must be at least 1")
    forkable = body.get("forkable")
    if not isinstance(forkable, bool):  # always sent (transport.py:2912-2916)
        raise bad_request(f"{what}: forkable must be a boolean")
    name = _opt(body, "name", str, what)
    if name is not None and not name:
        raise bad_request(f"{what}: name must not be empty")
    return CreateRequest(name=name, image=source["reference"], cpus=cpus, memory_mb=memory, disk_gb=disk,
                         ttl_seconds=ttl, auto_stop_seconds=auto_stop, forkable=forkable,
                         network=parse_network(body.get("network"), what), labels=_str_map(
                             body.get("labels"), "labels", what), env=_str_map(body.get("env"), "env", what),
                         workdir=_opt(body, "workdir", str, what), raw=body)


def parse_network(value: Any, what: str) -> Network:
    """transport.py:2918-2931: absent = open egress; blocked; or an allow-list."""
    if value is None:
        return Network("open")
    if not isinstance(value, dict):
        raise bad_request(f"{what}: network must be an object")
    mode = value.get("mode")
    if mode in ("open", "blocked"):
        _only(value, {"mode"}, f"{what}: network")
        return Network(mode)
    if mode == "allowCidrs":
        _only(value, {"mode", "cidrs", "hosts"}, f"{what}: network")
        cidrs, hosts = value.get("cidrs"), value.get("hosts")
        if not isinstance(cidrs, list) or not isinstance(hosts, list) \
                or not all(isinstance(x, str) and x for x in cidrs + hosts):
            raise bad_request(f"{what}: network cidrs and hosts must be lists of strings")
        if not cidrs and not hosts:
            raise bad_request(f"{what}: an allowCidrs network needs at least one cidr or host")
        return Network(mode, tuple(cidrs), tuple(hosts))
    raise bad_request(f"{what}: network mode must be open, blocked or allowCidrs, got {mode!r}")


# --------------------------------------------------------------------------- exec


@dataclass(frozen=True)
class ExecRequest:
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    timeout: int | None
    user: str | None
    background: bool
    stdin: bytes | None


def parse_exec(body: Any) -> ExecRequest:
    """``CloudTransport._command_body`` (transport.py:1179-1195), the user probe (1209) and the
    readiness probe (2679)."""
    what = "exec"
    body = require_object(body, what)
    _only(body, {"command", "env", "cwd", "timeoutSeconds", "user", "background", "stdin"}, what)
    argv = body.get("command")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise bad_request(f"{what}: command must be a non-empty argv array of strings")
    timeout = _opt(body, "timeoutSeconds", int, what)
    if timeout is not None and timeout < 1:
        raise bad_request(f"{what}: timeoutSeconds must be a positive whole number")
    user = _opt(body, "user", str, what)
    if user is not None and not user.strip():
        raise bad_request(f"{what}: user must not be empty")
    background = body.get("background", False)
    if not isinstance(background, bool):
        raise bad_request(f"{what}: background must be a boolean")
    stdin = _opt(body, "stdin", str, what)
    if background and (stdin is not None or timeout is not None):
        raise bad_request(f"{what}: a background command takes no stdin and no timeout")
    return ExecRequest(argv=list(argv), env=_str_map(body.get("env"), "env", what),
                       cwd=_opt(body, "cwd", str, what), timeout=timeout, user=user,
                       background=background, stdin=stdin.encode() if stdin is not None else None)


def output_mode(query: dict[str, list[str]]) -> str:
    values = query.get("output") or ["both"]
    if len(values) != 1 or values[0] not in OUTPUT_MODES:
        raise bad_request(f"exec: output must be one of {', '.join(OUTPUT_MODES)}")
    return values[0]


def exec_response(exit_code: int, stdout: bytes, stderr: bytes, mode: str, user: str | None,
                  complete: bool = True) -> dict[str, Any]:
    """The MachineExecResponse fields ``CloudTransport.exec`` reads (transport.py:1303-1331).

    Text fields are capped at 1 MiB and flagged; the base64 fields are the whole output
    (``complete=False`` when even the server's own buffer had to drop a middle part).
    """
    reply: dict[str, Any] = {"exitCode": exit_code}
    if mode in ("text", "both"):
        reply["stdout"] = stdout[:TEXT_CAP].decode("utf-8", "replace")
        reply["stderr"] = stderr[:TEXT_CAP].decode("utf-8", "replace")
        reply["stdoutTruncated"] = len(stdout) > TEXT_CAP or not complete
        reply["stderrTruncated"] = len(stderr) > TEXT_CAP or not complete
    else:
        # "with b64, ExecResult.stdout is empty" (types.py ExecOptions.output)
        reply.update(stdout="", stderr="", stdoutTruncated=False, stderrTruncated=False)
    if mode in ("b64", "both"):
        reply["stdoutB64"] = base64.b64encode(stdout).decode()
        reply["stderrB64"] = base64.b64encode(stderr).decode()
    if user is not None:
        reply["user"] = user  # _check_user_echo (transport.py:2102-2109)
    return reply


# --------------------------------------------------------------------------- resumable execs
#
# ``_ResumableExec`` (transport.py:2253-2363): ``POST /v1/machines/{id}/execs`` starts a command the
# machine's node owns, ``GET .../execs/{execId}?after=N&wait=W`` reads its output after byte N (and
# lets the node drop what came before), ``DELETE .../execs/{execId}`` kills and forgets it. The SDK
# tries it first for every exec and exec_stream that is not a background one (1288-1291, 1385-1393);
# a 404, 405 or 501 on the start sends it back to the plain exec (``_resumable_verdict``, 2235-2250).

EXEC_ID = re.compile(r"[0-9a-f]{32}")  # os.urandom(16).hex() (transport.py:2261)
# The longest a start or read is held waiting for output. The SDK asks 20 s (_RESUMABLE_WAIT_S,
# transport.py:2225) and gives a read 50 s on the wire (2227): a longer hold is its timeout.
MAX_EXEC_WAIT = 30


@dataclass(frozen=True)
class ExecStart:
    exec_id: str
    wait: int
    request: ExecRequest


def parse_exec_start(body: Any) -> ExecStart:
    """``_ResumableExec.__init__`` (transport.py:2257-2264): ``_command_body`` less ``background`` and
    ``stream`` (the SDK strips them: a resumable exec is neither), plus ``execId`` and ``waitSeconds``."""
    what = "execs"
    body = require_object(body, what)
    refused = sorted({"background", "stream"} & set(body))
    if refused:
        raise bad_request(f"{what}: {', '.join(refused)} is not taken by a resumable exec")
    exec_id = body.get("execId")
    if not isinstance(exec_id, str) or not EXEC_ID.fullmatch(exec_id):
        raise bad_request(f"{what}: execId must be 32 lowercase hex digits, got {exec_id!r}")
    wait = body.get("waitSeconds")
    if not isinstance(wait, int) or isinstance(wait, bool) or wait < 0:
        raise bad_request(f"{what}: waitSeconds must be a whole number of seconds >= 0, got {wait!r}")
    request = parse_exec({k: v for k, v in body.items() if k not in ("execId", "waitSeconds")})
    return ExecStart(exec_id, min(wait, MAX_EXEC_WAIT), request)


def parse_exec_read(query: dict[str, list[str]]) -> tuple[int, int]:
    """``?after=<next>&wait=<seconds>``, both always sent (``pieces``, transport.py:2347-2350):
    the offset after which output is wanted, and how long to wait for some."""
    found = []
    for key in ("after", "wait"):
        values = query.get(key) or []
        if len(values) != 1 or not values[0].isdigit():
            raise bad_request(f"execs: {key} must be one whole number >= 0, got {values!r}")
        found.append(int(values[0]))
    return found[0], min(found[1], MAX_EXEC_WAIT)


def exec_answer(exec_id: str, output: list[tuple[str, int, bytes]], next_offset: int, done: bool,
                exit_code: int | None, error: str | None, lost: tuple[int, int] | None) -> dict[str, Any]:
    """A start's or a read's answer, as ``start`` and ``pieces`` read it (transport.py:2316,
    2328-2346): ``execId`` (its absence means "no resumable execs here"), ``output`` pieces at
    offsets in ONE byte sequence across both streams (the client keeps one ``next``; a piece
    past it is never taken), ``next`` the end of what this answer carries, ``done`` only with
    the last of the output (the SDK ends once ``done`` and ``next`` <= its own), then
    ``exitCode``, or null and ``error`` for a command that could not finish (``_exec_resumable``
    raises MACHINE_INTERRUPTED, 1349-1353), and ``lost`` where unread output was dropped
    (1354-1359: exec raises; 1457-1462: a stream says so on stderr)."""
    answer: dict[str, Any] = {
        "execId": exec_id, "next": next_offset,
        "output": [{"stream": stream, "offset": offset, "data": base64.b64encode(data).decode()}
                   for stream, offset, data in output],
        "done": done, "exitCode": exit_code if done else None, "error": error if done else None,
    }
    if lost is not None:
        answer["lost"] = {"from": lost[0], "to": lost[1]}
    return answer


# --------------------------------------------------------------------------- branches


@dataclass(frozen=True)
class BranchRequest:
    names: list[str]
    branchable: bool
    freeze_source: bool


def parse_branch(body: Any, *, legacy: bool) -> BranchRequest:
    """``CloudTransport.fork`` (transport.py:1887-1937): /branches says branchable, /fork forkable."""
    what = "fork" if legacy else "branch"
    body = require_object(body, what)
    flag = "forkable" if legacy else "branchable"
    _only(body, {"name", "ports", flag, "freezeSource"}, what)
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{what}: name is required")
    _ports(body.get("ports"), what)
    return BranchRequest([name], bool(_opt(body, flag, bool, what)), bool(_opt(body, "freezeSource", bool, what)))


def parse_branch_batch(body: Any) -> BranchRequest:
    """``CloudTransport.fork_batch`` (transport.py:1939-1998); names resolve as
    ``_resolve_batch_names`` says the control plane does (transport.py:2085-2099)."""
    what = "branch batch"
    body = require_object(body, what)
    _only(body, {"ports", "names", "count", "namePrefix", "freezeSource"}, what)
    _ports(body.get("ports"), what)
    names = body.get("names")
    if names:
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise bad_request(f"{what}: names must be a list of non-empty strings")
        if len(set(names)) != len(names):
            raise bad_request(f"{what}: names must be unique")
        resolved = list(names)
    else:
        count = _opt(body, "count", int, what)
        if not count or count < 1:
            raise bad_request(f"{what}: count must be >= 1 when no names are given")
        prefix = _opt(body, "namePrefix", str, what) or "branch"
        resolved = [f"{prefix}-{i}" for i in range(1, count + 1)]
    return BranchRequest(resolved, False, bool(_opt(body, "freezeSource", bool, what)))


def parse_tail(query: dict[str, list[str]]) -> int:
    raw = (query.get("tail") or ["100"])[0]
    try:
        tail = int(raw)
    except ValueError:
        raise bad_request(f"logs: tail must be a whole number, got {raw!r}") from None
    if tail < 0:
        raise bad_request("logs: tail must not be negative")
    return tail


def parse_label_filter(query: dict[str, list[str]]) -> dict[str, str]:
    """``?label=k%3Dv`` repeated, ANDed (transport.py:3414-3415)."""
    wanted: dict[str, str] = {}
    for item in query.get("label", []):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise bad_request(f"list machines: label filter {item!r} is not key=value")
        wanted[key] = value
    return wanted


def ceil_seconds(value: float) -> int:
    return max(1, math.ceil(value))
