"""network=True on the namespace backend: NAT to a stand-in internet, never the host's network.

The stand-in internet is a network namespace this module makes (a veth pair to the host,
10.231.0.0/24 of our own choosing) with a TCP server in it: nothing leaves the machine.
Root only: making the stand-in needs CAP_NET_ADMIN on the host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests import tools

if TYPE_CHECKING:
    from tests.smolcloud.harness import LoopbackCloud


@pytest.fixture(autouse=True)
def _network_tools(request: pytest.FixtureRequest) -> None:
    """Each tool this module needs, or a skip naming its install line (a failure in CI)."""
    tools.require_root("to make the stand-in internet")
    tools.require("ip", "the stand-in internet's network namespace and veth pair")
    if request.node.originalname != "test_missing_pasta_is_one_line_with_the_install_command":
        tools.require("pasta", "a guest's NAT with the network on")
        tools.require("nft", "a networked guest's fence and egress ledger")

INTERNET_HOST = "10.231.0.2"
HOST_SIDE = "10.231.0.1"
OTHER_HOST = "10.231.0.3"  # the stand-in internet's second host: not on any allowlist
DNS_HOST = "10.231.0.4"  # the stand-in internet's DNS server: not on any allowlist either
STAND_IN_NAMES = {"allowed.test": INTERNET_HOST, "other.test": OTHER_HOST}
_current: dict[str, str] = {}  # the stand-in internet's namespace, while it exists (one at a time)

# The stand-in internet's DNS server, at argv[2]:53: an A record for each name of the JSON map
# argv[3], NXDOMAIN for anything else; every name it is asked for goes to its log (argv[1]).
DNS_SERVER = """
import json, socket, struct, sys
names = json.loads(sys.argv[3])
log = open(sys.argv[1], "a", buffering=1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[2], 53))
while True:
    data, peer = s.recvfrom(4096)
    at, labels = 12, []
    while data[at]:
        labels.append(data[at + 1:at + 1 + data[at]].decode(errors="replace"))
        at += 1 + data[at]
    qtype = struct.unpack_from("!H", data, at + 1)[0]
    name = ".".join(labels).lower()
    log.write(name + "\\n")
    question = data[12:at + 5]
    found = names.get(name)
    answers = [found] if found and qtype == 1 else []
    flags = 0x8180 if found else 0x8183
    reply = struct.pack("!HHHHHH", struct.unpack_from("!H", data)[0], flags, 1, len(answers), 0, 0) + question
    for a in answers:
        reply += struct.pack("!HHHIH", 0xC00C, 1, 1, 60, 4) + socket.inet_aton(a)
    s.sendto(reply, peer)
"""

# For a run's test module: the host UDP ports a guest's pasta holds (one per flow of the guest's).
PASTA_UDP_PORTS = """
import subprocess

def pasta_udp_ports(vm):
    [pasta] = [line.split()[0] for line in subprocess.run(
        ["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
        if line.split()[1].endswith("/pasta") and vm.name in line]
    return [int(line.split()[3].rsplit(":", 1)[1]) for line in subprocess.run(
        ["ss", "-uanpH"], capture_output=True, text=True).stdout.splitlines() if f"pid={pasta}," in line]
"""

# A UDP echo server for the stand-in internet, at argv[1]:argv[2].
UDP_ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
while True:
    data, peer = s.recvfrom(4096)
    s.sendto(data, peer)
"""


@pytest.fixture
def stand_in_internet() -> Iterator[str]:
    """A namespace at 10.231.0.2 serving TCP port 8080, routed from the host over a veth pair.

    One at a time on this host: under -n 2 two of them would put 10.231.0.1 on two links."""
    from filelock import FileLock

    with FileLock(os.path.join(tempfile.gettempdir(), "pytest-smolvm-stand-in-internet.lock")):
        yield from _stand_in_internet()


def _stand_in_internet() -> Iterator[str]:
    tag = uuid.uuid4().hex[:6]
    ns, veth = f"sx-internet-{tag}", f"se{tag}"  # no "smolvm" in it: the leak checks look for that
    subprocess.run(["ip", "netns", "add", ns], check=True)
    server = None
    try:
        for cmd in (["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns],
                    ["ip", "addr", "add", f"{HOST_SIDE}/24", "dev", veth], ["ip", "link", "set", veth, "up"],
                    ["ip", "-n", ns, "addr", "add", f"{INTERNET_HOST}/24", "dev", "eth0"],
                    ["ip", "-n", ns, "addr", "add", f"{OTHER_HOST}/24", "dev", "eth0"],
                    ["ip", "-n", ns, "link", "set", "eth0", "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True)
        _current["ns"], _current["veth"] = ns, veth
        server = subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-m", "http.server", "8080",
                                   "--bind", "0.0.0.0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        yield INTERNET_HOST
    finally:
        _current.pop("ns", None)
        _current.pop("veth", None)
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", veth], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], check=False)


@pytest.fixture
def stand_in_dns(stand_in_internet: str, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The stand-in internet's DNS server at 10.231.0.4; (a resolv.conf naming it, the log of the
    names it was asked)."""
    log, conf = tmp_path / "dns-asked.log", tmp_path / "resolv.conf"
    log.touch()
    conf.write_text(f"nameserver {DNS_HOST}\n")
    subprocess.run(["ip", "-n", _current["ns"], "addr", "add", f"{DNS_HOST}/24", "dev", "eth0"], check=True)
    server = subprocess.Popen(["ip", "netns", "exec", _current["ns"], sys.executable, "-c", DNS_SERVER, str(log),
                               DNS_HOST, json.dumps(STAND_IN_NAMES)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield conf, log
    finally:
        server.kill()
        server.wait()


def _with_resolver(conf: Path, argv: list[str]) -> list[str]:
    """``argv`` in a mount namespace of its own whose /etc/resolv.conf is ``conf``: the plugin reads
    the host's resolver where it always does, and this host's own resolver stays untouched."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(conf), *argv]


def _pasta_processes(state: Path) -> list[str]:
    """pasta processes of guests made under ``state`` (its pid file, in their scratch dir, names
    it): other tests' guests may have the network on at the same time under -n 2."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "pasta -f -q -4" in line and str(state) in line]


def test_network_true_reaches_the_internet_and_nothing_of_the_hosts(
        pytester: pytest.Pytester, smol_state: Path, stand_in_internet: str) -> None:
    pytester.makepyfile(f"""
        import socket, threading
        import pytest

        @pytest.fixture
        def host_server():
            # Every address of the host: its loopback and its other interfaces (the veth end too).
            server = socket.socket()
            server.bind(("0.0.0.0", 0))
            server.listen(16)
            threading.Thread(target=lambda: [server.accept()[0].close() for _ in range(16)],
                             daemon=True).start()
            yield server.getsockname()[1]
            server.close()

        @pytest.mark.smol(network=True)
        def test_nat(smol_vm, host_server):
            # 'sleep 1': pasta's tap is up when create returns, its first ARP/route may lag.
            r = smol_vm.exec("wget -q -T 5 -O - http://{stand_in_internet}:8080/ >/dev/null && echo reached")
            assert "reached" in r.stdout, r.stderr
            for addr in ("127.0.0.1", "{HOST_SIDE}"):
                r = smol_vm.exec(f"nc -z -w 2 {{addr}} {{host_server}}")
                assert r.exit_code != 0, f"the guest reached the host's listener on {{addr}}"
            assert smol_vm.exec("nc -z -w 2 169.254.169.254 80").exit_code != 0, "metadata endpoint reached"

        def test_default_is_off(smol_vm):
            r = smol_vm.exec("wget -q -T 3 -O - http://{stand_in_internet}:8080/ >/dev/null && echo reached")
            assert "reached" not in r.stdout
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=2)
    assert _pasta_processes(smol_state) == []


def test_no_nat_process_outlives_a_killed_run(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import os, signal
        import pytest

        @pytest.mark.smol(network=True)
        def test_killed(smol_vm):
            smol_vm.exec("true")
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    pytester.runpytest_subprocess()
    import time
    deadline = time.monotonic() + 10
    while _pasta_processes(smol_state) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pasta_processes(smol_state) == []
    assert _leaked_fence_tables() == [], "the watcher removes the fence's host table when the guest goes"


def test_network_in_user_namespace_mode_is_refused_in_one_line(shared_cache: Path) -> None:
    """A normal user's guest (a user namespace) cannot have the network: its egress fence is a
    rule in the host's nftables, which only root can load, and a guest never runs unfenced (it
    had pasta with routes taken at creation). Its guests without the network still run."""
    from tests.test_unprivileged import NOBODY, _base_env, _nobody_cannot_import

    if shutil.which("setpriv") is None or _nobody_cannot_import():
        pytest.skip("user nobody cannot run this interpreter's pytest")
    home = Path(tempfile.mkdtemp(prefix="smolvm-egress-nobody-"))
    try:
        home.chmod(0o755)
        (home / "test_user.py").write_text(f"""
import pytest

@pytest.mark.smol(network=True)
def test_nat(smol_vm):
    pass

@pytest.mark.smol(allow_hosts=["{INTERNET_HOST}"])
def test_allowlist(smol_vm):
    pass

def test_off(smol_vm):
    assert smol_vm.exec("true").exit_code == 0
""")
        for sub in ("state", "cache", "tmp"):
            (home / sub).mkdir()
        for path in [home, *home.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)
        env = {**_base_env(), "HOME": str(home), "PYTEST_SMOLVM_STATE_DIR": str(home / "state"),
               "PYTEST_SMOLVM_CACHE_DIR": str(home / "cache"), "TMPDIR": str(home / "tmp"),
               "XDG_CACHE_HOME": str(home / "cache"), "XDG_DATA_HOME": str(home / "cache")}
        result = subprocess.run([
            "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-m", "pytest",
            "-p", "no:cacheprovider", "--smol-backend=namespace", str(home / "test_user.py")],
            cwd=home, env=env, capture_output=True, text=True, timeout=300)
        assert "1 passed, 2 errors" in result.stdout, result.stdout + result.stderr
        assert result.stdout.count("network=True and allow_hosts on the namespace backend need root: the egress "
                                   "fence is a rule in the host's nftables") >= 2, result.stdout
        assert _pasta_processes(home) == []
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_missing_pasta_is_one_line_with_the_install_command(pytester: pytest.Pytester, smol_state: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    bare = pytester.mkdir("bin-without-pasta")
    for tool in ("ip", "nsenter", "sh", "mount", "umount", "setpriv", "unshare"):
        found = shutil.which(tool)
        if found:
            (bare / tool).symlink_to(found)
    monkeypatch.setenv("PATH", str(bare))
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol(network=True)
        def test_nat(smol_vm):
            pass

        def test_off_still_works(smol_vm):
            assert smol_vm.exec("true").exit_code == 0
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*network=True on the namespace backend needs pasta, nftables and iproute2: "
                                 "apt-get install -y passt nftables iproute2*"])


def test_missing_ip_is_the_same_one_line(pytester: pytest.Pytester, smol_state: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """pasta and nft there, ip not: the host's addresses cannot be read, so no guest gets a network
    (before, a raw FileNotFoundError for 'ip' from deep in the guest's setup)."""
    bare = pytester.mkdir("bin-without-ip")
    for tool in ("pasta", "nft", "nsenter", "sh", "mount", "umount", "setpriv", "unshare"):
        found = tools.require(tool, "this test's PATH")
        (bare / tool).symlink_to(found)
    monkeypatch.setenv("PATH", str(bare))
    pytester.makeconftest("""
        from pytest_smolvm.backends.namespace import network
        network.SBIN = ()  # the PATH alone says where tools are: ip is on neither
    """)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol(network=True)
        def test_nat(smol_vm):
            pass
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*network=True on the namespace backend needs pasta, nftables and iproute2: "
                                 "apt-get install -y passt nftables iproute2*"])
    assert "FileNotFoundError" not in result.stdout.str()


def test_parallel_guests_each_with_their_own_setting_and_failing_tests_leave_no_nat(
        pytester: pytest.Pytester, smol_state: Path, stand_in_internet: str) -> None:
    pytester.makepyfile(f"""
        import pytest

        URL = "http://{stand_in_internet}:8080/"

        @pytest.mark.parametrize("i", range(3))
        @pytest.mark.smol(network=True)
        def test_on(smol_vm, i):
            assert "ok" in smol_vm.exec(f"wget -q -T 5 -O /dev/null {{URL}} && echo ok").stdout

        @pytest.mark.parametrize("i", range(3))
        def test_off(smol_vm, i):
            assert "ok" not in smol_vm.exec(f"wget -q -T 2 -O /dev/null {{URL}} && echo ok").stdout

        @pytest.mark.smol(network=True)
        def test_fails(smol_vm):
            assert False, "a failing test with the network on"
    """)
    pytester.runpytest_subprocess("-n", "2").assert_outcomes(passed=6, failed=1)
    assert _pasta_processes(smol_state) == []


def test_allow_hosts_by_ip_and_cidr_refuses_everything_else(
        pytester: pytest.Pytester, smol_state: Path, stand_in_internet: str) -> None:
    pytester.makepyfile(f"""
        import pytest

        def get(vm, host):
            return "ok" in vm.exec(f"wget -q -T 3 -O /dev/null http://{{host}}:8080/ && echo ok").stdout

        @pytest.mark.smol(allow_hosts=["{INTERNET_HOST}"])
        def test_by_ip(smol_vm):
            assert get(smol_vm, "{INTERNET_HOST}")
            assert not get(smol_vm, "{OTHER_HOST}"), "an address not on the allowlist was reached"
            assert not get(smol_vm, "{HOST_SIDE}"), "the host was reached"
            assert smol_vm.exec("nc -z -w 2 169.254.169.254 80").exit_code != 0
            assert smol_vm.exec("ip route del 0.0.0.0/1").exit_code != 0  # no netlink, no CAP_NET_ADMIN

        @pytest.mark.smol(allow_hosts=["10.231.0.0/24"])
        def test_by_cidr(smol_vm):
            assert get(smol_vm, "{INTERNET_HOST}") and get(smol_vm, "{OTHER_HOST}")
            assert not get(smol_vm, "{HOST_SIDE}"), "an allowed CIDR reopened the host's own address"

        @pytest.mark.smol(allow_hosts=["localhost"])
        def test_by_name_is_answered_by_the_dns_proxy(smol_vm):
            assert "Address: 127.0.0.1" in smol_vm.exec("nslookup -type=a localhost 127.0.0.53").stdout
            assert not get(smol_vm, "{INTERNET_HOST}")

        @pytest.mark.smol(allow_hosts=["no-such-name.invalid"])
        def test_unresolvable(smol_vm):
            pass
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*allow_hosts: 'no-such-name.invalid' does not resolve on the host*"])
    assert _pasta_processes(smol_state) == []


def test_the_egress_ledger_records_every_attempt_in_the_log_and_the_results(
        pytester: pytest.Pytester, smol_state: Path, stand_in_internet: str) -> None:
    """Every connection a guest attempted, allowed or refused, shows in its log (so in every
    report sink) and as counts in its results line; a refused one is answered at once."""
    pytester.makepyfile(f"""
        import time
        import pytest

        @pytest.mark.smol(allow_hosts=["{INTERNET_HOST}"])
        def test_tries(smol_vm):
            assert smol_vm.exec("wget -q -T 3 -O /dev/null http://{INTERNET_HOST}:8080/").exit_code == 0
            started = time.monotonic()
            for _ in range(2):
                assert smol_vm.exec("nc -z -w 5 {OTHER_HOST} 8080").exit_code != 0
            assert time.monotonic() - started < 4, "a refused connection should be answered, not time out"
            assert smol_vm.exec("nc -z -w 5 169.254.169.254 80").exit_code != 0
            log = smol_vm.logs()
            assert "allowed tcp {INTERNET_HOST}:8080 (1x)" in log, log
            assert "refused tcp {OTHER_HOST}:8080 (2x)" in log, log
            assert "refused tcp 169.254.169.254:80 (1x)" in log, log
            assert False, "fail, so the report shows the guest's log"
    """)
    result = pytester.runpytest_subprocess("--smol-results=results.jsonl")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*egress ledger (3 destination(s), 3 refused connection(s)):*",
                                 f"*refused tcp {OTHER_HOST}:8080 (2x)*"])
    [line] = [json.loads(x) for x in (pytester.path / "results.jsonl").read_text().splitlines()]
    assert line["egress"] == {"allowed": 1, "refused": 3, "dns_names": 0, "dns_refused": 0}
    assert _pasta_processes(smol_state) == []


def test_allow_hosts_means_the_same_on_the_smol_backend_through_the_loopback_cloud(
        pytester: pytest.Pytester, smol_state: Path, stand_in_internet: str, cloud: LoopbackCloud, token: str) -> None:
    """The same marker through the real SDK and the smol backend: the SDK sends an allowCidrs
    network, the loopback service enforces it with a namespace guest's allowlist."""
    pytester.makepyfile(f"""
        import pytest

        def get(vm, host):
            return "ok" in vm.exec(f"wget -q -T 3 -O /dev/null http://{{host}}:8080/ && echo ok").stdout

        @pytest.mark.smol(allow_hosts=["{INTERNET_HOST}"])
        def test_allowlisted(smol_vm):
            assert get(smol_vm, "{INTERNET_HOST}")
            assert not get(smol_vm, "{OTHER_HOST}")

        def test_default_is_off(smol_vm):
            assert not get(smol_vm, "{INTERNET_HOST}")
    """)
    result = pytester.runpytest_subprocess("--smol-backend=smol", "--smol-target=cloud", "--smol-baseline=alpine",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert cloud.wait_for_no_machines(token=token) == []


def _run_with_resolver(pytester: pytest.Pytester, conf: Path, *args: str) -> pytest.RunResult:
    return pytester.run(*_with_resolver(conf, [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                                               f"--basetemp={pytester.path / 'inner-tmp'}", *args]), timeout=240)


def test_network_true_resolves_names_through_the_proxy_and_lists_them(
        pytester: pytest.Pytester, smol_state: Path, stand_in_dns: tuple[Path, Path]) -> None:
    """The guest's resolver is its proxy on 127.0.0.53; the proxy asks the host's resolver (here the
    stand-in internet's DNS server) and the names asked land in the log and the results line."""
    conf, asked = stand_in_dns
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol(network=True)
        def test_names(smol_vm):
            assert smol_vm.exec("cat /etc/resolv.conf").stdout == "nameserver 127.0.0.53\\n"
            r = smol_vm.exec("wget -q -T 5 -O - http://allowed.test:8080/ >/dev/null && echo reached")
            assert "reached" in r.stdout, r.stderr
            assert "10.231.0.3" in smol_vm.exec("nslookup -type=a other.test").stdout
            assert smol_vm.exec("nslookup -type=a nowhere.test").exit_code != 0  # NXDOMAIN, relayed
            assert smol_vm.exec("nc -z -w 2 127.0.0.53 53").exit_code != 0, "the proxy speaks no TCP"
            log = smol_vm.logs()
            assert "dns names asked (3 name(s), 0 refused):" in log, log
            assert "allowed dns allowed.test A" in log and "allowed dns other.test A" in log, log
            assert False, "fail, so the report shows the guest's log"
    """)
    result = _run_with_resolver(pytester, conf, "--smol-results=results.jsonl")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*dns names asked (3 name(s), 0 refused):*", "*allowed dns nowhere.test A (1x)*"])
    [line] = [json.loads(x) for x in (pytester.path / "results.jsonl").read_text().splitlines()]
    assert line["egress"]["dns_names"] == 3 and line["egress"]["dns_refused"] == 0, line["egress"]
    assert {"allowed.test", "other.test", "nowhere.test"} <= set(asked.read_text().split())
    assert _pasta_processes(smol_state) == []


def test_allow_hosts_answers_its_names_only_and_never_asks_upstream_for_others(
        pytester: pytest.Pytester, smol_state: Path, stand_in_dns: tuple[Path, Path]) -> None:
    conf, asked = stand_in_dns
    pytester.makepyfile(f"""
        import time
        import pytest

        @pytest.mark.smol(allow_hosts=["allowed.test"])
        def test_names(smol_vm):
            r = smol_vm.exec("wget -q -T 5 -O - http://allowed.test:8080/ >/dev/null && echo reached")
            assert "reached" in r.stdout, r.stderr
            assert "allowed.test" not in smol_vm.exec("cat /etc/hosts").stdout  # the proxy answers it
            started = time.monotonic()
            r = smol_vm.exec("nslookup -type=a other.test")
            assert r.exit_code != 0 and "{OTHER_HOST}" not in r.stdout, r.stdout
            assert smol_vm.exec("wget -q -T 5 -O /dev/null http://other.test:8080/").exit_code != 0
            assert time.monotonic() - started < 4, "a refused name should be answered, not time out"
            # Around the proxy, straight to the stand-in's DNS server: its address is not allowed.
            assert "{OTHER_HOST}" not in smol_vm.exec("nslookup -timeout=2 -type=a other.test {DNS_HOST}").stdout
            log = smol_vm.logs()
            assert "allowed dns allowed.test A" in log, log
            assert "refused dns other.test A" in log, log
            assert False, "fail, so the report shows the guest's log"
    """)
    result = _run_with_resolver(pytester, conf, "--smol-results=results.jsonl")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*dns names asked (2 name(s), 1 refused):*"])
    [line] = [json.loads(x) for x in (pytester.path / "results.jsonl").read_text().splitlines()]
    assert line["egress"]["dns_names"] == 2 and line["egress"]["dns_refused"] == 1, line["egress"]
    assert "other.test" not in asked.read_text().split(), "a refused name was asked upstream"
    assert _pasta_processes(smol_state) == []


def test_bad_queries_get_error_replies_and_the_proxy_serves_on(
        pytester: pytest.Pytester, smol_state: Path, stand_in_dns: tuple[Path, Path]) -> None:
    """Guest-made datagrams that are no plain query: an error reply (or, too short for an id,
    none), never an exception; the proxy answers the next good query; names are escaped."""
    conf, _asked = stand_in_dns
    pytester.makepyfile(r"""
        import pytest

        HEADER = r"\022\064\001\000"  # id 0x1234, RD
        CASES = {
            "two questions": HEADER + r"\000\002\000\000\000\000\001a\000\000\001\000\001",
            "a compression pointer": HEADER + r"\000\001\000\000\000\000\300\014\000\001\000\001",
            "a name past the end": HEADER + r"\000\001\000\000\000\000\077abc",
            "a name over 255 bytes": HEADER + r"\000\001\000\000\000\000" + r"\077" + "a" * 63 + r"\077" + "b" * 63
                                     + r"\077" + "c" * 63 + r"\077" + "d" * 63 + r"\000\000\001\000\001",
        }

        def ask(vm, payload):
            r = vm.exec(f"printf '{payload}' | nc -u -w 1 127.0.0.53 53 | od -An -tx1")
            return r.stdout.split()

        @pytest.mark.smol(network=True)
        def test_bad(smol_vm):
            for why, payload in CASES.items():
                assert ask(smol_vm, payload)[:4] == ["12", "34", "81", "81"], why  # FORMERR
            big = smol_vm.exec("head -c 600 /dev/zero | nc -u -w 1 127.0.0.53 53 | od -An -tx1").stdout.split()
            assert big[:4] == ["00", "00", "80", "81"], big  # over 512 bytes: FORMERR
            assert ask(smol_vm, r"\022\064\001") == []  # no id to answer: dropped
            weird = r"\022\064\001\000\000\001\000\000\000\000\000\000\004\033]0;\000\000\001\000\001"
            assert ask(smol_vm, weird)[:4] == ["12", "34", "81", "83"]  # forwarded, not found: NXDOMAIN
            r = smol_vm.exec("wget -q -T 5 -O - http://allowed.test:8080/ >/dev/null && echo reached")
            assert "reached" in r.stdout, r.stderr
            log = smol_vm.logs()
            assert "refused dns (malformed queries) (6x)" in log, log
            assert "allowed dns \\027\\0930\\059 A (1x)" in log and "\x1b" not in log, log  # escaped, inert
    """)
    result = _run_with_resolver(pytester, conf)
    result.assert_outcomes(passed=1)
    assert _pasta_processes(smol_state) == []


def test_the_proxy_leaves_no_thread_or_fd_once_its_guests_are_gone(
        pytester: pytest.Pytester, smol_state: Path, stand_in_dns: tuple[Path, Path]) -> None:
    """Through the library API, in a process of its own: after close, no proxy thread, and no fd
    the run opened (the guests' DNS sockets, the upstream sockets, the thread's selector) is left."""
    conf, _asked = stand_in_dns
    script = pytester.path / "run.py"
    script.write_text("""
import os, threading, time
import pytest_smolvm

def fds():
    return {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}

with pytest_smolvm.Session(backend="namespace") as session:
    session.create()  # a first run in a fresh cache keeps a socket of its own: not the proxy's
before = fds()
with pytest_smolvm.Session(backend="namespace") as session:
    for keywords in ({"network": True}, {"allow_hosts": ["allowed.test"]}, {"network": True}):
        vm = session.create(**keywords)
        assert "10.231.0.2" in vm.exec("nslookup -type=a allowed.test").stdout
        assert any(t.name == "smolvm-dns-proxy" for t in threading.enumerate())
        session.destroy(vm)
def left():
    threads = sorted(t.name for t in threading.enumerate() if t.name == "smolvm-dns-proxy")
    return threads, {fd: what for fd, what in fds().items() if fd not in before and what.startswith(("socket", "anon"))}

deadline = time.monotonic() + 10  # close waited for every destroy; the thread ends right after
while left() != ([], {}) and time.monotonic() < deadline:
    time.sleep(0.05)
print("threads:", left()[0])
print("sockets left:", left()[1])
""")
    result = pytester.run(*_with_resolver(conf, [sys.executable, str(script)]), timeout=240)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["threads: []", "sockets left: {}"])
    assert _pasta_processes(smol_state) == []


METADATA_STAND_INS = ("168.63.129.16", "100.100.100.200")  # Azure's WireServer, Alibaba's metadata


def _orphan_fence_tables() -> list[str]:
    """The fence's tables in the host's nftables whose guest init is gone, at this moment."""
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if "smolvm_fence_" in line]
    return [n for n in names if not Path(f"/proc/{n.rsplit('_', 1)[-1]}").exists()]


def _leaked_fence_tables(settle: float = 10.0) -> list[str]:
    """The fence's tables orphaned for all of ``settle`` seconds: none may be left. A table whose
    watcher is removing it right now (a guest of another xdist worker, just destroyed) is
    orphaned for the ~10 ms of nftables' commit, and must not be taken for a leak."""
    import time

    leaked = _orphan_fence_tables()
    deadline = time.monotonic() + settle
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = [name for name in _orphan_fence_tables() if name in leaked]
    return leaked


@pytest.fixture
def metadata_stand_ins(stand_in_internet: str) -> Iterator[tuple[str, ...]]:
    """The clouds' metadata addresses (but 169.254.169.254: this host may be a cloud machine and
    use its own) as addresses of the stand-in internet, routed to it over the veth pair."""
    veth = _current["veth"]
    for addr in METADATA_STAND_INS:
        subprocess.run(["ip", "-n", _current["ns"], "addr", "add", f"{addr}/32", "dev", "eth0"], check=True)
    added: list[str] = []
    try:
        for addr in METADATA_STAND_INS:
            subprocess.run(["ip", "route", "add", f"{addr}/32", "via", INTERNET_HOST, "dev", veth], check=True)
            added.append(addr)
        yield METADATA_STAND_INS
    finally:
        for addr in added:
            subprocess.run(["ip", "route", "del", f"{addr}/32", "via", INTERNET_HOST, "dev", veth], check=False)


LISTENERS = """
import socket, subprocess, threading, time
import pytest

def reach(vm, addr, port):
    return vm.exec(f"nc -z -w 2 {addr} {port}").exit_code == 0

def get(vm, host):
    return "ok" in vm.exec(f"wget -q -T 3 -O /dev/null http://{host}:8080/ && echo ok").stdout

@pytest.fixture
def host_listeners():
    # A TCP and a UDP service of the host, on every address it has or will have.
    tcp = socket.socket()
    tcp.bind(("0.0.0.0", 0))
    tcp.listen(64)
    threading.Thread(target=lambda: [tcp.accept()[0].close() for _ in range(64)], daemon=True).start()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", 0))
    got = []
    threading.Thread(target=lambda: [got.append(udp.recvfrom(64)) for _ in range(64)], daemon=True).start()
    yield tcp.getsockname()[1], udp.getsockname()[1], got
    tcp.close()
    udp.close()
"""


def test_the_fence_is_a_rule_addresses_and_local_routes_gained_later_and_broadcast_are_refused(
        pytester: pytest.Pytester, smol_state: Path, stand_in_internet: str) -> None:
    """What the host makes local after the guest exists (an address on the stand-in's link, one
    inside an allowed CIDR; a local route), the all-hosts multicast group (which reached host UDP
    services bound to 0.0.0.0, both ways) and broadcast are refused per packet, and the refusals
    are in the ledger: the fence is no list taken at creation."""
    veth = _current["veth"]
    pytester.makepyfile(LISTENERS + f"""
import contextlib

@contextlib.contextmanager
def gained_later():
    # The all-hosts group is routed to the stand-in's link, not the host's real one: the
    # datagrams to it (and its looped-back copies) stay on this machine.
    made = [["route", "add", "local", "10.233.7.0/24", "dev", "lo"], ["addr", "add", "10.231.0.9/24", "dev", "{veth}"],
            ["route", "add", "224.0.0.1/32", "dev", "{veth}"]]
    try:
        for cmd in made:
            subprocess.run(["ip", *cmd], check=True)
        yield
    finally:
        for cmd in made:
            subprocess.run(["ip", cmd[0], "del", *cmd[2:]], check=False)

def tries(vm, listeners):
    tcp, udp, got = listeners
    assert get(vm, "{INTERNET_HOST}")
    with gained_later():
        for addr in ("10.233.7.5", "10.231.0.9"):
            socket.create_connection((addr, tcp), 2).close()  # the host itself reaches it
            assert not reach(vm, addr, tcp), f"the guest reached the host's listener on {{addr}}, made later"
        for addr in ("224.0.0.1", "10.231.0.255", "255.255.255.255"):
            vm.exec(f"echo hi | nc -u -w 1 {{addr}} {{udp}}")
        time.sleep(0.5)
    assert got == [], f"a host UDP service heard the guest: {{got}}"
    log = vm.logs()
    for addr in ("10.233.7.5", "10.231.0.9"):
        assert f"refused tcp {{addr}}:{{tcp}}" in log, log
    assert f"refused udp 224.0.0.1:{{udp}}" in log, log

@pytest.mark.smol(network=True)
def test_network_true(smol_vm, host_listeners):
    tries(smol_vm, host_listeners)

@pytest.mark.smol(allow_hosts=["10.231.0.0/24", "10.233.0.0/16"])
def test_inside_allowed_cidrs(smol_vm, host_listeners):
    tries(smol_vm, host_listeners)
""")
    pytester.runpytest_subprocess().assert_outcomes(passed=2)
    assert _pasta_processes(smol_state) == [] and _leaked_fence_tables() == []


def test_cloud_metadata_stand_ins_are_refused_and_no_cidr_widens_the_fence(
        pytester: pytest.Pytester, smol_state: Path, metadata_stand_ins: tuple[str, ...]) -> None:
    """Azure's and Alibaba's metadata addresses (stand-ins on the test network) are refused with
    the network on and under any allowlist; allow_hosts=["0.0.0.0/0"] provisions and is the fence."""
    import socket
    import time

    for addr in metadata_stand_ins:  # the stand-ins answer (once the server is up): a refusal below is the fence's
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((addr, 8080), timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    pytester.makepyfile(LISTENERS + f"""
METADATA = {metadata_stand_ins!r}

def refused(vm):
    for addr in METADATA:
        assert not get(vm, addr), f"the metadata stand-in {{addr}} answered the guest"
    for addr in METADATA:
        assert f"refused tcp {{addr}}:8080" in vm.logs()

@pytest.mark.smol(network=True)
def test_network_true(smol_vm):
    assert get(smol_vm, "{INTERNET_HOST}")
    refused(smol_vm)

@pytest.mark.smol(allow_hosts=["0.0.0.0/0"])
def test_everything_allowed(smol_vm, host_listeners):
    assert get(smol_vm, "{INTERNET_HOST}") and get(smol_vm, "{OTHER_HOST}")
    refused(smol_vm)
    assert not reach(smol_vm, "{HOST_SIDE}", host_listeners[0]), "0.0.0.0/0 reopened the host"

@pytest.mark.smol(allow_hosts=[*METADATA, "169.254.0.0/16"])
def test_metadata_allowed_by_name(smol_vm):
    refused(smol_vm)
    assert smol_vm.exec("nc -z -w 2 169.254.169.254 80").exit_code != 0
""")
    pytester.runpytest_subprocess().assert_outcomes(passed=3)
    assert _pasta_processes(smol_state) == [] and _leaked_fence_tables() == []


def test_a_fence_that_cannot_be_loaded_means_no_guest(pytester: pytest.Pytester, smol_state: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """nft failing to load the fence's table into the host's nftables: the guest does not start,
    one line says why, and nothing of it is left."""
    nft = shutil.which("nft") or "/usr/sbin/nft"
    fake = pytester.mkdir("bin-failing-nft") / "nft"
    fake.write_text(f"""#!/bin/sh
# nft, but a ruleset for the host's namespace (the fence's table) fails to load.
if [ "$1 $2" = "-f -" ]; then
    rules=$(cat)
    case "$rules" in *smolvm_fence_*) echo "Error: simulated: no nftables on this host" >&2; exit 1;; esac
    printf '%s\\n' "$rules" | exec {nft} "$@"
fi
exec {nft} "$@"
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol(network=True)
        def test_nat(smol_vm):
            pass

        @pytest.mark.smol(allow_hosts=["10.231.0.2"])
        def test_allowlist(smol_vm):
            pass
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*the egress fence could not be loaded into the host's nftables (so the guest "
                                 "does not start): Error: simulated: no nftables on this host*"])
    assert _pasta_processes(smol_state) == [] and _leaked_fence_tables() == []


def test_the_ledger_is_bounded_and_counts_what_it_cannot_list(
        pytester: pytest.Pytester, smol_state: Path, stand_in_internet: str) -> None:
    """300 allowed and 300 refused destinations: each set keeps LEDGER_ENTRIES, the rest is
    counted on a '(more destinations)' row, listed first, and the results line counts every flow
    (it used to keep 65,536 per set, each with per-CPU counters allocated in the packet path)."""
    from pytest_smolvm.backends.namespace.netrules import LEDGER_ENTRIES

    more = 300 - LEDGER_ENTRIES
    pytester.makepyfile(f"""
        import pytest

        @pytest.mark.smol(allow_hosts=["{INTERNET_HOST}"])
        def test_many(smol_vm):
            smol_vm.exec("for p in $(seq 1 300); do echo x | nc -u -w 1 {INTERNET_HOST} $p & done; wait")
            smol_vm.exec("for p in $(seq 1 300); do nc -z -w 1 10.232.0.1 $p & done; wait")  # off the list
            assert False, "fail, so the report shows the guest's log"
    """)
    result = pytester.runpytest_subprocess("--smol-results=results.jsonl")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*egress ledger ({2 * LEDGER_ENTRIES} destination(s), 300 refused connection(s)):*",
                                 f"*allowed tcp/udp (more destinations) ({more}x)*",
                                 f"*refused tcp/udp (more destinations) ({more}x)*"])
    [line] = [json.loads(x) for x in (pytester.path / "results.jsonl").read_text().splitlines()]
    assert line["egress"]["allowed"] == 300 and line["egress"]["refused"] == 300, line["egress"]
    assert _pasta_processes(smol_state) == [] and _leaked_fence_tables() == []


def test_another_guest_cannot_reach_a_guest_through_its_pasta_socket(
        pytester: pytest.Pytester, smol_state: Path, stand_in_internet: str) -> None:
    """Guest A's UDP flow out makes pasta bind a host socket; guest B's datagram to the all-hosts
    group on that port used to reach it, and pasta handed it to A: a channel between guests.
    The multicast group is routed to the stand-in's link for the test (nothing leaves the machine)."""
    veth = _current["veth"]
    pytester.makepyfile(PASTA_UDP_PORTS + textwrap.dedent(f"""
        import time
        import pytest

        def test_two_guests(smol_vm_factory):
            a, b = smol_vm_factory(network=True), smol_vm_factory(network=True)
            subprocess.run(["ip", "route", "add", "224.0.0.1/32", "dev", "{veth}"], check=True)
            try:
                a.exec(f"echo out | nc -u -p 4000 -w 1 {INTERNET_HOST} 9")
                [port] = pasta_udp_ports(a)  # the host socket pasta bound for A's flow
                a.exec(f"nc -u -l -p {{port}} > /tmp/heard 2>&1 & sleep 0.2")
                for addr in ("224.0.0.1", "{HOST_SIDE}"):
                    b.exec(f"echo from-b | nc -u -w 1 {{addr}} {{port}}")
                time.sleep(0.5)
            finally:
                subprocess.run(["ip", "route", "del", "224.0.0.1/32", "dev", "{veth}"], check=False)
            assert a.exec("cat /tmp/heard").stdout == "", "guest A heard guest B"
            assert f"refused udp 224.0.0.1:{{port}}" in b.logs(), b.logs()
    """))
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    assert _pasta_processes(smol_state) == [] and _leaked_fence_tables() == []


def test_a_guest_udp_flow_takes_no_host_port_of_its_choosing_and_lets_nothing_in(
        pytester: pytest.Pytester, smol_state: Path, stand_in_internet: str) -> None:
    """pasta binds a host socket for each UDP port a guest sends from. It used to bind the guest's
    own port, as root, so a guest sending from a low port (here one below 1024) took it from the
    host's services, and any host process's datagram to that port was handed into the guest.
    The guest's flows now leave its namespace from a port of the host's ephemeral range, and
    only answers from the peer a flow went to come back; the answers do come back."""
    echo = subprocess.Popen(["ip", "netns", "exec", _current["ns"], sys.executable, "-c", UDP_ECHO, INTERNET_HOST,
                             "7"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pytester.makepyfile(PASTA_UDP_PORTS + textwrap.dedent(f"""
            import random, socket, time

            def free_low_port():
                for port in random.sample(range(600, 1000), 400):
                    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                        try:
                            probe.bind(("0.0.0.0", port))
                        except OSError:
                            continue
                        return port
                raise AssertionError("no free UDP port below 1000 on this host")

            def test_ports(smol_vm_factory):
                vm = smol_vm_factory(network=True)
                port = free_low_port()
                answer = vm.exec(f"echo ping | nc -u -p {{port}} -w 1 {INTERNET_HOST} 7").stdout
                assert answer == "ping\\n", answer
                held = pasta_udp_ports(vm)
                low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
                assert held and all(low <= p <= high for p in held), (port, held)
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as service:
                    service.bind(("0.0.0.0", port))  # the host's service still gets its port
                vm.exec(f"nc -u -l -p {{port}} > /tmp/heard 2>&1 & sleep 0.2")
                for p in held:
                    vm.exec(f"nc -u -l -p {{p}} >> /tmp/heard 2>&1 & sleep 0.1")
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
                    for p in [port, *held]:
                        for addr in ("127.0.0.1", "{HOST_SIDE}"):
                            sender.sendto(b"from-the-host", (addr, p))
                time.sleep(0.5)
                assert vm.exec("cat /tmp/heard").stdout == "", "a host process reached the guest"
        """))
        pytester.runpytest_subprocess().assert_outcomes(passed=1)
    finally:
        echo.kill()
        echo.wait()
    assert _pasta_processes(smol_state) == [] and _leaked_fence_tables() == []


@pytest.mark.parametrize(("reserved", "ports"), [("", "32768-60999"), ("32768-40000,50000", "50001-60999"),
                                                  ("33000,60999", "33001-60998"), ("1-65535", None)])
def test_a_guests_flows_leave_from_the_hosts_ephemeral_ports_less_its_reserved_ones(
        tmp_path: Path, reserved: str, ports: str | None) -> None:
    from pytest_smolvm.backends.namespace.netrules import flow_ports
    from pytest_smolvm.errors import ProvisionError

    (tmp_path / "ip_local_port_range").write_text("32768\t60999\n")
    (tmp_path / "ip_local_reserved_ports").write_text(reserved + "\n")
    if ports is None:
        with pytest.raises(ProvisionError, match="ip_local_reserved_ports"):
            flow_ports(tmp_path)
    else:
        assert flow_ports(tmp_path) == ports
