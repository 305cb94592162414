"""The loopback smol cloud holds to the wire contract the real SDK (smolmachines 1.32.2) speaks.

Every test drives the server through ``smol`` itself, or, where the SDK cannot send a bad
request, through raw HTTP, and checks what the SDK makes of the answer.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
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


def test_exec_output_modes_stdin_timeout_and_user_echo(cloud: LoopbackCloud) -> None:
    machine = make(cloud)
    try:
        command = ["/bin/sh", "-c", "printf '\\377x'; printf err >&2; exit 3"]
        both = machine.exec(command)
        assert (both.exit_code, both.stdout_bytes, both.stderr, both.stdout) == (3, b"\xffx", "err", "\ufffdx")
        b64 = machine.exec(command, ExecOptions(output="b64"))
        assert (b64.stdout, b64.stdout_bytes, b64.stderr_bytes) == ("", b"\xffx", b"err")
        text = machine.exec(command, ExecOptions(output="text"))
        assert text.stdout_bytes == "\ufffdx".encode()  # the lossy text, as the SDK documents
        assert machine.exec(["cat"], ExecOptions(stdin="in\n")).stdout == "in\n"
        assert machine.exec(["pwd"], ExecOptions(workdir="/etc")).stdout == "/etc\n"
        assert machine.exec(["sh", "-c", "echo $X"], ExecOptions(env={"X": "y"})).stdout == "y\n"
        started = time.monotonic()
        slow = machine.exec(["sh", "-c", "echo before; sleep 30"], ExecOptions(timeout=0.5))
        assert slow.exit_code == 124 and slow.stdout == "before\n" and time.monotonic() - started < 10
        assert machine.exec(["id", "-u"], ExecOptions(user="nobody")).stdout.strip() == "65534"
        bg = machine.exec(["sleep", "30"], ExecOptions(background=True))
        assert bg.pid is not None and machine.exec(["kill", "-0", str(bg.pid)]).exit_code == 0
        big = machine.exec(["sh", "-c", "head -c 1500000 /dev/zero | tr '\\0' a"], ExecOptions(output="both"))
        assert big.stdout_truncated and len(big.stdout) == 1 << 20 and len(big.stdout_bytes) == 1500000
    finally:
        machine.delete()


def test_exec_stream_is_server_sent_events(cloud: LoopbackCloud) -> None:
    machine = make(cloud)
    try:
        with machine.exec_stream(["/bin/sh", "-c", "echo a; sleep 0.5; echo b; echo c >&2; exit 5"]) as stream:
            events = list(stream)
        assert events[-1] == {"kind": "exit", "exit_code": 5}
        for kind, text in (("stdout", "a\nb\n"), ("stderr", "c\n")):
            assert "".join(e["data"] for e in events if e["kind"] == kind) == text
        assert events[0] == {"kind": "stdout", "data": "a\n"}  # sent as it came, before b
        started = time.monotonic()
        with machine.exec_stream(["/bin/sh", "-c", "echo $$; exec sleep 60"]) as stream:
            pid = next(iter(stream))["data"].strip()  # it runs; leaving the block kills the stream,
        # and the server, seeing its client gone, kills the command
        while machine.exec(["test", "-d", f"/proc/{pid}"]).exit_code == 0 and time.monotonic() - started < 10:
            time.sleep(0.1)
        assert machine.exec(["test", "-d", f"/proc/{pid}"]).exit_code != 0
    finally:
        machine.delete()


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
