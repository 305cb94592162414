"""Group rollouts from one prepared state: prepare once, branch the group, score each member.

``vm.branch_batch(8)`` makes eight guests whose files are the prepared guest's (on smol, its
memory and processes too); each member then goes its own way and is scored in place.
``vm.reward(grader)`` grades a guest in a throwaway branch of it, so the grader's writes never
touch it (on smol, of a guest started branchable: ``branch_batch``'s members are not).
"""

import pytest

from pytest_smolvm import VM
from pytest_smolvm.evals.episodes import Episode

GRADER = "test \"$(cat /task/answer 2>/dev/null)\" = \"$(cat /task/expected)\" && echo 1 || echo 0"


@pytest.mark.smol(branchable=True)  # smol: start it branchable; namespace guests always are
def test_group_rollout(smol_vm: VM, smol_episode: Episode) -> None:
    # Prepare once: the task's files, as an expensive setup would leave them.
    smol_vm.exec("mkdir -p /task && printf 'a b c\\n' > /task/input && "
                 "wc -w < /task/input | tr -d ' ' > /task/expected", check=True)
    assert smol_vm.reward(GRADER + "; echo 3 > /task/answer").stdout == "0\n"  # nothing answered yet

    group = smol_vm.branch_batch(8)
    scores = []
    for member, child in enumerate(group):
        # Each member's attempt: here, a guess that is right for half of them.
        child.exec(f"echo {3 if member % 2 == 0 else member + 10} > /task/answer", check=True)
        scores.append(float(child.exec(GRADER, check=True).stdout))
        assert child.exec("cat /task/answer").stdout.strip() == str(3 if member % 2 == 0 else member + 10)

    assert scores == [1.0, 0.0] * 4
    assert smol_vm.exec("test -e /task/answer").exit_code == 1  # the prepared guest is untouched
    # One results line for the group: its mean, with every member's score beside it.
    smol_episode.record(sum(scores) / len(scores), scores=scores)


@pytest.mark.smol(branchable=True)
def test_branch_of_a_branch(smol_vm: VM) -> None:
    smol_vm.write_file("/task/step", "1")
    step_one = smol_vm.branch()
    step_one.write_file("/task/step", "2")
    step_two = step_one.branch()
    assert [vm.read_file("/task/step") for vm in (smol_vm, step_one, step_two)] == [b"1", b"2", b"2"]
