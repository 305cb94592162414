"""Options, ini twins and the smol marker: precedence and one-line usage errors."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

PASSING = "def test_ok(smol_vm):\n    assert smol_vm.exec('true').exit_code == 0\n"


def one_line_usage_error(result: pytest.RunResult, *needles: str) -> None:
    err = result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, err
    assert "Traceback" not in err + result.stdout.str()
    error_lines = [line for line in err.splitlines() if line.startswith("ERROR:")]
    assert len(error_lines) == 1, err
    for needle in needles:
        assert needle in error_lines[0], error_lines[0]


def assert_one_line_setup_error(result: pytest.RunResult, *needles: str) -> None:
    """The ERROR block's body is exactly one line, and it says what is wrong."""
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "ERROR at setup of" in line)
    body = []
    for line in lines[start + 1:]:
        if line.startswith(("=", "_", "----")):  # the next block (not an option like --smol-...)
            break
        body.append(line)
    assert len(body) == 1, "\n".join(lines)
    for needle in needles:
        assert needle in body[0], body[0]


@pytest.mark.parametrize(("args", "needles"), [
    (["--smol-backend=bogus"], ["--smol-backend=bogus", "unknown backend"]),
    (["--smol-keep=sometimes"], ["--smol-keep=sometimes", "never, failed, always"]),
    (["--smol-target=mars"], ["--smol-target=mars", "local, cloud"]),
    (["--smol-max-vms=0"], ["--smol-max-vms=0", "positive integer"]),
    (["--smol-max-vms=lots"], ["--smol-max-vms=lots", "positive integer"]),
    (["--smol-baseline=./no/such/rootfs.tar"], ["--smol-baseline=./no/such/rootfs.tar", "no such file"]),
    (["--smol-baseline=/definitely/missing"], ["--smol-baseline=/definitely/missing", "no such file"]),
    (["--smol-artifacts=/etc/passwd"], ["--smol-artifacts=/etc/passwd: it is not a directory"]),
    (["--smol-artifacts=/etc/passwd/art"], ["--smol-artifacts=/etc/passwd/art: /etc/passwd is not a directory"]),
    (["--smol-output-limit=lots"], ["--smol-output-limit=lots", "byte count"]),
    (["--smol-output-limit=0"], ["--smol-output-limit=0", "positive"]),
    (["--smol-user=a:b"], ["--smol-user", "user name or uid"]),
    # empty values, as an unset shell variable gives them: an error, never a silent default
    (["--smol-baseline="], ["--smol-baseline", "empty value"]),
    (["--smol-output-limit="], ["--smol-output-limit=", "byte count"]),
])
def test_bad_option_is_one_line_usage_error(pytester: pytest.Pytester, smol_state: Path,
                                            args: list[str], needles: list[str]) -> None:
    pytester.makepyfile(PASSING)
    one_line_usage_error(pytester.runpytest_subprocess(*args), *needles)


@pytest.mark.parametrize(("ini", "needles"), [("smol_keep = sometimes", ["smol_keep=sometimes"]),
                                              ("smol_offline = maybe", ["smol_offline", "maybe"])])
def test_bad_ini_value_names_the_ini_key(pytester: pytest.Pytester, smol_state: Path, ini: str,
                                         needles: list[str]) -> None:
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(PASSING)
    result = pytester.runpytest_subprocess()
    if "smol_offline" in ini and "smol_offline" not in result.stderr.str():
        needles = ["invalid truth value 'maybe'"]  # pytest 9.2+ refuses a bad bool ini itself, in one line
    one_line_usage_error(result, *needles)


@pytest.mark.parametrize(("variable", "value", "needle"), [
    # the cache dir failed the first guest's setup with a traceback (FileExistsError, 9 frames)
    ("PYTEST_SMOLVM_CACHE_DIR", "/etc/passwd", "$PYTEST_SMOLVM_CACHE_DIR=/etc/passwd: it is not a directory"),
    ("PYTEST_SMOLVM_STATE_DIR", "/etc/passwd", "$PYTEST_SMOLVM_STATE_DIR=/etc/passwd: it is not a directory"),
    # accepted silently by a run that pulls nothing; the option's twin was refused at startup
    ("PYTEST_SMOLVM_REGISTRY_AUTH", "no-colon-here", "$PYTEST_SMOLVM_REGISTRY_AUTH: expected [REGISTRY=]USER:PASSWORD"),
])
def test_a_bad_environment_variable_is_a_one_line_usage_error(
        pytester: pytest.Pytester, smol_state: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str,
        needle: str) -> None:
    pytester.makepyfile(PASSING)
    monkeypatch.setenv(variable, value)
    one_line_usage_error(pytester.runpytest_subprocess(), needle)


def test_cli_overrides_ini(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makeini("[pytest]\nsmol_backend = bogus\n")
    pytester.makepyfile(PASSING)
    pytester.runpytest_subprocess("--smol-backend=namespace").assert_outcomes(passed=1)


def test_ini_baseline_is_relative_to_the_ini_file(pytester: pytest.Pytester, smol_state: Path,
                                                  shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unpacked = next(shared_cache.glob("baselines/*/rootfs"), None)
    if unpacked is None:  # first test of the session: let a run unpack the bundled rootfs
        pytester.makepyfile(PASSING)
        pytester.runpytest_subprocess().assert_outcomes(passed=1)
        unpacked = next(shared_cache.glob("baselines/*/rootfs"))
    shutil.copytree(unpacked, pytester.path / "rootfs-dir", symlinks=True)
    pytester.makeini("[pytest]\nsmol_baseline = rootfs-dir\n")
    sub = pytester.mkdir("sub")
    (sub / "test_sub.py").write_text(PASSING)
    monkeypatch.chdir(sub)
    result = pytester.runpytest_subprocess("test_sub.py")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["smolvm: baseline rootfs-dir (rootfs-dir, sha256:*)"])

    pytester.makeini("[pytest]\nsmol_baseline = ./missing-rootfs\n")
    one_line_usage_error(pytester.runpytest_subprocess("test_sub.py"), "smol_baseline=./missing-rootfs",
                         "no such file")


def test_marker_is_registered_for_strict_markers(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol(env={"A": "1"})
        def test_marked(smol_vm):
            assert smol_vm.exec("echo $A").stdout == "1\\n"
    """)
    result = pytester.runpytest_subprocess("--strict-markers", "-W", "error::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=1)
    assert "smol(image=None" in pytester.runpytest_subprocess("--markers").stdout.str()


@pytest.mark.parametrize(("marker", "needle"), [
    ("cpu=2", "unknown keyword 'cpu'"),
    ("timeout=-1", "timeout"),
    ("timeout=0", "timeout"),
    ("memory_mb=1.5", "memory_mb"),
    ("memory_mb=2", "memory_mb=2): expected at least 16"),
    ("cpus=0.001", "cpus=0.001): expected at least 0.01"),
    ("cpus=1e9", "cpus=1000000000.0): expected at most 8192"),
    ("network='yes'", "network"),
    ("env={'A': 1}", "env"),
    ("allow_hosts='example.com'", "allow_hosts"),
    ("allow_hosts=['10.0.0.0/33']", "allow_hosts=...): '10.0.0.0/33' does not appear to be"),
    # each was looked up in DNS when the guest was made: "does not resolve", a provisioning error
    ("allow_hosts=['example.com:443']", "allow_hosts=...): 'example.com:443' is not a host name, an IP address"),
    ("allow_hosts=['exa\\0mple.com']", "allow_hosts=...): 'exa\\x00mple.com' is not a host name"),
    ("user=''", "user"),
    ("user=True", "user"),
    ("output_limit=-5", "output_limit"),
    ("output_limit='many'", "output_limit"),
    ("output_limit=''", "output_limit"),
])
def test_bad_marker_is_a_one_line_collection_error(pytester: pytest.Pytester, smol_state: Path,
                                                   marker: str, needle: str) -> None:
    """Found when the module is collected, before any guest: once for a parametrized test,
    and the run stops there as it does for pytest's own unknown marker under --strict-markers."""
    pytester.makepyfile(f"""
        import pytest

        @pytest.mark.smol({marker})
        @pytest.mark.parametrize("case", [1, 2])
        def test_marked(smol_vm, case):
            pass

        def test_plain():
            pass
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=1)
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "ERROR collecting" in line)
    assert lines[start + 1].startswith("test_marked: @pytest.mark.smol") and needle in lines[start + 1], lines
    assert lines[start + 2].startswith("="), "\n".join(lines)  # one line
    assert "smolvm: backend" not in result.stdout.str()  # no guest, so no backend decision was made


def test_a_marker_image_that_names_no_baseline_is_a_one_line_setup_error(pytester: pytest.Pytester,
                                                                         smol_state: Path) -> None:
    """Resolving an image can pull: it waits for the test's guest, and errors that test only."""
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol(image='./no-such-rootfs')
        def test_marked(smol_vm):
            pass

        def test_plain():
            pass
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=1, passed=1)
    assert_one_line_setup_error(result, "no such file")


def test_marker_precedence_closest_wins_per_keyword(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        pytestmark = pytest.mark.smol(env={"LEVEL": "module", "M": "m"}, timeout=30)

        @pytest.mark.smol(env={"LEVEL": "class", "C": "c"})
        class TestLevels:
            @pytest.mark.smol(env={"LEVEL": "function"})
            def test_env(self, smol_vm):
                out = smol_vm.exec("echo $LEVEL $M $C").stdout
                assert out == "function m c\\n"
                assert smol_vm.default_timeout == 30

        def test_factory_keywords_win(smol_vm_factory):
            vm = smol_vm_factory(env={"LEVEL": "factory"})
            assert vm.exec("echo $LEVEL $M").stdout == "factory m\\n"
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=2)


def test_default_user_and_output_limit_from_ini_option_and_marker(pytester: pytest.Pytester,
                                                                   smol_state: Path) -> None:
    pytester.makeini("[pytest]\nsmol_user = nobody\nsmol_output_limit = 2k\n")
    pytester.makepyfile("""
        import pytest

        def test_ini(smol_vm):
            assert smol_vm.exec("id -un").stdout == "nobody\\n"
            with pytest.raises(PermissionError):
                smol_vm.write_file("/etc/owned-by-root", "x")  # file operations run as the user too
            assert smol_vm.exec("head -c 5000 /dev/zero").truncated == ("stdout",)

        @pytest.mark.smol(user="root", output_limit=10000)
        def test_marker_wins(smol_vm):
            assert smol_vm.exec("id -u").stdout == "0\\n"
            smol_vm.write_file("/etc/owned-by-root", "x")
            assert smol_vm.exec("head -c 5000 /dev/zero").truncated == ()

        def test_factory_keyword(smol_vm_factory):
            assert smol_vm_factory(user=0).exec("id -u").stdout == "0\\n"
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=3)
    result = pytester.runpytest_subprocess("--smol-user=root", "-k", "test_ini")
    result.assert_outcomes(failed=1)  # the command line beats the ini: now root runs test_ini
    result.stdout.fnmatch_lines(["*id -un*"])


def test_an_output_cut_at_the_limit_is_said_once_per_test_in_the_terminal(pytester: pytest.Pytester,
                                                                          smol_state: Path) -> None:
    """A passing test's transcript is never shown: the cut would pass unsaid without this line."""
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol(output_limit="64k")
        def test_cut_twice(smol_vm):
            assert smol_vm.exec("head -c 300000 /dev/zero").truncated == ("stdout",)
            assert smol_vm.exec("head -c 300000 /dev/zero >&2").truncated == ("stderr",)

        def test_whole(smol_vm):
            assert smol_vm.exec("head -c 300000 /dev/zero").truncated == ()
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=2)
    text = result.stdout.str()
    assert text.count("was cut at the output limit") == 1, text
    result.stdout.fnmatch_lines(["*test_cut_twice*", "*smolvm: exec 'head -c 300000 /dev/zero' (and 1 more): its "
                                 "stdout was cut at the output limit, 64 KiB*--smol-output-limit*output_limit=*"])
    assert "test_whole" not in text.split("warnings summary", 1)[-1], text


def test_unknown_factory_keyword(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        def test_factory(smol_vm_factory):
            smol_vm_factory(ram=4)
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*smol_vm_factory: unknown keyword 'ram'*"])


def test_a_factory_image_that_names_no_baseline_names_the_factory(pytester: pytest.Pytester,
                                                                 smol_state: Path) -> None:
    pytester.makepyfile("""
        def test_factory(smol_vm_factory):
            smol_vm_factory(image="/nonexistent/x.tar")
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*smol_vm_factory(image)=/nonexistent/x.tar*"])
    assert "pytest.mark.smol" not in result.stdout.str()


def test_the_summary_says_what_ran_and_the_header_says_nothing(pytester: pytest.Pytester,
                                                                smol_state: Path) -> None:
    pytester.makepyfile(PASSING)
    result = pytester.runpytest_subprocess("--smol-backend=auto")
    result.assert_outcomes(passed=1)
    header = result.stdout.str().split("collected", 1)[0].replace("plugins: smolvm-", "plugins: ")
    assert "smolvm" not in header  # nothing is decided before a test asks for a guest
    result.stdout.fnmatch_lines([
        "*= smolvm =*",
        "smolvm: backend namespace (isolation: namespace; no microVM boots here: *; see 'pytest-smolvm doctor'; "
        "namespace guests share the host kernel)",
        "smolvm: baseline bundled alpine (bundled, sha256:*)",
        "smolvm: limits: *",
    ])
    # A sentence, not the engine's raw error (doctor prints that): short, and the same every run.
    backend_line = next(line for line in result.outlines if line.startswith("smolvm: backend "))
    assert len(backend_line) < 200 and "[SMOLVM_ERROR]" not in backend_line and "libkrun" not in backend_line


def test_smol_backend_where_no_microvm_boots_is_one_error_with_the_probes_reason(
        pytester: pytest.Pytester, smol_state: Path) -> None:
    from pytest_smolvm.backends.smol.probe import probe  # the same cached probe the plugin uses

    verdict = probe()
    pytester.makepyfile(PASSING + PASSING.replace("test_ok", "test_ok_too"))
    started = time.monotonic()
    result = pytester.runpytest_subprocess("--smol-backend=smol")
    if verdict.available:
        result.assert_outcomes(passed=2)
        return
    # Decided at the first guest request (not at startup: a run without guest tests must not
    # probe): that test errors with the reason, and the run stops there.
    result.assert_outcomes(errors=1)
    assert_one_line_setup_error(result, "--smol-backend=smol: no microVM boots on this host",
                                verdict.reason[:60], "pytest-smolvm doctor")
    assert time.monotonic() - started < 60


def test_the_commands_usage_errors_name_what_is_missing_or_wrong(cli: Any) -> None:
    shell = cli("shell")  # the command to run in the guest is optional: only the name is missing
    assert shell.returncode == 2
    assert shell.stderr.splitlines()[-1] == "pytest-smolvm shell: error: the following arguments are required: name"
    reap = cli("reap", "no-such-guest")  # it said "nothing to reap" and exited 0
    assert reap.returncode == 2
    assert reap.stderr.splitlines() == ["pytest-smolvm reap: no guest named 'no-such-guest' (see 'pytest-smolvm ls')"]
    for command, usage in (("reap", "usage: pytest-smolvm reap [-h] [--kept] [names ...]"),
                           ("ls", "usage: pytest-smolvm ls [-h]")):
        wrong = cli(command, "--bogus")  # it showed the top-level usage, which names no option of the command
        assert wrong.returncode == 2
        assert wrong.stderr.splitlines() == [usage, f"pytest-smolvm {command}: error: unrecognized arguments: --bogus"]
    pull = cli("pull", "")  # an empty reference reads as one, quoted as a shell would take it
    assert pull.returncode == 2
    assert pull.stderr.splitlines() == ["pytest-smolvm pull '': not an image reference (names are lowercase "
                                        "letters, digits and . _ - separated by /)"]
