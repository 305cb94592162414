"""System tools some tests need beyond the Python packages, and what a missing one means.

A user who runs the README's test command on a fresh machine has none of them: those tests skip
and say the one command that installs the tool. CI (``CI`` set, as ``.ci/run`` runs) installs them
all, so there a missing tool is a failure: a skip there would hide a broken install step.
"""

from __future__ import annotations

import os
import shutil

import pytest

# tool -> the Debian package that ships it (what .ci/run installs)
PACKAGES = {
    "docker-registry": "docker-registry",  # the CNCF distribution registry, the tests' OCI registry
    "htpasswd": "apache2-utils",  # the private registry's password file
    "gcc": "gcc libc6-dev",  # the hostile-guest suite's static syscall probe
    "setpriv": "util-linux",  # user-namespace mode runs as an unprivileged user
    "tar": "tar",  # GNU tar writes the sparse members the extractor tests read
    "useradd": "passwd",  # shadow's user tools, run in a guest (tests/backends/test_user_tools.py)
    "userdel": "passwd",
    "id": "coreutils",
    "chromium": "chromium",  # the results report is opened in a real, headless browser
    "debootstrap": "debootstrap",  # a Debian baseline for Inspect's checks (tests/debian.py)
    "pasta": "passt",  # a guest with the network on: its NAT (and nft for its fence, ip for its routes)
    "nft": "nftables",
    "ip": "iproute2",
    "mkfs.ext4": "e2fsprogs",  # the empty ext4 template a guest's disk image is copied from
    "root": "(run the tests as root)",
}
SBIN = ("/usr/sbin", "/sbin")  # nft and ip live here, often off a normal user's PATH


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def install_line(tool: str) -> str:
    return f"apt-get install -y {PACKAGES.get(tool, tool)}"


def missing(tool: str, why: str) -> None:
    """Skip the calling test (fail it in CI) because ``tool`` cannot be used; ``why`` says what for."""
    message = f"needs {tool} ({why}): {install_line(tool)}"
    if in_ci():
        pytest.fail(f"{message} -- .ci/run installs it, so CI must have it")
    pytest.skip(message)


def require(tool: str, why: str) -> str:
    """The path of ``tool``, or skip the calling test (fail it in CI) with the install line."""
    path = shutil.which(tool) or shutil.which(tool, path=os.pathsep.join(SBIN))
    if path is None:
        missing(tool, why)
        raise AssertionError("unreachable")  # pytest.skip and pytest.fail raise
    return path


def require_ext4_disks(userns: bool) -> None:
    """Skip the calling test unless this host gives namespace guests ext4 disks (mkfs.ext4 is
    installed by .ci/run: missing, it fails the test in CI)."""
    from pytest_smolvm.backends.namespace import disk

    require("mkfs.ext4", "a guest's disk image is made from an empty ext4 template")
    why = disk.unavailable(userns, disk.images_dir())
    if why:
        pytest.skip(f"no ext4 guest disks on this host: {why}")


def require_root(why: str) -> None:
    """Skip the calling test (fail it in CI) unless it runs as root."""
    if os.geteuid() != 0:
        missing("root", why)
