"""The loopback smol cloud holds to the wire contract the real SDK (smolmachines 1.37.3) speaks.

Every test drives the server through ``smol`` itself, or, where the SDK cannot send a bad
request, through raw HTTP, and checks what the SDK makes of the answer.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests import tools
from tests.leaks import leftovers
from tests.smolcloud.harness import ROOT, LoopbackCloud

smol = pytest.importorskip("smol")
from smol import ConnectOptions, ExecOptions, Machine, MachineConfig, ResourceSpec, SmolError  # noqa: E402


@pytest.fixture(autouse=True)
def _open_network_tools() -> None:
    """The loopback cloud runs a machine as a namespace guest, and the SDK's default network is
    open: pasta's NAT there. Without it every machine fails to boot and the SDK waits 120 s."""
    for tool in ("pasta", "nft", "ip"):
        tools.require(tool, "the loopback cloud's machines, whose network is open by default")


def conn(cloud: LoopbackCloud, token: str = "tok", retries: int | None = None) -> ConnectOptions:
    return ConnectOptions(target="cloud", base_url=cloud.url, api_key=token, max_retries=retries)


def make(cloud: LoopbackCloud, token: str = "tok", **config: Any) -> Machine:
    config.setdefault("image", "alpine")
    return Machine.create(MachineConfig(**config), conn(cloud, token))


def raw(cloud: LoopbackCloud, method: str, path: str, body: Any = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    parts = urllib.parse.urlsplit(cloud.url)
    client = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    data = json.dumps(body).encode() if body is not None else None
    sent = {"content-type": "application/json", **(headers or {})}
    client.request(method, path, body=data, headers=sent)
    resp = client.getresponse()
    payload = resp.read()
    client.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload


def exec_calls(cloud: LoopbackCloud, token: str) -> dict[str, int]:
    """The exec routes ``token`` called, as the server counted them."""
    return {call: n for call, n in cloud.calls(token).items() if "/exec" in call}


def exec_records(cloud: LoopbackCloud, machine_id: str) -> list[dict[str, Any]]:
    """The resumable execs the server holds for a machine (the admin view)."""
    found: list[dict[str, Any]] = next(m["execs"] for m in cloud.machines() if m["id"] == machine_id)
    return found


def wait_for_exec(cloud: LoopbackCloud, machine_id: str, done: bool = True, timeout: float = 60) -> dict[str, Any]:
    """The machine's one resumable exec, once it has ended (or, ``done=False``, printed something)."""
    deadline = time.monotonic() + timeout
    while True:
        records = exec_records(cloud, machine_id)
        if len(records) == 1 and (records[0]["done"] if done else records[0]["end"] > 0):
            return records[0]
        assert time.monotonic() < deadline, records
        time.sleep(0.05)


# Both streams, bytes that are not UTF-8 among them, and an exit status.
NOT_UTF8 = ["/bin/sh", "-c", "printf '\\377x\\0'; printf 'e\\376rr' >&2; exit 3"]
STREAMED = ["/bin/sh", "-c", "echo a; sleep 0.5; printf 'b\\377\\n'; echo c >&2; exit 5"]


def check_exec_and_exec_stream(machine: Machine) -> None:
    """What exec and exec_stream give back, whichever routes carry them: four calls, two of each."""
    result = machine.exec(NOT_UTF8)
    assert (result.exit_code, result.stdout_bytes, result.stderr_bytes) == (3, b"\xffx\0", b"e\xferr")
    assert (result.stdout, result.stderr) == ("\ufffdx\0", "e\ufffdrr")
    started = time.monotonic()
    slow = machine.exec(["sh", "-c", "echo before; sleep 30"], ExecOptions(timeout=0.5))
    assert slow.exit_code == 124 and slow.stdout == "before\n" and time.monotonic() - started < 10
    with machine.exec_stream(STREAMED) as stream:
        events = list(stream)
    assert events[-1] == {"kind": "exit", "exit_code": 5}
    for kind, text in (("stdout", "a\nb\ufffd\n"), ("stderr", "c\n")):
        assert "".join(e["data"] for e in events if e["kind"] == kind) == text
    assert events[0] == {"kind": "stdout", "data": "a\n"}  # sent as it came, before b
    started = time.monotonic()
    with machine.exec_stream(["sh", "-c", "echo before; sleep 30"], ExecOptions(timeout=1)) as stream:
        events = list(stream)
    assert events == [{"kind": "stdout", "data": "before\n"}, {"kind": "exit", "exit_code": 124}]
    assert time.monotonic() - started < 10


def test_answers_on_a_kept_alive_connection_come_without_a_delayed_ack_stall(cloud: LoopbackCloud) -> None:
    # An answer written as headers, then body, on a connection with Nagle's algorithm on
    # waits for the client's delayed ACK of the headers: 40 ms a request here, which the
    # real service does not cost, and which every test and benchmark of the stand then paid.
    parts = urllib.parse.urlsplit(cloud.url)
    client = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    times = []
    try:
        for _ in range(15):
            started = time.perf_counter()
            client.request("GET", "/v1/machines", headers={"authorization": "Bearer tok"})
            resp = client.getresponse()
            assert resp.status == 200 and resp.getheader("connection", "").lower() != "close"
            resp.read()
            times.append(time.perf_counter() - started)
    finally:
        client.close()
    assert sorted(times)[len(times) // 2] < 0.02, [f"{t * 1e3:.1f} ms" for t in times]


def test_sigterm_destroys_every_guest(tmp_path: Path) -> None:
    server = LoopbackCloud(state_dir=tmp_path / "state")
    try:
        assert server.url.startswith("http://127.0.0.1:")
        source = make(server, branchable=True)
        source.branch("child")
        make(server, token="someone-else")
        assert len(server.machines()) == 3
    finally:
        status, err = server.stop()
    assert status == 0, err
    assert "destroyed 3 machine(s)" in err
    assert leftovers(tmp_path / "state") == {}


def test_a_killed_test_run_takes_its_server_and_guests_with_it(tmp_path: Path) -> None:
    """The server is in a session of its own, so no terminal's or runner's signal to the run
    reaches it: once the process that started it dies unannounced (SIGKILL, before any fixture
    teardown), it stops as on SIGTERM, destroying its machines, instead of serving on."""
    state = tmp_path / "state"
    script = f"""
import os, signal, sys
from smol import ConnectOptions, Machine, MachineConfig
from tests.smolcloud.harness import LoopbackCloud
server = LoopbackCloud(state_dir={str(state)!r})
Machine.create(MachineConfig(image="alpine"), ConnectOptions(target="cloud", base_url=server.url, api_key="tok"))
print(server.proc.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    server_pid = int(run.stdout)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(server_pid, signal.SIGTERM)
        pytest.fail("the server outlived the test run that started it")
    assert leftovers(state) == {}


def test_a_bearer_token_is_required(cloud: LoopbackCloud) -> None:
    status, headers, body = raw(cloud, "GET", "/v1/machines")
    assert status == 401 and json.loads(body)["code"] == "unauthorized" and headers["x-request-id"]
    with pytest.raises(SmolError) as info:
        Machine.list(conn(cloud, token=" "))
    assert info.value.code == "UNAUTHORIZED"
    assert raw(cloud, "GET", "/v1/machines", headers={"authorization": "Basic abc"})[0] == 401


def test_tokens_are_tenants(cloud: LoopbackCloud) -> None:
    mine = make(cloud, token="alice", labels={"t": "tenants"})
    try:
        assert [m.id for m in Machine.list(conn(cloud, "alice"), labels={"t": "tenants"})] == [mine.id]
        assert Machine.list(conn(cloud, "bob"), labels={"t": "tenants"}) == []
        with pytest.raises(SmolError) as info:
            Machine.connect(mine.id, conn(cloud, "bob"))
        assert info.value.code == "NOT_FOUND"
    finally:
        mine.delete()


def test_requests_are_validated_as_the_sdk_sends_them(cloud: LoopbackCloud) -> None:
    auth = {"authorization": "Bearer tok"}
    good = {"name": None, "source": {"type": "image", "reference": "alpine"}, "resources": {"diskGb": None},
            "autoStopSeconds": None, "ttlSeconds": None, "forkable": False}
    for bad in ({**good, "surprise": 1}, {**good, "forkable": None}, {**good, "ttlSeconds": "60"},
                {**good, "network": {"mode": "closed"}}, {**good, "source": {"type": "oci", "reference": "x"}},
                {**good, "network": {"mode": "allowCidrs", "cidrs": [], "hosts": []}}):
        status, _, body = raw(cloud, "POST", "/v1/machines", bad, auth)
        assert status == 400, (bad, body)
    status, _, body = raw(cloud, "POST", "/v1/machines", {**good, "source": {"type": "image", "reference": "nope"}},
                          auth)
    assert status == 400 and b"not known" in body
    assert not [m for m in cloud.machines() if m["owner"] == "tok"]


def test_create_shapes_labels_filters_and_listing(cloud: LoopbackCloud) -> None:
    machine = make(cloud, name="shapes", labels={"suite": "shapes", "k": "v"}, ttl_seconds=600,
                   resources=ResourceSpec(cpus=2, memory_mb=512, allow_hosts=["pypi.org"]), branchable=True)
    try:
        [admin] = [m for m in cloud.machines() if m["id"] == machine.id]
        assert admin["request"]["network"] == {"mode": "allowCidrs", "cidrs": [], "hosts": ["pypi.org"]}
        assert admin["request"]["ttlSeconds"] == 600 and admin["request"]["forkable"] is True
        listed = Machine.list(conn(cloud), labels={"suite": "shapes"})
        assert [(m.id, m.name, m.branchable, m.image) for m in listed] == [(machine.id, "shapes", True, "alpine")]
        assert listed[0].resources is not None and listed[0].resources.cpus == 2
        assert Machine.list(conn(cloud), labels={"suite": "shapes", "k": "other"}) == []
        assert Machine.connect("shapes", conn(cloud)).id == machine.id  # by name, via the list fallback
        # allow-lists cannot be enforced on a namespace guest: it gets no network at all
        r = machine.exec(["/bin/sh", "-c", "ip -o link | grep -v ' lo:' | wc -l"])
        assert r.stdout.strip() == "0"
        with pytest.raises(SmolError) as info:
            make(cloud, name="shapes")
        assert info.value.status == 409
    finally:
        machine.delete()


def test_exec_options_over_resumable_execs(cloud: LoopbackCloud) -> None:
    machine = make(cloud)
    try:
        command = ["/bin/sh", "-c", "printf '\\377x'; printf err >&2; exit 3"]
        # A resumable exec's output is bytes, whole: ExecOptions.output (the plain exec's ?output=,
        # test_execs_fall_back_to_the_plain_routes_on_an_older_control_plane) has no say in it.
        for output in (None, "both", "b64", "text"):
            r = machine.exec(command, ExecOptions(output=output))
            assert (r.exit_code, r.stdout, r.stdout_bytes, r.stderr, r.stderr_bytes) == \
                (3, "\ufffdx", b"\xffx", "err", b"err"), output
        assert machine.exec(["cat"], ExecOptions(stdin="in\n")).stdout == "in\n"
        assert machine.exec(["pwd"], ExecOptions(workdir="/etc")).stdout == "/etc\n"
        assert machine.exec(["sh", "-c", "echo $X"], ExecOptions(env={"X": "y"})).stdout == "y\n"
        started = time.monotonic()
        slow = machine.exec(["sh", "-c", "echo before; sleep 30"], ExecOptions(timeout=0.5))
        assert slow.exit_code == 124 and slow.stdout == "before\n" and time.monotonic() - started < 10
        assert machine.exec(["id", "-u"], ExecOptions(user="nobody")).stdout.strip() == "65534"
        for user, cwd, code in (("nosuchuser", None, "unknown_user"), (None, "/nonexistent", "bad_workdir")):
            with pytest.raises(SmolError) as info:  # the start's status, as the plain exec's
                machine.exec(["true"], ExecOptions(user=user, workdir=cwd))
            assert info.value.status == 400 and info.value.problem_code == code
        missing = machine.exec(["no-such-program"])
        assert (missing.exit_code, missing.stderr) == (127, "no-such-program: No such file or directory\n")
        bg = machine.exec(["sleep", "30"], ExecOptions(background=True))  # never resumable: the plain /exec
        assert bg.pid is not None and machine.exec(["kill", "-0", str(bg.pid)]).exit_code == 0
        big = machine.exec(["sh", "-c", "head -c 1500000 /dev/zero | tr '\\0' a"], ExecOptions(output="both"))
        assert not big.stdout_truncated and big.stdout == "a" * 1500000 and len(big.stdout_bytes) == 1500000
        assert exec_records(cloud, machine.id) == []  # each one forgotten once its end was read
    finally:
        machine.delete()


def test_exec_and_exec_stream_are_resumable_execs(cloud: LoopbackCloud) -> None:
    token = "resumable"
    machine = make(cloud, token)
    try:
        check_exec_and_exec_stream(machine)
        calls = exec_calls(cloud, token)
        # Each started once, read until its end came, then deleted; the plain routes never called.
        assert calls.pop("GET /v1/machines/{id}/execs/{exec}") >= 1
        assert calls == {"POST /v1/machines/{id}/execs": 4, "DELETE /v1/machines/{id}/execs/{exec}": 4}
        started = time.monotonic()
        with machine.exec_stream(["/bin/sh", "-c", "echo $$; exec sleep 60"]) as stream:
            pid = next(iter(stream))["data"].strip()  # it runs; leaving the block kills the stream,
        # which deletes the exec, and the server kills the command
        while machine.exec(["test", "-d", f"/proc/{pid}"]).exit_code == 0 and time.monotonic() - started < 10:
            time.sleep(0.1)
        assert machine.exec(["test", "-d", f"/proc/{pid}"]).exit_code != 0
        assert exec_records(cloud, machine.id) == []
    finally:
        machine.delete()


def test_execs_fall_back_to_the_plain_routes_on_an_older_control_plane(tmp_path: Path) -> None:
    server = LoopbackCloud("--legacy-exec-routes", state_dir=tmp_path / "state")
    try:
        machine = make(server)
        check_exec_and_exec_stream(machine)
        # Each tried as a resumable exec first; the 404 sent the SDK to the plain route.
        assert exec_calls(server, "tok") == {"POST /v1/machines/{id}/execs": 4, "POST /v1/machines/{id}/exec": 2,
                                             "POST /v1/machines/{id}/exec/stream": 2}
        # The plain exec's output modes and its 1 MiB text cap, which a resumable exec has not.
        command = ["/bin/sh", "-c", "printf '\\377x'; printf err >&2; exit 3"]
        b64 = machine.exec(command, ExecOptions(output="b64"))
        assert (b64.stdout, b64.stdout_bytes, b64.stderr_bytes) == ("", b"\xffx", b"err")
        text = machine.exec(command, ExecOptions(output="text"))
        assert text.stdout_bytes == "\ufffdx".encode()  # the lossy text, as the SDK documents
        big = machine.exec(["sh", "-c", "head -c 1500000 /dev/zero | tr '\\0' a"], ExecOptions(output="both"))
        assert big.stdout_truncated and len(big.stdout) == 1 << 20 and len(big.stdout_bytes) == 1500000
        with machine.exec_stream(["/bin/sh", "-c", "echo $$; exec sleep 60"]) as stream:
            pid = next(iter(stream))["data"].strip()  # leaving the block hangs the stream up, and the
        started = time.monotonic()  # server, seeing its client gone, kills the command
        while machine.exec(["test", "-d", f"/proc/{pid}"]).exit_code == 0 and time.monotonic() - started < 10:
            time.sleep(0.1)
        assert machine.exec(["test", "-d", f"/proc/{pid}"]).exit_code != 0
        exec_id = uuid.uuid4().hex
        auth = {"authorization": "Bearer tok"}
        status, _, body = raw(server, "POST", f"/v1/machines/{machine.id}/execs",
                              {"command": ["true"], "execId": exec_id, "waitSeconds": 0}, auth)
        assert status == 404 and json.loads(body)["code"] == "route_not_found"
        for method in ("GET", "DELETE"):
            status, _, body = raw(server, method, f"/v1/machines/{machine.id}/execs/{exec_id}?after=0&wait=0",
                                  headers=auth)
            assert status == 404 and json.loads(body)["code"] == "route_not_found"
        machine.delete()
    finally:
        status, err = server.stop()
    assert status == 0, err


def test_files_round_trip_with_awkward_names_and_no_parent_creation(cloud: LoopbackCloud) -> None:
    machine = make(cloud)
    try:
        data = bytes(range(256)) * 100
        machine.write_file("/tmp/a b?#%.bin", data, mode=0o640)
        assert machine.read_file("/tmp/a b?#%.bin") == data
        assert machine.exec(["stat", "-c", "%a", "/tmp/a b?#%.bin"]).stdout == "640\n"
        with pytest.raises(SmolError) as info:
            machine.write_file("/no/such/dir/f", b"x")
        assert info.value.code == "NOT_FOUND"
        with pytest.raises(SmolError):
            machine.read_file("/no/such/file")
    finally:
        machine.delete()


def test_branches_are_copy_on_write_snapshots_of_the_source_now(cloud: LoopbackCloud) -> None:
    source = make(cloud, branchable=True, labels={"role": "src"})
    children: list[Machine] = []
    try:
        source.exec(["sh", "-c", "echo one > /root/state"])
        first = source.branch("cow-1")
        children.append(first)
        first.exec(["sh", "-c", "echo child > /root/state"])
        assert source.read_file("/root/state") == b"one\n"
        source.exec(["sh", "-c", "echo two > /root/state"])
        # smol's "list[Machine]" names, inside the class, its own Machine.list: the type said here
        batch: list[Machine] = source.branch_batch(names=["cow-2", "cow-3"])
        children += batch
        assert [c.read_file("/root/state") for c in batch] == [b"two\n", b"two\n"]
        assert first.read_file("/root/state") == b"child\n"
        assert {m.name: m.labels for m in Machine.list(conn(cloud), labels={"role": "src"})}["cow-2"] == \
            {"role": "src"}  # a child carries its source's labels
        with pytest.raises(SmolError) as info:
            source.delete()  # a source outlives its children
        assert info.value.status == 409
        plain = make(cloud)
        try:
            with pytest.raises(SmolError) as info:
                plain.branch("never")
            assert info.value.status == 409
        finally:
            plain.delete()
    finally:
        for child in children:
            child.delete()
        source.delete()


def test_a_branch_of_an_untouched_machine_copies_no_root(cloud: LoopbackCloud) -> None:
    # Nothing has run in a freshly started source: its root is the image it booted from, which
    # its children can boot from as well. Copying it out took the stand 0.7 s per source, a
    # cost the service's copy-on-write snapshot does not have.
    source = make(cloud, branchable=True)
    children: list[Machine] = []
    try:
        children.append(source.branch("untouched-1"))
        assert "root copied" not in source.logs(200)
        made = children[0].exec(["sh", "-c", "cat /etc/alpine-release && echo mine > /root/f && cat /root/f"])
        assert made.exit_code == 0 and made.stdout.endswith("mine\n"), made
        source.exec(["sh", "-c", "echo touched > /root/state"])
        children.append(source.branch("touched-1"))
        assert "root copied as a snapshot (generation 1)" in source.logs(200)
        assert children[-1].read_file("/root/state") == b"touched\n"
    finally:
        for child in children:
            child.delete()
        source.delete()


def test_frozen_source_branches_but_runs_nothing(cloud: LoopbackCloud) -> None:
    source = make(cloud, branchable=True)
    try:
        child = source.branch("frozen-1", freeze_source=True)
        with pytest.raises(SmolError):
            source.exec(["true"])
        child.delete()
    finally:
        source.delete()


def test_stop_keeps_the_disk_and_start_boots_it(cloud: LoopbackCloud) -> None:
    machine = make(cloud)
    try:
        machine.exec(["sh", "-c", "echo kept > /root/f"])
        machine.stop()
        assert machine.state() == "stopped"
        machine.start()
        assert machine.read_file("/root/f") == b"kept\n"
        assert "stopped" in machine.logs(10) and "started" in machine.logs(10)
    finally:
        machine.delete()


def test_exec_cut_off_by_a_delete_is_machine_interrupted(cloud: LoopbackCloud) -> None:
    machine = make(cloud)
    errors: list[SmolError] = []

    def long_exec() -> None:
        try:
            machine.exec(["sleep", "60"])
        except SmolError as exc:
            errors.append(exc)

    thread = threading.Thread(target=long_exec)
    thread.start()
    time.sleep(1)
    Machine.delete_by_name(machine.id, conn(cloud))
    thread.join(timeout=30)
    assert [e.code for e in errors] == ["MACHINE_INTERRUPTED"]


def test_exec_cut_off_after_its_first_output_ends_without_an_exit_code(cloud: LoopbackCloud) -> None:
    # Its start was answered (with "started"), so the stop is the exec's end, read as exitCode
    # null and the reason, which the SDK raises as MACHINE_INTERRUPTED.
    machine = make(cloud)
    errors: list[SmolError] = []

    def long_exec() -> None:
        try:
            machine.exec(["sh", "-c", "echo started; exec sleep 60"])
        except SmolError as exc:
            errors.append(exc)

    thread = threading.Thread(target=long_exec)
    thread.start()
    try:
        wait_for_exec(cloud, machine.id, done=False)
        machine.stop()
        thread.join(timeout=30)
        assert [e.code for e in errors] == ["MACHINE_INTERRUPTED"]
        assert "the command ended without an exit code: exec in" in str(errors[0])
        assert "the machine is stopped" in str(errors[0])
    finally:
        thread.join(timeout=30)
        machine.delete()


def test_an_exec_on_a_gone_machine_falls_back_and_is_not_found(cloud: LoopbackCloud) -> None:
    # A 404 on a resumable start reads, to the SDK, as a control plane without them: it tries the
    # plain exec, whose 404 it raises.
    token = "gone"
    machine = make(cloud, token)
    Machine.delete_by_name(machine.id, conn(cloud, token))
    with pytest.raises(SmolError) as info:
        machine.exec(["true"])
    assert info.value.code == "NOT_FOUND"
    assert exec_calls(cloud, token) == {"POST /v1/machines/{id}/execs": 1, "POST /v1/machines/{id}/exec": 1}


def test_resumable_exec_wire_shapes(cloud: LoopbackCloud) -> None:
    token = "raw-execs"
    auth = {"authorization": f"Bearer {token}"}
    machine = make(cloud, token)
    try:
        path = f"/v1/machines/{machine.id}/execs"
        exec_id = uuid.uuid4().hex
        script = "echo run >> /tmp/runs; printf 'o\\377'; sleep 0.3; printf e >&2; exit 7"
        start: dict[str, object] = {"command": ["sh", "-c", script],
                                    "env": {}, "cwd": None, "timeoutSeconds": None, "execId": exec_id, "waitSeconds": 5}
        for bad in ({**start, "background": False}, {**start, "stream": True}, {**start, "execId": "X" * 32},
                    {**start, "execId": 7}, {**start, "waitSeconds": None}, {**start, "waitSeconds": True},
                    {**start, "surprise": 1}, {**start, "command": []}):
            status, _, body = raw(cloud, "POST", path, bad, auth)
            assert status == 400, (bad, body)
        answers = []
        for _ in range(2):  # a retried start is the same start: one run
            status, _, body = raw(cloud, "POST", path, start, auth)
            assert status == 200, body
            answers.append(json.loads(body))
        assert answers[0]["execId"] == exec_id and answers[0]["done"] is False and answers[0]["next"] >= 1
        after, output = 0, []
        answer = answers[1]
        while True:
            assert set(answer) == {"execId", "next", "output", "done", "exitCode", "error"}, answer
            for piece in answer["output"]:
                assert piece["offset"] == after  # one byte sequence across both streams
                data = base64.b64decode(piece["data"])
                output.append((piece["stream"], data))
                after += len(data)
            assert answer["next"] == after
            if answer["done"]:
                break
            status, _, body = raw(cloud, "GET", f"{path}/{exec_id}?after={after}&wait=5", headers=auth)
            assert status == 200, body
            answer = json.loads(body)
        assert (answer["exitCode"], answer["error"]) == (7, None)
        assert output == [("stdout", b"o\xff"), ("stderr", b"e")]
        assert machine.read_file("/tmp/runs") == b"run\n"
        for query in ("after=x&wait=1", "after=0", "wait=1", f"after={after + 1}&wait=0"):
            status, _, body = raw(cloud, "GET", f"{path}/{exec_id}?{query}", headers=auth)
            assert status == 400, (query, body)
        # Reading after N lets the node drop what came before: asked for again, it is lost.
        status, _, body = raw(cloud, "GET", f"{path}/{exec_id}?after={after}&wait=5", headers=auth)
        assert status == 200 and json.loads(body) == {"execId": exec_id, "next": after, "output": [], "done": True,
                                                      "exitCode": 7, "error": None}
        status, _, body = raw(cloud, "GET", f"{path}/{exec_id}?after=0&wait=0", headers=auth)
        assert status == 200 and json.loads(body)["lost"] == {"from": 0, "to": after}
        assert raw(cloud, "DELETE", f"{path}/{exec_id}", headers=auth)[0] == 204
        for method in ("GET", "DELETE"):
            status, _, body = raw(cloud, method, f"{path}/{exec_id}?after=0&wait=0", headers=auth)
            assert status == 404 and json.loads(body)["code"] == "not_found", body
        # A delete kills a command that still runs.
        running = {**start, "command": ["sh", "-c", "echo $$; exec sleep 60"], "execId": uuid.uuid4().hex}
        status, _, body = raw(cloud, "POST", path, running, auth)
        pid = b"".join(base64.b64decode(p["data"]) for p in json.loads(body)["output"]).decode().strip()
        assert raw(cloud, "DELETE", f"{path}/{running['execId']}", headers=auth)[0] == 204
        started = time.monotonic()
        while machine.exec(["test", "-d", f"/proc/{pid}"]).exit_code == 0 and time.monotonic() - started < 10:
            time.sleep(0.1)
        assert machine.exec(["test", "-d", f"/proc/{pid}"]).exit_code != 0
        machine.stop()
        status, _, body = raw(cloud, "POST", path, {**start, "execId": uuid.uuid4().hex}, auth)
        assert status == 409, body  # as the plain exec answers a machine that is not started
    finally:
        machine.delete()


def test_output_past_the_node_buffer_is_reported_lost(cloud: LoopbackCloud, monkeypatch: pytest.MonkeyPatch) -> None:
    from smol import transport

    from tests.smolcloud.machines import EXEC_BUFFER

    size = 3 * EXEC_BUFFER
    command = ["/bin/sh", "-c", f"head -c {size} /dev/zero | tr '\\0' a; echo end >&2"]
    machine = make(cloud)
    try:
        # A stream whose reader stops: the node keeps EXEC_BUFFER of what it has not read, no more.
        with machine.exec_stream(command) as stream:
            events = [next(stream)]
            record = wait_for_exec(cloud, machine.id)
            assert record["end"] == size + 4 and record["end"] - record["base"] <= EXEC_BUFFER
            events += list(stream)
        assert events[-1] == {"kind": "exit", "exit_code": 0}
        said = [e["data"] for e in events if e["kind"] == "stderr"]
        assert said[-1] == "end\n" and len(said) == 2, said
        dropped = re.fullmatch(r"\[smol: (\d+) bytes of output were dropped by the machine's node before this "
                               r"client read them\]\n", said[0])
        assert dropped is not None, said
        kept = "".join(e["data"] for e in events if e["kind"] == "stdout")
        assert kept == "a" * len(kept) and len(kept) + int(dropped[1]) == size

        # exec, reading slower than the command prints: its error says how much was dropped.
        fetch = transport._cloud_fetch_once

        def slow_reads(base: str, key: str, method: str, path: str, **kwargs: Any) -> Any:
            if method == "GET" and "/execs/" in path:
                wait_for_exec(cloud, machine.id)
            return fetch(base, key, method, path, **kwargs)

        monkeypatch.setattr(transport, "_cloud_fetch_once", slow_reads)
        with pytest.raises(SmolError, match=r"the command exited 0, but \d+ bytes of its output were dropped by "
                                            r"the machine's node before this client read them") as info:
            machine.exec(command)
        assert info.value.code == "SMOLVM_ERROR"
    finally:
        monkeypatch.undo()
        machine.delete()


def test_ttl_deletes_a_machine_and_its_branches(cloud: LoopbackCloud) -> None:
    source = make(cloud, branchable=True, ttl_seconds=2, labels={"t": "ttl"})
    source.branch("ttl-child")
    assert len(Machine.list(conn(cloud), labels={"t": "ttl"})) == 2
    deadline = time.monotonic() + 15
    while Machine.list(conn(cloud), labels={"t": "ttl"}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert Machine.list(conn(cloud), labels={"t": "ttl"}) == []


def test_injected_failures_and_the_sdk_retries(tmp_path: Path) -> None:
    server = LoopbackCloud("--fail-create", "1:429:1", "--fail", "exec:1:503", "--fail", "delete:1:500",
                           state_dir=tmp_path / "state")
    try:
        started = time.monotonic()
        machine = make(server)  # the SDK resends a 429 (any method), after its retry-after
        assert time.monotonic() - started >= 1
        with pytest.raises(SmolError) as info:
            machine.exec(["true"])  # a 503 on exec: retryable, but the SDK never resends an exec
        assert (info.value.status, info.value.retryable, info.value.code) == (503, True, "SMOLVM_ERROR")
        assert machine.exec(["true"]).exit_code == 0
        with pytest.raises(SmolError) as info:
            machine.delete()
        assert info.value.status == 500 and not info.value.retryable
        machine.delete()
        assert [f["operation"] for f in server.admin("faults")["fired"]] == ["create", "exec", "delete"]
        # Each exec was one resumable start; its reads and its delete are no new exec.
        assert server.admin("faults")["counts"]["exec"] == 2
        assert server.calls("tok")["POST /v1/machines/{id}/execs"] == 2
    finally:
        status, err = server.stop()
    assert status == 0, err


def test_branches_fall_back_to_fork_routes_on_an_older_control_plane(tmp_path: Path) -> None:
    server = LoopbackCloud("--legacy-fork-routes", state_dir=tmp_path / "state")
    try:
        source = make(server, branchable=True)
        child = source.branch("legacy-1")
        batch = source.branch_batch(count=2, name_prefix="legacy-b")
        assert sorted(m.name for m in [child, *batch]) == ["legacy-1", "legacy-b-1", "legacy-b-2"]
        # The server counts each call as the SDK sent it: the refused route, then its fallback.
        calls = server.calls("tok")
        assert {k: v for k, v in calls.items() if "/branches" in k or "/fork" in k} == {
            "POST /v1/machines/{id}/branches": 1, "POST /v1/machines/{id}/fork": 1,
            "POST /v1/machines/{id}/branches/batch": 1, "POST /v1/machines/{id}/fork-batch": 1}
        assert calls["POST /v1/machines"] == 1 and server.calls("someone-else") == {}
        for machine in [child, *batch, source]:
            machine.delete()
    finally:
        status, err = server.stop()
    assert status == 0, err


def test_a_stream_is_not_taken_for_hung_up_past_fd_setsize() -> None:
    """A server holding hundreds of machines has descriptors past 1024, where select() raises:
    every exec stream was then cancelled at once (exit 137) in the 1,000-episode benchmark."""
    import os
    import resource
    import socket

    from pytest_smolvm.backends.base import Cancel
    from tests.smolcloud.server import _watch_disconnect

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    high = 1500
    if hard != resource.RLIM_INFINITY and hard <= high:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} keeps descriptors under {high}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, high + 1) if soft != resource.RLIM_INFINITY else soft,
                                                hard))
    ours, theirs = socket.socketpair()
    low = ours.detach()
    moved = socket.socket(fileno=os.dup2(low, high))
    os.close(low)
    try:
        cancel, done = Cancel(), threading.Event()
        watcher = threading.Thread(target=_watch_disconnect, args=(moved, cancel, done))
        watcher.start()
        time.sleep(0.5)
        assert not cancel.cancelled  # the client is still there
        theirs.close()
        watcher.join(5)
        assert cancel.cancelled and not watcher.is_alive()  # and now it is gone
    finally:
        done.set()
        moved.close()
        theirs.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
