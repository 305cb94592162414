"""Images' user-management tools run in a namespace guest under its default confinement.

shadow's ``useradd``/``userdel`` (what Debian's ``adduser`` runs) abort unless opening the audit
netlink socket fails as "no audit in this kernel" (EINVAL): the guest's seccomp filter answers so.
No registry is reachable from CI, so the guest's root is a minimal Debian-made rootfs: this
host's own shadow tools and the libraries ``ldd`` names (a Debian or Ubuntu host; CI is one).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from pytest_smolvm import Session
from tests import tools

TOOLS = ("useradd", "userdel", "id")


def shadow_rootfs(root: Path) -> dict[str, str]:
    """A rootfs with the host's useradd, userdel and id, their libraries, and root's account files;
    the tools' paths (the same inside)."""
    found = {tool: tools.require(tool, "shadow's user tools, copied into a guest rootfs") for tool in TOOLS}
    paths = list(found.values())
    shell = os.path.realpath("/bin/sh")  # a root filesystem has one (the baseline check refuses a tree without)
    libraries = subprocess.run(["ldd", *paths, shell], capture_output=True, text=True, check=True).stdout
    (root / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(shell, root / "bin" / "sh")
    assert "libaudit" in libraries, f"this host's useradd does not use libaudit; nothing to test:\n{libraries}"
    for path in {*paths, *re.findall(r"(/\S+) \(0x", libraries)}:
        dest = root / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(path), dest)
    etc = root / "etc"
    for d in ("etc/skel", "etc/default", "root", "home", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2("/etc/login.defs", etc / "login.defs")
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (etc / "group").write_text("root:x:0:\n")
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (etc / "gshadow").write_text("root:*::\n")
    return found


def test_useradd_and_userdel_run_in_a_guest(tmp_path: Path, smol_state: Path) -> None:
    path = shadow_rootfs(tmp_path / "rootfs")
    with Session(baseline=str(tmp_path / "rootfs"), backend="namespace") as session:
        vm = session.create("user-tools")
        added = vm.exec([path["useradd"], "-m", "agent"])
        assert added.exit_code == 0, added.stderr  # before: "Cannot open audit interface - aborting."
        assert vm.exec([path["id"], "-un", "agent"]).stdout == "agent\n"
        removed = vm.exec([path["userdel"], "-r", "agent"])
        assert removed.exit_code == 0, removed.stderr
        assert vm.exec([path["id"], "agent"]).exit_code == 1
