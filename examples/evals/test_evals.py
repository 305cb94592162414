"""A tiny eval suite: three tasks x four episodes, a toy agent, a reward computed inside the guest.

Run it:  pytest examples/evals -n 2 --smol-results=results.jsonl
Every episode is its own test with its own fresh guest; the summary table closes the run.
"""

from pathlib import Path

import pytest

from pytest_smolvm import VM
from pytest_smolvm.evals.episodes import Episode

HERE = Path(__file__).parent
# Sorted: every xdist worker must collect the same tests in the same order.
TASKS = sorted(p.name for p in (HERE / "tasks").iterdir() if p.is_dir())


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.smol_episodes(4, seed=0)
def test_agent(smol_vm: VM, smol_episode: Episode, task: str) -> None:
    task_dir = HERE / "tasks" / task
    # The agent sees the task and its input, never the expected answer or the grader.
    smol_vm.copy_in(task_dir / "task.txt", "/task/task.txt")
    smol_vm.copy_in(task_dir / "input.txt", "/task/input.txt")
    smol_vm.copy_in(HERE / "agent.sh", "/agent/agent.sh")

    run = smol_vm.exec(["/bin/sh", "/agent/agent.sh", "/task", "/workspace/answer.txt"],
                       env={"SEED": str(smol_episode.seed)}, timeout=30)
    assert run.exit_code == 0, f"the agent crashed: {run.stderr}"  # a broken harness fails the test

    # Grade in the same guest, with files the agent never had a chance to touch.
    # On a Python-capable baseline (build-python-baseline.sh here, python:3.12-slim on smol) the
    # grader is Python; on the default BusyBox guest it is the shell twin. Same reward either way.
    interpreter = "python3" if smol_vm.exec("command -v python3").exit_code == 0 else "/bin/sh"
    grader = "reward.py" if interpreter == "python3" else "reward.sh"
    smol_vm.copy_in(task_dir / "expected.txt", "/grader/expected.txt")
    smol_vm.copy_in(HERE / grader, f"/grader/{grader}")
    graded = smol_vm.exec([interpreter, f"/grader/{grader}", "/grader/expected.txt", "/workspace/answer.txt"],
                          check=True)
    reward = float(graded.stdout)
    # How well the agent did is the reward (it varies with the seed); the test itself passes.
    smol_episode.record(reward, task=task, agent_seconds=round(run.duration, 3))
    assert 0.0 <= reward <= 1.0
