"""The Guest protocol, driven through the VM handle, held to the same contract on every backend.

Nothing here is mocked: each test runs against a real guest, or is skipped with the reason the
backend's probe gave (``-rs`` shows it).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import socket
import stat
import subprocess
import sys
import tarfile
import threading
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import pytest

from pytest_smolvm import limits
from pytest_smolvm.backends.base import Backend, BackendOptions, Guest
from pytest_smolvm.errors import GuestError, GuestFileNotFoundError, UsageError
from pytest_smolvm.handle.vm import VM
from tests.backends.conftest import RUN_ID, MakeGuest


def _alive(vm: VM, pid: int) -> bool:
    """Whether ``pid`` runs in the guest (a zombie does not count: it has let go of everything)."""
    r = vm.exec(f"s=$(cat /proc/{pid}/stat 2>/dev/null) || exit 1; set -- $s; [ \"$3\" != Z ]")
    return r.exit_code == 0


# --------------------------------------------------------------------------- state


def test_fresh_state_per_vm(make_guest: MakeGuest) -> None:
    first, _ = make_guest()
    first.exec("echo dirty > /root/leftover; echo 'export POISON=1' >> /etc/profile", check=True)
    first.exec("sleep 300 >/dev/null 2>&1 &", check=True)
    second, _ = make_guest()
    assert second.exec("test -e /root/leftover").exit_code == 1
    assert "POISON" not in second.read_file("/etc/profile").decode()
    assert "sleep 300" not in second.exec("ps -o args").stdout
    assert first.name != second.name


def test_files_persist_across_exec(vm: VM) -> None:
    vm.exec("mkdir -p /work/a && echo one > /work/a/f", check=True)
    assert vm.exec("cat /work/a/f").stdout == "one\n"
    vm.write_file("/work/deep/er/g.txt", "two\n")  # parents are created
    assert vm.exec("cat /work/deep/er/g.txt").stdout == "two\n"
    vm.exec("echo three >> /work/deep/er/g.txt", check=True)
    assert vm.read_file("/work/deep/er/g.txt") == b"two\nthree\n"


def test_background_process_persists_across_exec(vm: VM) -> None:
    started = time.monotonic()
    r = vm.exec("sleep 300 >/dev/null 2>&1 & echo $!", check=True, timeout=30)
    assert time.monotonic() - started < 20, "exec waited for its background child"
    pid = int(r.stdout.strip())
    assert _alive(vm, pid)
    vm.exec("true", check=True)
    assert _alive(vm, pid), "a background process died when the next exec ran"


def test_root_serves_on_a_port_below_1024(vm: VM) -> None:
    """As on a machine of its own: the guest's root binds port 80 and its own clients reach it
    (a namespace guest's root has no capability over its network namespace: see security.md)."""
    vm.exec("nc -l -p 80 -e echo served > /dev/null 2>&1 &", check=True)
    reply = ""
    for _ in range(50):
        reply = vm.exec("nc 127.0.0.1 80 < /dev/null").stdout
        if reply:
            break
        time.sleep(0.05)
    assert reply == "served\n"


def test_background_process_holding_stdout_does_not_block_exec(vm: VM) -> None:
    started = time.monotonic()
    r = vm.exec("sleep 300 & echo started", timeout=30)
    assert r.exit_code == 0 and not r.timed_out
    assert r.stdout == "started\n"
    assert time.monotonic() - started < 20


# --------------------------------------------------------------------------- exec


def test_exec_basics(vm: VM) -> None:
    r = vm.exec(["/bin/sh", "-c", 'echo "$1"; echo err >&2; exit 7', "sh", "arg with spaces"])
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (7, "arg with spaces\n", "err\n", False)
    assert vm.exec("pwd", workdir="/etc").stdout == "/etc\n"
    assert vm.exec("cat", stdin="from stdin\n").stdout == "from stdin\n"
    assert vm.exec("cat").stdout == ""  # no stdin means EOF, never a hang
    assert vm.exec("echo $GREETING", env={"GREETING": "hi"}).stdout == "hi\n"
    assert vm.exec("no-such-command-xyz").exit_code == 127


def test_exec_timeout_kills_the_guest_process_group(vm: VM) -> None:
    started = time.monotonic()
    r = vm.exec("sleep 600 & echo $! > /tmp/child; echo before; sleep 600", timeout=2)
    elapsed = time.monotonic() - started
    assert r.timed_out and r.exit_code == 124
    assert elapsed < 30, f"a 2s timeout took {elapsed:.1f}s"
    assert "before" in r.stdout  # output up to the deadline is kept
    child = int(vm.read_file("/tmp/child").decode().strip())
    deadline = time.monotonic() + 10
    while _alive(vm, child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(vm, child), "the timed-out command's background child survived"
    # The guest and this process are fine afterwards.
    assert vm.exec("echo still here", timeout=30).stdout == "still here\n"
    assert os.getpid() > 0


def test_command_exiting_124_by_itself_is_not_a_timeout(vm: VM) -> None:
    r = vm.exec("exit 124", timeout=60)
    assert r.exit_code == 124 and not r.timed_out


def test_non_utf8_output_is_byte_exact(vm: VM) -> None:
    r = vm.exec(r"printf '\377\376abc\n'; printf '\200\201' >&2")
    assert r.stdout_bytes == b"\xff\xfeabc\n"
    assert r.stderr_bytes == b"\x80\x81"
    assert r.stdout == "\ufffd\ufffdabc\n"
    raw = bytes(range(256)) * 64
    assert vm.exec(["cat"], stdin=raw).stdout_bytes == raw  # binary stdin, too


def test_output_limit_keeps_head_and_tail(make_guest: MakeGuest) -> None:
    _vm, guest = make_guest()
    r = guest.exec(["/bin/sh", "-c", "echo HEAD; head -c 200000 /dev/zero | tr '\\0' x; echo; echo TAIL"],
                   env={}, workdir=None, stdin=None, timeout=60, output_limit=1000)
    assert r.exit_code == 0
    assert r.stdout.startswith(b"HEAD\n") and r.stdout.endswith(b"TAIL\n")
    # Only bytes the guest wrote, no marker of ours among them: `truncated` says it was cut.
    assert len(r.stdout) == 1000 and set(r.stdout[5:-6]) == {ord("x")}
    assert r.truncated == ("stdout",)


# --------------------------------------------------------------------------- files


def test_binary_files_byte_exact(vm: VM) -> None:
    data = bytes(range(256)) * 4096 + os.urandom(300_000)
    vm.write_file("/data/blob.bin", data)
    assert vm.read_file("/data/blob.bin") == data
    assert vm.exec("sha256sum /data/blob.bin").stdout.split()[0] == hashlib.sha256(data).hexdigest()
    assert vm.exec("cat /data/blob.bin").stdout_bytes == data
    vm.write_file("/data/mode.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert vm.exec("/data/mode.sh").stdout == "ran\n"


def _tree(root: Path, dir_modes: bool = True) -> dict[str, tuple[str, int, bytes | str]]:
    found: dict[str, tuple[str, int, bytes | str]] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            found[rel] = ("link", 0, os.readlink(path))
        elif stat.S_ISDIR(st.st_mode):
            found[rel] = ("dir", stat.S_IMODE(st.st_mode) if dir_modes else 0, b"")
        else:
            found[rel] = ("file", stat.S_IMODE(st.st_mode), path.read_bytes())
    return found


def _make_tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "sub" / "empty").mkdir(parents=True)
    (src / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "run.sh").chmod(0o755)
    (src / "secret").write_bytes(b"\x00\xff" * 1000)
    (src / "secret").chmod(0o600)
    (src / "sub" / "data.txt").write_text("data\n")
    (src / "sub").chmod(0o750)
    (src / "link").symlink_to("sub/data.txt")
    return src


def test_copy_tree_round_trip_keeps_modes_and_links(vm: VM, tmp_path: Path) -> None:
    src = _make_tree(tmp_path)
    vm.copy_in(src, "/work/tree")
    listing = vm.exec("cd /work/tree && stat -c '%a %F %n' run.sh secret sub sub/empty link", check=True)
    assert listing.stdout.splitlines() == ["755 regular file run.sh", "600 regular file secret",
                                           "750 directory sub", "755 directory sub/empty",
                                           "777 symbolic link link"]
    assert vm.exec("/work/tree/run.sh").stdout == "hi\n"
    assert vm.exec("cat /work/tree/link").stdout == "data\n"
    vm.exec("echo made-in-guest > /work/tree/sub/new && chmod 640 /work/tree/sub/new", check=True)
    out = vm.copy_out("/work/tree", tmp_path / "back")
    expected = _tree(src, dir_modes=False)
    expected["sub/new"] = ("file", 0o640, b"made-in-guest\n")
    assert _tree(out, dir_modes=False) == expected
    single = vm.copy_out("/work/tree/secret", tmp_path / "one-file")
    assert single.read_bytes() == (src / "secret").read_bytes()


def test_copy_out_of_a_missing_guest_path_names_copy_out_and_the_path(vm: VM, tmp_path: Path) -> None:
    """The project's own error, as copy_in's missing host path is: it says which call and whose path."""
    host = tmp_path / "host"
    host.mkdir()
    with pytest.raises(GuestFileNotFoundError) as missing:
        vm.copy_out("/work/never-made", host / "out")
    assert isinstance(missing.value, GuestError) and isinstance(missing.value, FileNotFoundError)
    assert str(missing.value) == "copy_out: no such file or directory in the guest: /work/never-made"
    assert missing.value.errno == errno.ENOENT and missing.value.filename == "/work/never-made"
    assert list(host.iterdir()) == []  # no copy and no staging directory left behind


def test_copy_in_of_a_deep_tree_keeps_its_shape_and_times(vm: VM, tmp_path: Path) -> None:
    """300 levels: deeper than the namespace unpacker holds open, and past ustar's 100-char names."""
    src = tmp_path / "src"
    bottom = src.joinpath(*["level"] * 300)
    subprocess.run(["mkdir", "-p", str(bottom)], check=True)  # os.makedirs recurses once per level
    (bottom / "f").write_text("bottom\n")
    (src / "top").write_text("top\n")
    os.utime(src / "top", (1_600_000_000, 1_600_000_000))
    vm.copy_in(src, "/work/deep")
    deep = "/work/deep/" + "/".join(["level"] * 300)
    assert vm.exec(f"cat {deep}/f").stdout == "bottom\n"
    assert vm.exec("stat -c %Y /work/deep/top").stdout == "1600000000\n"


def test_copy_in_of_a_tree_past_one_cloud_transfer_arrives_whole(vm: VM, tmp_path: Path) -> None:
    """A tree whose archive is over 100 MiB, the most one smol cloud file transfer carries."""
    src = tmp_path / "src"
    src.mkdir()
    block = os.urandom(1 << 20)
    digest = hashlib.sha256()
    with open(src / "big", "wb") as f:
        for i in range(101):
            piece = i.to_bytes(8, "big") + block[8:]
            f.write(piece)
            digest.update(piece)
    (src / "small").write_text("small\n")
    vm.copy_in(src, "/work/big-tree")
    assert vm.exec("sha256sum /work/big-tree/big").stdout.split()[0] == digest.hexdigest()
    assert vm.read_file("/work/big-tree/small") == b"small\n"
    assert vm.exec("ls -A /tmp | grep -F .tar || true").stdout == ""  # no staged part left


def test_copy_out_keeps_directory_modes(vm: VM, tmp_path: Path) -> None:
    vm.exec("mkdir -p /work/d/private && chmod 750 /work/d/private", check=True)
    out = vm.copy_out("/work/d", tmp_path / "back")
    assert stat.S_IMODE((out / "private").stat().st_mode) == 0o750


def _snapshot(root: Path, exclude: Path) -> set[str]:
    return {str(p) for p in root.rglob("*") if exclude not in p.parents and p != exclude}


@pytest.mark.parametrize("plant", [
    "mkdir -p /evil && ln -s /etc/passwd /evil/abs",
    "mkdir -p /evil && ln -s ../../../../../../../../tmp /evil/up",
    "mkdir -p /evil/d && ln -s / /evil/d/root && echo x > /evil/d/plain",
    "ln -s /etc /evil",  # the source itself is a symlink
], ids=["absolute-link", "dotdot-link", "link-to-root", "src-is-link"])
def test_copy_out_never_writes_outside_dest(vm: VM, tmp_path: Path, plant: str) -> None:
    vm.exec(plant, check=True)
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    sentinel = tmp_path / "sentinel"
    sentinel.write_text("untouched")
    before = _snapshot(tmp_path, sandbox)
    dest = sandbox / "out"
    with contextlib.suppress(GuestError):
        vm.copy_out("/evil", dest)
    assert _snapshot(tmp_path, sandbox) == before
    assert sentinel.read_text() == "untouched"
    if dest.exists() or dest.is_symlink():
        real_dest = os.path.realpath(dest)
        for path in [dest, *dest.rglob("*")] if dest.is_dir() and not dest.is_symlink() else [dest]:
            if path.is_symlink():
                target = os.path.realpath(path)
                assert target == real_dest or target.startswith(real_dest + os.sep), \
                    f"{path} points outside the destination, at {target}"


# --------------------------------------------------------------------------- isolation


def test_network_off_cannot_reach_host_loopback(vm: VM) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    connections: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, addr = server.accept()
            except (TimeoutError, OSError):
                continue
            connections.append(addr)
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 6\r\n\r\nhostok")
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as probe:  # the server works
            assert b"hostok" in probe.recv(100)
        connections.clear()
        r = vm.exec(f"wget -q -T 3 -O - http://127.0.0.1:{port}/; echo rc=$?; "
                    f"echo | nc -w 3 127.0.0.1 {port}; echo nc=$?", timeout=60)
        assert "hostok" not in r.stdout
        assert "rc=0" not in r.stdout
        assert connections == [], "the guest reached a server on the host's loopback"
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


def test_env_isolation(vm: VM, monkeypatch: pytest.MonkeyPatch) -> None:
    canary = f"canary-{uuid.uuid4().hex}"
    monkeypatch.setenv("PYTEST_SMOLVM_CANARY", canary)
    r = vm.exec("env; cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'")
    assert canary not in r.stdout
    assert "PYTEST_SMOLVM_CANARY" not in r.stdout
    assert vm.exec("echo $ONLY_HERE", env={"ONLY_HERE": canary}).stdout == canary + "\n"
    assert canary not in vm.exec("env").stdout  # per-exec env does not stick


# --------------------------------------------------------------------------- destroy


def test_destroy_leaves_nothing(make_guest: MakeGuest, backend: Backend) -> None:
    vm, guest = make_guest()
    vm.exec("echo x > /root/f; sleep 300 >/dev/null 2>&1 &", check=True)
    if backend.name == "namespace":
        _check_namespace_destroy(guest)
    elif backend.name == "smol":
        _check_smol_destroy(guest, getattr(backend, "target", "local"))
    guest.destroy()  # a second destroy is a no-op, never an error
    with pytest.raises(GuestError):
        vm.exec("true")


def _check_namespace_destroy(guest: Guest) -> None:
    from pytest_smolvm.host.procs import process_start_time

    data = guest.registry_data()
    pid, scratch, cgroup_dirs = int(data["pid"]), Path(data["scratch"]), list(data["cgroups"])
    assert process_start_time(pid) is not None and scratch.exists()
    guest.destroy()
    assert process_start_time(pid) is None, "the guest init survived destroy"
    assert not scratch.exists(), "the scratch dir survived destroy"
    assert [d for d in cgroup_dirs if os.path.exists(d)] == [], "cgroup dirs survived destroy"


def _check_smol_destroy(guest: Guest, target: str) -> None:
    from pytest_smolvm.backends.smol.backend import list_owned
    from pytest_smolvm.backends.smol.sdk import vm_data_dir

    # list_owned names a cloud machine by its id (what delete takes), a local one by name
    me = str(guest.registry_data()["id"] if target == "cloud" else guest.name)

    def names() -> set[str]:
        return {m.name for m in list_owned({"pytest-smolvm": "1"}, target=target)}

    assert me in names()
    guest.destroy()
    assert me not in names(), "the machine is still listed after destroy"
    if target == "local":
        assert not vm_data_dir(guest.name).exists(), "the machine's data dir survived destroy"
    assert isinstance(guest.logs(), str)  # captured before the delete, readable after


# --------------------------------------------------------------------------- smol without a boot
# These need no microVM: they hold the smol backend to what it promises on any host.


def test_importing_the_smol_backend_has_no_side_effects() -> None:
    code = ("import os, sys; before = dict(os.environ); import pytest_smolvm.backends.smol.backend, "
            "pytest_smolvm.backends.smol.probe, pytest_smolvm.backends.smol.doctor; "
            "assert 'smol' not in sys.modules, 'smol was imported'; "
            "assert dict(os.environ) == before, 'os.environ changed'")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLVM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_cloud_target_without_a_key_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    from pytest_smolvm.backends.smol.backend import SmolBackend

    monkeypatch.delenv("SMOL_CLOUD_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    with pytest.raises(UsageError) as info:
        SmolBackend(BackendOptions(target="cloud"))
    message = str(info.value)
    assert "SMOL_CLOUD_TOKEN" in message and "smol" in message and "\n" not in message


def test_cloud_key_is_found_in_the_cli_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pytest_smolvm.backends.smol.backend import cloud_token_source

    monkeypatch.delenv("SMOL_CLOUD_TOKEN", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    config = tmp_path / "smolvm" / "config.toml"
    config.parent.mkdir()
    config.write_text('[other]\napi_key = "no"\n')
    assert cloud_token_source() in (None, str(Path.home() / ".config" / "smolvm" / "config.toml"))
    config.write_text('[cloud]\napi_key = "sk-test"\n')
    assert cloud_token_source() == str(config)
    monkeypatch.setenv("SMOL_CLOUD_TOKEN", "x")
    assert cloud_token_source() == "SMOL_CLOUD_TOKEN"


def test_deleting_a_machine_that_never_existed_is_not_an_error() -> None:
    pytest.importorskip("smol")
    from pytest_smolvm.backends.smol.backend import destroy_recorded, list_owned
    from pytest_smolvm.backends.smol.sdk import vm_data_dir

    name = f"pytest-smolvm-never-{uuid.uuid4().hex[:12]}"
    destroy_recorded({"name": name, "target": "local"})
    assert not (vm_data_dir(name).parent / f".{name}.fork-operation.lock").exists()
    assert list_owned({"pytest-smolvm": "1", "run": f"no-such-run-{RUN_ID}"}) == []


def test_copy_out_never_parses_a_guest_stream_with_tarfile(vm: VM, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """tarfile's parser (filters included) is no wall on this Python: only hostfs reads what a
    guest streams out, on every backend (the smol backend once renamed members with tarfile)."""
    real_open = tarfile.open

    def writing_only(*args: Any, **kwargs: Any) -> Any:
        mode = str(kwargs.get("mode", args[1] if len(args) > 1 else "r"))
        assert not mode.startswith("r"), "a guest's stream was parsed with tarfile on the host"
        return real_open(*args, **kwargs)

    monkeypatch.setattr(tarfile, "open", writing_only)
    vm.exec("mkdir -p /work/t/sub && echo a > /work/t/sub/f && ln /work/t/sub/f /work/t/h && chmod 640 /work/t/h",
            check=True)
    out = vm.copy_out("/work/t", tmp_path / "tree")
    assert (out / "sub" / "f").read_text() == "a\n" and (out / "h").stat().st_ino == (out / "sub" / "f").stat().st_ino
    one = vm.copy_out("/work/t/sub/f", tmp_path / "one")
    assert one.read_text() == "a\n" and stat.S_IMODE(one.stat().st_mode) == 0o640


def _peak_bytes_held(call: Any) -> int:
    """The most memory this process held at once (Python allocations) while ``call`` ran."""
    tracemalloc.start()
    try:
        with contextlib.suppress(OSError, GuestError):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_read_past_its_cap_holds_no_more_than_the_cap(vm: VM, tmp_path: Path) -> None:
    """What a guest sends is refused as it arrives, not once it has all arrived (issue 23.7):
    the smol backend once had the SDK read a whole file, then looked at its size."""
    vm.exec("mkdir -p /work/tree && head -c 48m /dev/zero > /work/big && cp /work/big /work/tree/", check=True)
    cap, held = 1 << 20, 8 << 20  # held: the cap, a pipe and the transfer's own pieces, with room
    with pytest.raises(OSError) as refused:
        vm.read_file("/work/big", max_bytes=cap)
    assert refused.value.errno == errno.EFBIG
    assert _peak_bytes_held(lambda: vm.read_file("/work/big", max_bytes=cap)) < held
    for source in ("/work/big", "/work/tree"):
        with pytest.raises((OSError, GuestError)):
            vm.copy_out(source, tmp_path / "refused", max_bytes=cap)
        assert _peak_bytes_held(lambda src=source: vm.copy_out(src, tmp_path / "refused", max_bytes=cap)) < held, source
        assert not (tmp_path / "refused").exists()


# --------------------------------------------------------------------------- defaults


def _cloud_resources(guest: Guest, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The resources the loopback smol cloud holds for ``guest``'s machine."""
    cloud = request.getfixturevalue("loopback_cloud")
    machine_id = getattr(guest, "machine_id", None)
    found = [m for m in cloud.machines() if m.get("id") == machine_id or m.get("name") == guest.name]
    assert len(found) == 1, [m.get("name") for m in cloud.machines()]
    resources: dict[str, Any] = found[0]["resources"]
    return resources


def _cgroup_file(guest: Guest, *names: str) -> str | None:
    """The first of ``names`` in the guest's cgroup dirs, read; None without that controller."""
    for directory in getattr(guest, "cgroup_dirs", []):
        for name in names:
            path = Path(directory, name)
            if path.exists():
                return path.read_text()
    return None


def _memory_limit_mb(backend: Backend, guest: Guest, request: pytest.FixtureRequest) -> int:
    """The memory the backend gave ``guest``: its cgroup (namespace), its machine (smol cloud)."""
    if backend.name == "namespace":
        limit = _cgroup_file(guest, "memory.limit_in_bytes", "memory.max")
        if limit is None:
            pytest.skip("no memory cgroup on this host: the limit is not applied")
        # A tmpfs disk's files are charged to it as well; an ext4 disk's page cache is reclaimable
        tmpfs = getattr(guest, "disk", "tmpfs") == "tmpfs"
        return (int(limit) >> 20) - (limits.LIMITS.disk_mb if tmpfs else 0)
    if getattr(backend, "target", "") == "cloud":
        return int(_cloud_resources(guest, request)["memoryMb"])
    pytest.skip(f"{backend.name}: no way to read a guest's memory from outside it")


def _cpu_limit(backend: Backend, guest: Guest, request: pytest.FixtureRequest) -> float:
    """The CPUs the backend gave ``guest``: its cgroup's quota (namespace), its machine's vCPUs."""
    if backend.name == "namespace":
        quota = _cgroup_file(guest, "cpu.max")
        if quota is not None:
            allowed, period = quota.split()
            return int(allowed) / int(period)
        quota = _cgroup_file(guest, "cpu.cfs_quota_us")
        if quota is None:
            pytest.skip("no cpu cgroup on this host: the limit is not applied")
        return int(quota) / int(_cgroup_file(guest, "cpu.cfs_period_us") or 0)
    if getattr(backend, "target", "") == "cloud":
        return float(_cloud_resources(guest, request)["cpus"])
    pytest.skip(f"{backend.name}: no way to read a guest's CPUs from outside it")


def test_one_default_memory_size_on_every_backend(backend: Backend, make_guest: MakeGuest,
                                                  request: pytest.FixtureRequest) -> None:
    """The same test gets the same memory whatever backend runs it, and memory_mb overrides it."""

    _, default = make_guest()
    assert _memory_limit_mb(backend, default, request) == limits.LIMITS.memory_mb
    _, asked = make_guest(memory_mb=320)
    assert _memory_limit_mb(backend, asked, request) == 320


def test_one_default_cpu_count_on_every_backend(backend: Backend, make_guest: MakeGuest,
                                                request: pytest.FixtureRequest) -> None:
    """The same test gets the same CPUs whatever backend runs it, and cpus overrides it."""

    _, default = make_guest()
    assert _cpu_limit(backend, default, request) == limits.LIMITS.cpus
    _, asked = make_guest(cpus=1)
    assert _cpu_limit(backend, asked, request) == 1
