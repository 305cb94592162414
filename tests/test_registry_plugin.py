"""Registry baselines as users run them: pytest with --smol-baseline=IMAGE, -n 2, and 'pytest-smolvm pull'."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.registry_fixtures import Images, no_partial_files
from tests.registry_server import ProxyConfig, proxy

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _layer_gets(images: Images, since: int) -> list[str]:
    return [p for m, p, _ in images.registry.requests()[since:] if m == "GET" and "/blobs/" in p]


def test_the_example_suite_on_a_registry_image_pulls_once(pytester: pytest.Pytester, smol_state: Path,
                                                          oci_registry: Images, oci_cache: Path) -> None:
    shutil.copytree(EXAMPLES, pytester.path / "examples")
    image = f"{oci_registry.host}/acc/alpine:1"
    mark = len(oci_registry.registry.requests())
    serial = pytester.runpytest_subprocess("examples", "--smol-backend=namespace", f"--smol-baseline={image}",
                                           "--smol-results=serial.jsonl")
    outcomes = serial.parseoutcomes()
    assert outcomes.get("passed", 0) >= 10 and set(outcomes) <= {"passed", "warnings"}, serial.stdout.str()
    serial.stdout.fnmatch_lines([f"smolvm: baseline {image} (registry, {oci_registry.alpine})"])
    pulled = _layer_gets(oci_registry, mark)
    assert len(pulled) == len(set(pulled)) == 2, pulled  # config and layer, each once

    mark = len(oci_registry.registry.requests())
    parallel = pytester.runpytest_subprocess("examples", "-n", "2", "--smol-backend=namespace",
                                             f"--smol-baseline={image}", "--smol-results=n2.jsonl")
    outcomes = parallel.parseoutcomes()
    assert outcomes.get("passed", 0) >= 10 and set(outcomes) <= {"passed", "warnings"}, parallel.stdout.str()
    assert _layer_gets(oci_registry, mark) == []  # the second run makes no layer request
    manifests = [p for _, p, _ in oci_registry.registry.requests()[mark:]]
    assert manifests == ["/v2/acc/alpine/manifests/1"]  # the tag, once for the whole -n 2 run
    for results in ("serial.jsonl", "n2.jsonl"):
        lines: list[dict[str, Any]] = [json.loads(x) for x in (pytester.path / results).read_text().splitlines()]
        digests = {line.get("baseline_digest") for line in lines if line.get("baseline_digest")}
        assert digests == {oci_registry.alpine}, results


def test_the_image_config_reaches_the_guest(pytester: pytest.Pytester, smol_state: Path,
                                            oci_registry: Images, oci_cache: Path) -> None:
    pytester.makepyfile(test_config=f"""
        import pytest

        @pytest.mark.smol(image="{oci_registry.host}/acc/layers:1")
        def test_env_and_workdir(smol_vm):
            result = smol_vm.exec("echo $GREETING; pwd; cat hello.txt; id -un")
            assert result.stdout == "hello from the image\\n/srv/app\\nfrom layer two\\nnobody\\n"  # User too
            assert smol_vm.exec("id -un", user="root").stdout == "root\\n"

        def test_the_default_baseline_is_untouched(smol_vm):
            assert smol_vm.exec("echo $GREETING; pwd; id -un").stdout == "\\n/\\nroot\\n"
    """)
    result = pytester.runpytest_subprocess("--smol-backend=namespace", "-n", "2")
    result.assert_outcomes(passed=2)


def _stops_with_one_line(result: pytest.RunResult, message: str) -> None:
    """The plan is made at the first guest: its error is that test's one-line setup error, and the run stops."""
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.INTERRUPTED, out
    assert message in result.stdout.lines, out  # the error report: the message alone on its line
    assert "Traceback" not in out and "Error:" not in out.replace("ERROR at setup", ""), out


def test_pull_errors_are_one_line_errors(pytester: pytest.Pytester, smol_state: Path,
                                         oci_registry: Images, oci_cache: Path) -> None:
    pytester.makepyfile(test_x="def test_x(smol_vm): pass\ndef test_y(smol_vm): pass")
    image = f"{oci_registry.host}/acc/alpine:missing"
    result = pytester.runpytest_subprocess("--smol-backend=namespace", f"--smol-baseline={image}")
    _stops_with_one_line(result, f"--smol-baseline={image}: no such image on {oci_registry.host} "
                                 "(HTTP 404 for acc/alpine missing): check the name and tag")
    pytester.makeini("[pytest]\nsmol_baseline = nosuchimage.invalid/acc/alpine:1\nsmol_offline = true\n")
    result = pytester.runpytest_subprocess("--smol-backend=namespace")
    _stops_with_one_line(result, "smol_baseline=nosuchimage.invalid/acc/alpine:1: tag 1 is not in the cache and "
                                 "--smol-offline forbids pulling (pre-pull it: pytest-smolvm pull "
                                 "nosuchimage.invalid/acc/alpine:1)")
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest_subprocess("--smol-backend=namespace", "--smol-baseline=Acc/Alpine:1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR  # a malformed name is caught at startup
    result.stderr.fnmatch_lines(["ERROR: --smol-baseline=Acc/Alpine:1: not an image reference*"])
    assert no_partial_files(oci_cache) == []


def test_a_slow_pull_is_reported_once_in_the_summary_and_not_with_q(
        pytester: pytest.Pytester, smol_state: Path, oci_registry: Images, oci_cache: Path) -> None:
    """A pull happens inside the first guest test's setup (under -n, on the controller's plan thread):
    a live line there would land in the middle of the test output, so its closing line goes to the
    smolvm summary section, once per run."""
    pytester.makepyfile(test_x="def test_x(smol_vm): assert smol_vm.exec('true').exit_code == 0")
    config = ProxyConfig(oci_registry.host, delay_per_mb=0.2)  # ~3 s for the 15 MB layer
    with proxy(config) as host:
        image = f"{host}/acc/alpine:1"
        quiet = pytester.runpytest_subprocess("-q", "--smol-backend=namespace", f"--smol-baseline={image}")
        quiet.assert_outcomes(passed=1)
        assert "smolvm: pulling" not in quiet.stderr.str() + quiet.stdout.str()
        shutil.rmtree(oci_cache)
        loud = pytester.runpytest_subprocess("-n", "2", "-v", "--smol-backend=namespace", f"--smol-baseline={image}")
        loud.assert_outcomes(passed=1)
    assert "smolvm: pulling" not in loud.stderr.str()
    out = loud.stdout.lines
    section = next(i for i, line in enumerate(out) if "= smolvm =" in line)
    lines = [(i, line) for i, line in enumerate(out) if line.startswith("smolvm: pulling")]
    assert [i > section for i, _ in lines] == [True], out  # once, under -n 2, and only in the summary
    assert lines[0][1].startswith(f"smolvm: pulling {image}: pulled 1 layer(s), 1"), lines
    assert any("PASSED" in line and "test_x" in line for line in out[:section])  # the test line is whole


def test_pull_command_prepulls_for_offline_runs(cli: Any, pytester: pytest.Pytester, oci_registry: Images,
                                                oci_cache: Path) -> None:
    image = f"{oci_registry.host}/acc/alpine:1"
    done = cli("pull", image)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"{image}: {oci_registry.alpine}"
    assert f"--smol-baseline={oci_registry.host}/acc/alpine@{oci_registry.alpine}" in done.stdout
    mark = len(oci_registry.registry.requests())
    pytester.makepyfile(test_x="def test_x(smol_vm): assert smol_vm.exec('echo $ACC_IMAGE').stdout == '1\\n'")
    result = pytester.runpytest_subprocess("--smol-backend=namespace", f"--smol-baseline={image}", "--smol-offline")
    result.assert_outcomes(passed=1)
    assert oci_registry.registry.requests()[mark:] == []  # offline: not one request
    uncached = cli("pull", "--offline", f"{oci_registry.host}/acc/never-pulled:1")
    assert uncached.returncode == 2
    assert uncached.stderr.rstrip().endswith("--offline forbids pulling (run it without --offline to pull it)"), \
        uncached.stderr
    missing = cli("pull", f"{oci_registry.host}/acc/nothing:1")
    assert missing.returncode == 2
    assert missing.stderr.startswith(f"pytest-smolvm pull {oci_registry.host}/acc/nothing:1: no such image")


def test_concurrent_first_pulls_download_each_blob_once(oci_registry: Images, oci_cache: Path) -> None:
    # Slow enough for the pulls to overlap; every blob slow to answer, the small config too: a
    # pull that fetches it while another one does (CI met that race) is seen every time.
    config = ProxyConfig(oci_registry.host, delay_per_mb=0.1, blob_delay=0.5)
    with proxy(config) as host:
        image = f"{host}/acc/layers:1"
        pulls = [subprocess.Popen([sys.executable, "-m", "pytest_smolvm.cli", "pull", image],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
        outputs = [p.communicate(timeout=240) for p in pulls]
    assert [p.returncode for p in pulls] == [0, 0, 0], outputs
    assert {out.splitlines()[0] for out, _ in outputs} == {f"{image}: {oci_registry.layers}"}
    blob_gets = [p for p in config.paths if "/blobs/" in p]
    assert len(blob_gets) == len(set(blob_gets)) == 3, blob_gets  # config and two layers, once each
    assert no_partial_files(oci_cache) == []
