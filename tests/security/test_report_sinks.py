"""Guest text is inert in every report sink: a guest's escape sequences act on no terminal."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_smolvm.inert import inert

# An OSC 52 clipboard write, a clear screen, a C1 CSI (0x9b) and a right-to-left override
# (U+202E): what a hostile guest prints.
ATTACK = r"printf '\033]52;c;c3RlYWw=\a\033[2J\302\23331mred\342\200\256der\n'"
RAW = ("\x1b]52;", "\x1b[2J", "\x9b31m", "\u202e")

TESTS = f"""
def test_fails_with_guest_output(smol_vm):
    smol_vm.exec({ATTACK!r})
    assert False

def test_check_raises_with_guest_output(smol_vm):
    smol_vm.exec({ATTACK!r} + "; exit 3", check=True)

def test_plumbing_error_quotes_a_replaced_tar(smol_vm, tmp_path):
    # The guest's own tar is the guest's: its stderr becomes the plugin's error message.
    smol_vm.exec("mkdir -p /t && rm -f /bin/tar /usr/bin/tar", check=True)
    smol_vm.write_file("/bin/tar", "#!/bin/sh\\n" + {ATTACK!r} + " >&2\\nexit 2\\n", mode=0o755)
    smol_vm.copy_out("/t", tmp_path / "out")

def test_assertion_message_quotes_guest_output(smol_vm):
    r = smol_vm.exec({ATTACK!r})
    assert r.exit_code == 1, r.stdout

def test_prints_guest_output(smol_vm):
    print(smol_vm.exec({ATTACK!r}).stdout)
    assert False
"""


# Collected files of a failed test: the replaced tar fails this copy too, into notes.txt.
CONFTEST = """
def pytest_smolvm_collect_artifacts(item, vm):
    return ["/t"] if "replaced_tar" in item.name else []
"""


def test_escapes_reach_no_sink_raw(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(TESTS)
    pytester.makeconftest(CONFTEST)
    artifacts = pytester.path / "artifacts"
    result = pytester.runpytest_subprocess("--junitxml=junit.xml", "--html=report.html", "--self-contained-html",
                                           f"--smol-artifacts={artifacts}", "-p", "no:randomly")
    result.assert_outcomes(failed=5)
    sinks = {"terminal": result.stdout.str() + result.stderr.str(),
             "junit": (pytester.path / "junit.xml").read_text(),
             "html": (pytester.path / "report.html").read_text()}
    sinks |= {str(p.relative_to(artifacts)): p.read_text() for p in artifacts.rglob("*.txt")}
    assert len(sinks) >= 5, sorted(sinks)  # the three reports and each test's transcript files
    raw = {name: [seq for seq in RAW if seq in text] for name, text in sinks.items()}
    assert not {name: found for name, found in raw.items() if found}
    # ... and still readable: the escapes are shown, in the failure and the check's message
    assert sinks["terminal"].count("\\x1b]52;c;c3RlYWw=\\x07\\x1b[2J\\x9b31mred\\u202eder") >= 5


def test_every_plugin_error_message_is_inert_wherever_it_is_built() -> None:
    """The first wall on its own (the report pass above would hide its absence in the terminal):
    an error quoting a guest, as a replaced tar's stderr is quoted, carries no live sequence."""
    from pytest_smolvm.errors import ExecError, GuestError, ProvisionError, UnsafeArchive

    attack = "\x1b]52;c;c3RlYWw=\x07\x1b[2J\x9b31mred\u202eder"
    for error in (GuestError(attack), UnsafeArchive(attack), ExecError(attack, None), ProvisionError(attack)):
        assert not [seq for seq in RAW if seq in str(error)], type(error)
        assert "\\x1b]52;" in str(error)


def test_inert_keeps_newlines_and_tabs_and_escapes_every_other_control() -> None:
    assert inert("a\tb\nc") == "a\tb\nc"
    assert inert("\x1b[2J\r\x00\x7f\x9b") == "\\x1b[2J\\x0d\\x00\\x7f\\x9b"
    assert inert("naïve ✓") == "naïve ✓"
    assert inert("a\u202eb\u2066c") == "a\\u202eb\\u2066c"
