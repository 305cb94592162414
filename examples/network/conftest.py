"""A stand-in package index for the network example: nothing here reaches the internet.

A network namespace with one HTTP server, joined to the host by a veth pair on a private
subnet of its own (one per xdist worker, so parallel runs do not collide). Needs root and
`ip` (iproute2), as the namespace backend's NAT does (`apt-get install -y passt nftables iproute2`).
"""

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def package_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    search = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"  # nft lives in sbin
    missing = [tool for tool in ("ip", "pasta", "nft") if shutil.which(tool, path=search) is None]
    if missing or os.geteuid() != 0:
        why = f"{' and '.join(missing)} missing" if missing else "not root"
        if os.environ.get("CI"):  # .ci/run installs them and runs as root: a skip there hides a gap
            pytest.fail(f"the network example needs root, ip, pasta and nft ({why})")
        pytest.skip(f"the network example needs root, ip, pasta and nft ({why}): "
                    "apt-get install -y passt nftables iproute2")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw99")
    subnet = f"10.232.{int(worker.removeprefix('gw') or 99) % 200 + 1}"
    served = tmp_path_factory.mktemp("index")
    (served / "pkg-1.0.tar").write_text("the package's contents\n")
    tag = uuid.uuid4().hex[:6]
    ns, veth = f"sx-index-{tag}", f"sx{tag}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    server = None
    try:
        for cmd in (["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns],
                    ["ip", "addr", "add", f"{subnet}.1/24", "dev", veth], ["ip", "link", "set", veth, "up"],
                    ["ip", "-n", ns, "addr", "add", f"{subnet}.2/24", "dev", "eth0"],
                    ["ip", "-n", ns, "link", "set", "eth0", "up"]):
            subprocess.run(cmd, check=True)
        server = subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-m", "http.server", "8080",
                                   "--bind", f"{subnet}.2", "--directory", str(served)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        yield f"{subnet}.2"
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", veth], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], check=False)

