"""Async episodes in flight together: an agent's episode waits most of its life (on a model, a
tool, a build), so one worker keeps several in flight (``concurrency=``, or ``--smol-concurrency``
for every async guest test). Each is still its own test: its own guest, report and teardown."""

import asyncio

import pytest

from pytest_smolvm import VM
from pytest_smolvm.evals.episodes import Episode


@pytest.mark.smol_episodes(6, seed=7, concurrency=3)
async def test_agent_episode(smol_vm: VM, smol_episode: Episode) -> None:
    vm = smol_vm.aio  # the async handle: awaiting it lets the worker run the other episodes
    await vm.write_file("/workspace/task.txt", f"seed {smol_episode.seed}\n")
    await asyncio.sleep(0.2)  # stands in for a model call: the guest waits, the worker does not
    result = await vm.exec("sleep 0.5; cat /workspace/task.txt; test ! -e /workspace/answer.txt")
    assert result.exit_code == 0, result  # no other episode's answer is here: each has its own guest
    await vm.write_file("/workspace/answer.txt", "42\n")
    smol_episode.record(1.0 if result.stdout == f"seed {smol_episode.seed}\n" else 0.0)
