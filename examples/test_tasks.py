"""Ship a task tree into the guest, run it, and bring the results back."""

from pathlib import Path

from pytest_smolvm import VM

TASK = Path(__file__).parent / "tasks" / "fizzbuzz"


def test_copy_in_run_copy_out(smol_vm: VM, tmp_path: Path) -> None:
    smol_vm.copy_in(TASK, "/workspace/fizzbuzz")  # a whole tree; modes are kept
    r = smol_vm.exec(["/workspace/fizzbuzz/run", "15"], check=True)
    assert r.stdout == "wrote 15 lines\n"

    out = smol_vm.copy_out("/workspace/fizzbuzz/out", tmp_path / "out")  # a tree back to the host
    assert (out / "answer.txt").read_text() == (TASK / "expected.txt").read_text()


def test_copy_out_a_single_file(smol_vm: VM, tmp_path: Path) -> None:
    smol_vm.exec("mkdir -p /results && uname -s > /results/kernel.txt", check=True)
    path = smol_vm.copy_out("/results/kernel.txt", tmp_path / "kernel.txt")
    assert path.read_text() == "Linux\n"
