"""A real Inspect eval through the ``smolvm`` provider: Inspect's mock model, a tool and a scorer in the guest.

The task is tests/inspect_eval/squares.py: four samples at once, each in a fresh guest as a
non-root user; the scorer reads from the sample's guest what the tool wrote there. Run in this
process with a Python config object and as ``inspect eval`` with the TOML file; both leave
nothing on the host (``smol_state`` checks guests, mounts, cgroups, scratch dirs and records).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

INSTALL = "python3 -m pip install '.[inspect]' from a checkout (inspect-ai>=0.3.285, Python 3.11+)"
pytest.importorskip("inspect_ai", reason=f"the smolvm Inspect provider needs {INSTALL}")

from inspect_ai import eval as inspect_eval  # noqa: E402
from inspect_ai import task_with  # noqa: E402
from inspect_ai.log import EvalLog, list_eval_logs, read_eval_log  # noqa: E402

from pytest_smolvm.integrations.inspect_config import SmolvmSandboxConfig  # noqa: E402
from tests.leaks import guest_processes  # noqa: E402

TASK_DIR = Path(__file__).with_name("inspect_eval")
SAMPLES = 4


def assert_scored_in_the_guests(log: EvalLog) -> None:
    assert log.status == "success", log.error
    assert log.results is not None and log.results.scores[0].metrics["accuracy"].value == 0.75, log.results
    assert log.samples is not None and len(log.samples) == SAMPLES
    scores: dict[str, Any] = {}
    for sample in log.samples:
        assert sample.scores is not None
        score = sample.scores["in_guest"]
        scores[str(sample.input)] = (score.value, score.explanation)
    n = {str(i): i for i in (2, 3, 4, 5)}
    assert scores == {k: ("C" if k != "5" else "I", f"answer-{k}.txt\nagent\n{i * i}\n") for k, i in n.items()}
    # Several samples, so several guests, at once: some sample started before another ended.
    spans = sorted((datetime.fromisoformat(str(s.started_at)), datetime.fromisoformat(str(s.completed_at)))
                   for s in log.samples)
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans)), spans


def test_an_inspect_eval_in_this_process_with_a_config_object(tmp_path: Path, smol_state: Path) -> None:
    sys.path.insert(0, str(TASK_DIR))
    try:
        import squares  # type: ignore[import-not-found]  # tests/inspect_eval's task, on sys.path here only
    finally:
        sys.path.remove(str(TASK_DIR))
    config = SmolvmSandboxConfig(user="agent", setup=("adduser -D agent",))
    # the documented shorthand; inspect_ai types the tuple's config as a str (a file's name) only
    task = task_with(squares.squares(), sandbox=("smolvm", config))  # type: ignore[arg-type]
    [log] = inspect_eval(task, log_dir=str(tmp_path / "logs"), display="none", max_samples=SAMPLES)
    assert_scored_in_the_guests(log)


def inspect_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "inspect_ai", *args], cwd=tmp_path, env=os.environ.copy(),
                          input="y\n", capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def eval_on_the_command_line(tmp_path: Path, *options: str) -> EvalLog:
    shutil.copytree(TASK_DIR, tmp_path / "task")
    logs = tmp_path / "logs"
    # The task's parent as the working dir: Inspect finds smolvm.toml beside the task file.
    inspect_cli(tmp_path, "eval", "task/squares.py", "--model", "mockllm/model", "--log-dir", str(logs),
                "--display", "plain", "--max-samples", str(SAMPLES), *options)
    [info] = list_eval_logs(str(logs))
    return read_eval_log(info)


def test_inspect_eval_on_the_command_line_with_smolvm_toml(tmp_path: Path, smol_state: Path) -> None:
    assert_scored_in_the_guests(eval_on_the_command_line(tmp_path))


def test_no_sandbox_cleanup_keeps_the_samples_guests_until_inspect_sandbox_cleanup(
        tmp_path: Path, smol_state: Path) -> None:
    from pytest_smolvm.host.registry import records

    assert_scored_in_the_guests(eval_on_the_command_line(tmp_path, "--no-sandbox-cleanup"))
    kept = [r for r in records() if r.kept]
    assert len(kept) == SAMPLES and guest_processes(smol_state), [r.name for r in records()]
    inspect_cli(tmp_path, "sandbox", "cleanup", "smolvm")
    assert list(records()) == []
