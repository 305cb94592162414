"""What a new user meets on a first run: installs, messages, help texts and one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import tomllib  # type: ignore[import-not-found]  # 3.11+: mypy checks as python_version 3.10
from packaging.requirements import Requirement

from pytest_smolvm.backends.smol import probe
from pytest_smolvm.cli import build_parser
from pytest_smolvm.limits import LIMITS

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).with_name("tools.py")


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(r) for r in project["dependencies"]]
    found += [Requirement(r) for r in project["optional-dependencies"]["test"]]
    return [r for r in found if r.marker is None or r.marker.evaluate()]


def test_installed_dependencies_meet_the_bounds_the_code_needs() -> None:
    """The bounds in pyproject.toml are the APIs the code uses (trio 0.35 dropped cancellable=, say):
    an environment that breaks one fails here, by name, rather than deep in a test."""
    wrong = []
    for requirement in _requirements():
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            wrong.append(f"{requirement.name} is not installed (pyproject.toml needs {requirement})")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            wrong.append(f"{requirement.name} {installed} is installed; pyproject.toml needs {requirement}")
    assert not wrong, "pip install -U '.[test]':\n" + "\n".join(wrong)


@pytest.mark.parametrize("ci", ["", "true"], ids=["user", "ci"])
def test_a_missing_system_tool_skips_with_its_install_line_but_fails_in_ci(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str) -> None:
    pytester.makepyfile(tools=TOOLS.read_text())
    pytester.makepyfile(test_needs_tool="""
        import tools

        def test_needs():
            tools.require("no-such-tool-here", "a test of the tool check")
    """)
    monkeypatch.setenv("CI", ci)
    result = pytester.runpytest_subprocess("-rs", "-p", "no:smolvm")
    line = "*needs no-such-tool-here (a test of the tool check): apt-get install -y no-such-tool-here*"
    if ci:
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines([line + "CI must have it*"])
    else:
        result.assert_outcomes(skipped=1)
        result.stdout.fnmatch_lines(["SKIPPED*" + line])


def _help_texts() -> dict[str, str]:
    parser = build_parser()
    texts = {"pytest-smolvm": parser.format_help()}
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for name, sub in subparsers.choices.items():  # type: ignore[union-attr]
        texts[f"pytest-smolvm {name}"] = sub.format_help()
    return texts


def test_help_texts_are_plain_text(pytester: pytest.Pytester) -> None:
    """What users read in a terminal carries no reST markup (``like this``)."""
    from pytest_smolvm.plugin import hooks as plugin

    texts = _help_texts()
    help_text = pytester.runpytest_subprocess("--help").stdout.str()
    texts["pytest --help"] = help_text.split("pytest-smolvm: a fresh guest per test:", 1)[1].split("\n\n", 1)[0]
    texts["pytest --markers"] = "\n".join(line for line in pytester.runpytest_subprocess("--markers").outlines
                                          if "smol" in line)
    for fixture in (plugin.smol_vm, plugin.smol_vm_factory, plugin.smol_baseline_setup,
                    plugin.smol_episode):  # what pytest --fixtures prints
        texts[f"pytest --fixtures: {fixture.__name__}"] = fixture.__doc__ or ""
    assert all(texts.values())
    markup = {where: re.findall(r".{0,30}``.{0,30}", text) for where, text in texts.items()}
    assert not {where: found for where, found in markup.items() if found}


def test_the_readme_lists_every_command() -> None:
    readme = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"^pytest-smolvm (\w+)", readme, flags=re.M))
    assert listed == {name.split()[1] for name in _help_texts() if " " in name}, listed


TIMEOUTS = """
    import pytest

    def test_past_the_longest_wait(smol_vm):
        with pytest.raises(ValueError) as info:
            smol_vm.exec("echo ran > /tmp/ran", timeout=1e10)
        print("MESSAGE", info.value)
        assert smol_vm.exec("test -e /tmp/ran").exit_code == 1  # refused before it started

    def test_infinity_is_no_limit(smol_vm):
        assert smol_vm.exec("echo hi", timeout=float("inf")).stdout == "hi\\n"

    @pytest.mark.smol(image="./no/such/rootfs.tar")
    def test_bad_image_of_its_own(smol_vm):
        pass

    def test_later_tests_still_run(smol_vm):
        assert smol_vm.exec("true").exit_code == 0
"""


def test_bad_timeouts_and_a_bad_marker_image_error_that_test_only(pytester: pytest.Pytester,
                                                                  smol_state: Path) -> None:
    pytester.makepyfile(TIMEOUTS)
    result = pytester.runpytest_subprocess("-s", "-p", "no:randomly")
    result.assert_outcomes(passed=3, errors=1)
    out = result.stdout.str()
    assert "Interrupted" not in out and "OverflowError" not in out
    result.stdout.fnmatch_lines([
        f"*MESSAGE exec: timeout=10000000000.0: longer than the longest supported timeout ({LIMITS.max_timeout:.0f} s, "
        "about 24.8 days); use None for no limit",
    ])
    result.stdout.fnmatch_lines(["*ERROR at setup of test_bad_image_of_its_own*",
                                 "@pytest.mark.smol(image)=./no/such/rootfs.tar: no such file or directory"])
    # A marker timeout past the longest wait is wrong whatever the host: found at collection.
    pytester.makepyfile(test_marker="""
        import pytest

        @pytest.mark.smol(timeout=1e12)
        def test_marker_past_the_longest_wait(smol_vm):
            pass
    """)
    result = pytester.runpytest_subprocess("test_marker.py")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*ERROR collecting test_marker.py*", "test_marker_past_the_longest_wait: "
                                 "@pytest.mark.smol(timeout)=1000000000000.0: longer than the longest*"])


def test_a_bad_episode_count_is_said_once(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol_episodes(0)
        def test_eps(smol_episode):
            pass
    """)
    result = pytester.runpytest_subprocess()
    out = result.stdout.str()
    errors = out.split("short test summary info")[0]  # the summary's one-line copy may be cut or not
    assert errors.count("@pytest.mark.smol_episodes(n=0): n must be a positive integer") == 1, out
    assert "During handling of the above exception" not in out


DECISION = """
    import time
    from pytest_smolvm.backends import selection
    from pytest_smolvm.backends.base import ProbeResult

    def slow_probe():
        time.sleep(3)
        return ProbeResult(False, "KvmContext(KvmOpen(Error(13)))")

    selection._probe_smol = slow_probe
"""


def test_the_probe_is_not_counted_in_the_first_tests_duration(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makeconftest(DECISION)
    pytester.makepyfile("def test_first(smol_vm):\n    assert smol_vm.exec('true').exit_code == 0\n")
    results = pytester.path / "results.jsonl"
    result = pytester.runpytest_subprocess("--junitxml=junit.xml", f"--smol-results={results}", "-rP")
    result.assert_outcomes(passed=1)
    junit_time = float(re.findall(r'<testcase [^>]*time="([0-9.]+)"', (pytester.path / "junit.xml").read_text())[0])
    setup = json.loads(results.read_text().splitlines()[0])["durations"]["setup"]
    assert junit_time < 2.5 and setup < 2.5, (junit_time, setup)
    result.stdout.fnmatch_lines(["*of this setup went to the run's one-time backend decision*"])


def test_doctor_exit_codes_have_one_meaning_each(tmp_path: Path) -> None:
    """This host: no microVM boots (probe), the namespace backend runs guests: 0, or 3 if a microVM is required."""
    verdict = probe.probe()
    if verdict.available:
        pytest.skip("a microVM boots on this host: test_doctor covers that")
    # The probe already said no microVM boots here: a short boot limit gives the same verdict
    # (doctor re-probes on every run) without a full boot stall per run.
    env = {"PYTEST_SMOLVM_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTEST_SMOLVM_PROBE_TIMEOUT": "5"}
    runs = {flag: subprocess.run([sys.executable, "-m", "pytest_smolvm.cli", "doctor", *flag], capture_output=True,
                                 text=True, timeout=probe.probe_timeout() + probe.DELETE_TIMEOUT + 60,
                                 env={**env, "PYTHONPATH": str(ROOT)})
            for flag in ((), ("--require-microvm",))}
    plain, strict = runs[()], runs[("--require-microvm",)]
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "the namespace backend runs them" in plain.stdout
    assert strict.returncode == 3, strict.stdout + strict.stderr
