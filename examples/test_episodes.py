"""Episodes that must not leak into each other: every parametrized case gets a fresh guest."""

import pytest

MARKER = "/root/.cache/previous-episode"
LEFTOVER = ["pgrep", "-f", "sleep 300"]  # -f: also matches the shell that is about to exec it


@pytest.mark.parametrize("episode", range(8))
def test_episode_starts_clean(smol_vm, episode):
    # Nothing an earlier episode left behind is here: each guest forks from the baseline.
    assert smol_vm.exec(["test", "-e", MARKER]).exit_code == 1  # no leftover file
    assert smol_vm.exec(LEFTOVER).exit_code == 1  # no leftover process

    # Now leave a mess for the next episode to (not) find.
    smol_vm.write_file(MARKER, f"episode {episode}\n")
    smol_vm.exec("sleep 300 &")
    assert smol_vm.exec(LEFTOVER).exit_code == 0
