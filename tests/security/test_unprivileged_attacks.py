"""The hostile-guest suite again as ``nobody``: guests in a user namespace, same boundaries.

The attacks run once, in one subprocess as nobody (test_guest_attacks.py, unchanged); each
attack is then its own test here, so a boundary that fails only in user-namespace mode says so
by name. A test the unprivileged run skips (its canary needs root, or no cgroup) is skipped here with its reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from xml.etree import ElementTree

import pytest

from tests.test_unprivileged import NOBODY, _userns_allowed

# The whole suite runs as nobody in the first test's fixture: more than one test's usual budget.
pytestmark = pytest.mark.timeout(900)
SUITE = Path(__file__).with_name("test_guest_attacks.py")
REPO = Path(__file__).parents[2]


def _attack_names() -> list[str]:
    return re.findall(r"^def (test_\w+)\(", SUITE.read_text(), flags=re.M)


@pytest.fixture(scope="module")
def unprivileged_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The outcomes, from the one run of this pytest session: under xdist the module's tests are
    spread over the workers, and each would otherwise run the whole suite as nobody again."""
    import json

    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # one dir for every worker of this run
    saved = shared / "unprivileged-outcomes.json"
    with FileLock(str(shared / "unprivileged-outcomes.lock")):
        if saved.exists():
            found: dict[str, str] = json.loads(saved.read_text())
            return found
        outcomes = _run_as_nobody()
        saved.write_text(json.dumps(outcomes))
        return outcomes


def _run_as_nobody() -> dict[str, str]:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another user for the run")
    if shutil.which("setpriv") is None:
        pytest.skip("needs util-linux setpriv")
    if not _userns_allowed():
        pytest.skip("unprivileged user namespaces are disabled on this host")
    home = Path(tempfile.mkdtemp(prefix="smolvm-sec-nobody-"))
    try:
        home.chmod(0o755)
        os.chown(home, NOBODY, NOBODY)
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "TMPDIR": str(home),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
               "PYTHONDONTWRITEBYTECODE": "1"}
        report = home / "report.xml"
        result = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-m", "pytest",
             "-p", "no:cacheprovider", "-p", "no:randomly", "-q", "--rootdir", str(REPO),
             "--basetemp", str(home / "t"), f"--junitxml={report}", str(SUITE)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        outcomes: dict[str, str] = {"__output__": result.stdout[-6000:] + result.stderr[-3000:]}
        if report.exists():
            for case in ElementTree.parse(report).getroot().iter("testcase"):
                kinds = {child.tag: child.get("message", "") for child in case}
                outcome = ("FAILED" if {"failure", "error"} & set(kinds) else
                           f"SKIPPED: {kinds['skipped']}" if "skipped" in kinds else "PASSED")
                outcomes[case.get("name", "")] = outcome
        return outcomes
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("attack", _attack_names())
def test_in_a_user_namespace(attack: str, unprivileged_outcomes: dict[str, str]) -> None:
    outcome = unprivileged_outcomes.get(attack)
    if outcome and outcome.startswith("SKIPPED"):
        pytest.skip(f"{attack} as nobody: {outcome}")
    assert outcome == "PASSED", f"{attack}: {outcome}\n{unprivileged_outcomes['__output__']}"
