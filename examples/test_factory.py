"""Several guests in one test: each has its own filesystem and processes; all destroyed at teardown."""

from collections.abc import Callable

from pytest_smolvm import VM


def test_two_guests_cannot_see_each_others_files(smol_vm_factory: Callable[..., VM]) -> None:
    alice = smol_vm_factory(env={"WHO": "alice"})  # the same keywords as @pytest.mark.smol
    bob = smol_vm_factory(env={"WHO": "bob"})
    assert alice.name != bob.name

    alice.exec('mkdir -p /workspace && echo "$WHO" > /workspace/secret', check=True)
    assert bob.exec(["test", "-e", "/workspace/secret"]).exit_code == 1

    bob.write_file("/workspace/secret", "bob\n")
    assert alice.read_file("/workspace/secret") == b"alice\n"
    assert bob.read_file("/workspace/secret") == b"bob\n"


def test_two_guests_have_separate_process_trees(smol_vm_factory: Callable[..., VM]) -> None:
    server, client = smol_vm_factory(), smol_vm_factory()
    # A background process lives until its guest is destroyed...
    pid = server.exec("sleep 300 >/dev/null 2>&1 & echo $!", check=True).stdout.strip()
    assert server.exec(["kill", "-0", pid]).exit_code == 0
    # ...and exists in that guest only.
    assert "sleep" not in client.exec("ps -o comm").stdout
