"""A guest-written tree is never collected by pytest: not the cache's baselines, not a guest's scratch.

Where a user keeps pytest-smolvm's cache or state dir inside the project (``PYTEST_SMOLVM_CACHE_DIR=
smolvm-cache``, a directory for CI to save between runs), pytest's collection walks into it. A warm
baseline's rootfs there is a tree a guest wrote; a ``conftest.py`` or ``test_*.py`` in it would be
imported by the host's pytest: the guest's code, run on the host, as the user.
"""

from __future__ import annotations

from pathlib import Path

import pytest

PLANTING_CONFTEST = """
def pytest_smolvm_prepare_baseline(vm, config):
    code = "import os\\nopen(os.environ['SMOLVM_PLANTED_CANARY'], 'a').write('ran on the host\\\\n')\\n"
    vm.exec("mkdir -p /opt/planted", check=True)
    vm.write_file("/opt/planted/conftest.py", code)
    vm.write_file("/opt/planted/test_planted.py", code + "def test_planted():\\n    pass\\n")
"""
USES_A_GUEST = "def test_uses(smol_vm):\n    assert smol_vm.exec('true').exit_code == 0\n"


def test_14_a_warm_baseline_cached_in_the_project_is_never_collected(
        pytester: pytest.Pytester, smol_state: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    monkeypatch.setenv("SMOLVM_PLANTED_CANARY", str(canary))
    cache = pytester.mkdir("smolvm-cache")
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(cache))
    pytester.makeconftest(PLANTING_CONFTEST)
    pytester.makepyfile(test_uses=USES_A_GUEST)
    pytester.runpytest_subprocess("--smol-backend=namespace").assert_outcomes(passed=1)
    assert list(cache.rglob("test_planted.py")), "the attack is not in place: the export lacks the planted file"

    again = pytester.runpytest_subprocess("--smol-backend=namespace")
    assert not canary.exists(), f"the guest's code ran on the host:\n{again.stdout.str()}"
    again.assert_outcomes(passed=1)


@pytest.mark.parametrize("variable", ["PYTEST_SMOLVM_CACHE_DIR", "PYTEST_SMOLVM_STATE_DIR"])
def test_14b_the_plugins_own_dirs_are_never_collected(pytester: pytest.Pytester, smol_state: Path,
                                                      monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    # A guest's scratch (its upper layer) lives in the state dir: a stand-in for one, planted.
    own = pytester.mkdir("smolvm-dir")
    monkeypatch.setenv(variable, "smolvm-dir")  # relative, as a user would write it
    planted = own / "scratch" / "guest" / "upper" / "opt"
    planted.mkdir(parents=True)
    (planted / "test_planted.py").write_text("def test_planted():\n    pass\n")
    pytester.makepyfile(test_mine="def test_mine():\n    pass\n")
    result = pytester.runpytest_subprocess("--collect-only", "-q")
    assert "test_planted" not in result.stdout.str()
    result.stdout.fnmatch_lines(["test_mine.py::test_mine", "1 test collected*"])


COLLECTS_WORKSPACE = """
def pytest_smolvm_collect_artifacts(item, vm):
    return ["/workspace"]
"""
PLANTING_TEST = """
CODE = "import os\\nopen(os.environ['SMOLVM_PLANTED_CANARY'], 'a').write('ran on the host\\\\n')\\n"

def test_fails_with_planted_files(smol_vm):
    smol_vm.exec("mkdir -p /workspace/deep", check=True)
    smol_vm.write_file("/workspace/conftest.py", CODE)
    smol_vm.write_file("/workspace/deep/test_planted.py", CODE + "def test_planted():\\n    pass\\n")
    assert False
"""


def test_14c_guest_files_collected_as_artifacts_are_never_collected_by_a_later_run(
        pytester: pytest.Pytester, smol_state: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    monkeypatch.setenv("SMOLVM_PLANTED_CANARY", str(canary))
    pytester.makeconftest(COLLECTS_WORKSPACE)
    pytester.makepyfile(test_plants=PLANTING_TEST)
    pytester.runpytest_subprocess("--smol-backend=namespace", "--smol-artifacts=artifacts").assert_outcomes(failed=1)
    copies = list((pytester.path / "artifacts").rglob("test_planted.py"))
    assert copies and all("files" in copy.parts for copy in copies), "the attack is not in place"

    for extra in (["--smol-artifacts=artifacts"], []):  # this run's dir, and a later run that names none
        again = pytester.runpytest_subprocess("--smol-backend=namespace", "--collect-only", "-q", *extra)
        assert not canary.exists(), f"the guest's code ran on the host:\n{again.stdout.str()}"
        assert "test_planted" not in again.stdout.str()
        again.stdout.fnmatch_lines(["test_plants.py::test_fails_with_planted_files", "1 test collected*"])
