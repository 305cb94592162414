"""Episodes that must not leak into each other: every parametrized case gets a fresh guest."""

import pytest

from pytest_smolvm import VM

MARKER = "/root/.cache/previous-episode"
PIDFILE = "/tmp/previous-episode.pid"


@pytest.mark.parametrize("episode", range(8))
def test_episode_starts_clean(smol_vm: VM, episode: int) -> None:
    # Nothing an earlier episode left behind is here: each guest forks from the baseline.
    assert smol_vm.exec(["test", "-e", MARKER]).exit_code == 1  # no leftover file
    assert smol_vm.exec(["test", "-e", PIDFILE]).exit_code == 1
    assert "sleep" not in smol_vm.exec("ps -o comm").stdout  # no leftover process

    # Now leave a mess for the next episode to (not) find: a file and a running process.
    smol_vm.write_file(MARKER, f"episode {episode}\n")
    smol_vm.exec(f"sleep 300 >/dev/null 2>&1 & echo $! > {PIDFILE}", check=True)
    assert smol_vm.exec(f"kill -0 $(cat {PIDFILE})").exit_code == 0  # it outlives the exec
