"""An allowlisted download inside a guest: the index is reachable, nothing else is."""

from collections.abc import Callable

from pytest_smolvm import VM


def test_allowlisted_download(smol_vm_factory: Callable[..., VM], package_index: str) -> None:
    # The allowlist names this run's stand-in index, known only once its fixture has started it
    # (a fixed address would take @pytest.mark.smol(allow_hosts=["10.0.0.5"]) just the same).
    vm = smol_vm_factory(allow_hosts=[package_index])
    vm.exec(f"wget -q -T 5 -O /tmp/pkg.tar http://{package_index}:8080/pkg-1.0.tar", check=True)
    assert vm.read_file("/tmp/pkg.tar") == b"the package's contents\n"
    # Anything off the allowlist is refused: here, the host's side of the index's link.
    host_side = package_index.rsplit(".", 1)[0] + ".1"
    assert vm.exec(f"wget -q -T 3 -O /dev/null http://{host_side}:8080/").exit_code != 0
