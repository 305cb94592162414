"""The smol backend's branch coalescer: batches when requests overlap, falls back when a batch fails."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from pytest_smolvm.backends.smol.batching import BranchBatcher


@dataclass
class Child:
    name: str


@dataclass
class FakeSource:
    """A source as a control plane sees it: names it holds are taken (a branch of one is refused)."""

    batch_error: Exception | None = None
    batch_lost: bool = False  # the batch is made, then its answer never arrives
    wrong_children: bool = False
    calls: list[tuple[str, list[str]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    gate: threading.Event = field(default_factory=threading.Event)
    existing: set[str] = field(default_factory=set)

    def _make(self, names: list[str]) -> None:
        with self.lock:
            taken = self.existing & set(names)
            if taken:
                raise RuntimeError(f"409 conflict: machine name(s) already exist: {sorted(taken)}")
            self.existing |= set(names)

    def branch(self, name: str) -> Child:
        with self.lock:
            self.calls.append(("branch", [name]))
        self.gate.wait(5)  # the first branch is slow: the others arrive while it is under way
        self._make([name])
        return Child(name)

    def branch_batch(self, *, names: list[str]) -> list[Child]:
        with self.lock:
            self.calls.append(("batch", list(names)))
        if self.batch_error is not None:
            raise self.batch_error
        made = [n + "-other" if self.wrong_children else n for n in names]
        self._make(made)
        if self.batch_lost:
            raise ConnectionResetError("the batch's answer was lost on the way back")
        return [Child(n) for n in made]

    def sweep(self, names: list[str]) -> None:
        with self.lock:
            self.existing -= set(names)


def _fan_out(source: FakeSource, count: int) -> tuple[dict[str, Any], list[Any]]:
    batcher = BranchBatcher(window=0.2)
    deleted: list[Any] = []
    got: dict[str, Any] = {}
    first = threading.Thread(target=lambda: got.setdefault("g0", batcher.branch("src", source, "g0", deleted.append,
                                                                                source.sweep)))
    first.start()
    while not source.calls:
        pass
    rest = [threading.Thread(target=lambda n=f"g{i}": got.setdefault(n, batcher.branch("src", source, n,
                                                                                      deleted.append, source.sweep)))
            for i in range(1, count)]
    for thread in rest:
        thread.start()
    source.gate.set()
    for thread in [first, *rest]:
        thread.join(10)
    return got, deleted


def test_overlapping_requests_share_one_batch_call() -> None:
    source = FakeSource()
    got, deleted = _fan_out(source, 6)
    assert {name: child.name for name, child in got.items()} == {f"g{i}": f"g{i}" for i in range(6)}
    assert source.calls[0] == ("branch", ["g0"])  # alone: a plain branch, no window waited
    assert source.calls[1][0] == "batch" and len(source.calls) < 6  # the five overlapping ones: batched
    assert deleted == []


def test_a_failed_batch_falls_back_to_one_branch_each() -> None:
    source = FakeSource(batch_error=RuntimeError("no batch route"))
    got, _ = _fan_out(source, 4)
    assert sorted(got) == ["g0", "g1", "g2", "g3"]
    assert sorted(names[0] for kind, names in source.calls if kind == "branch") == ["g0", "g1", "g2", "g3"]


def test_a_batch_made_but_whose_answer_was_lost_is_swept_before_each_falls_back() -> None:
    """A batch call can fail after the control plane made its children (the answer lost on the
    way, a readiness wait broken by pytest's own environment updates). Each request then makes
    its own branch of the same name: those names must be free again, or every one is refused."""
    source = FakeSource(batch_lost=True)
    got, _ = _fan_out(source, 4)
    assert sorted(got) == ["g0", "g1", "g2", "g3"]
    assert source.calls[1] == ("batch", ["g1", "g2", "g3"])
    assert sorted(names[0] for kind, names in source.calls[2:]) == ["g1", "g2", "g3"]
    assert source.existing == {"g0", "g1", "g2", "g3"}  # one of each: the swept batch's are gone


def test_children_nobody_asked_for_are_deleted() -> None:
    source = FakeSource(wrong_children=True)
    got, deleted = _fan_out(source, 4)
    assert sorted(child.name for child in got.values()) == ["g0", "g1", "g2", "g3"]
    assert sorted(child.name for child in deleted) == ["g1-other", "g2-other", "g3-other"]


def test_requests_that_trickle_in_while_a_call_is_under_way_gather_into_the_next_batch() -> None:
    """Concurrent tests ask for their guests one per item handed over, further apart than the
    window: as the SDK's own coalescer does, one call is in flight per source and the requests
    arriving meanwhile all go in the next one."""
    source = FakeSource()
    batcher = BranchBatcher(window=0.01)
    got: dict[str, Any] = {}

    def ask(name: str) -> None:
        got[name] = batcher.branch("src", source, name, lambda child: None, source.sweep)

    threads = [threading.Thread(target=ask, args=("g0",))]
    threads[0].start()
    while not source.calls:
        pass
    for i in range(1, 6):
        threads.append(threading.Thread(target=ask, args=(f"g{i}",)))
        threads[-1].start()
        threading.Event().wait(0.05)  # five times the window apart
    source.gate.set()
    for thread in threads:
        thread.join(10)
    assert sorted(got) == [f"g{i}" for i in range(6)]
    assert source.calls == [("branch", ["g0"]), ("batch", [f"g{i}" for i in range(1, 6)])]
    assert batcher.calls == 2


def test_a_lone_branch_that_fails_raises_its_own_error() -> None:
    class Refusing(FakeSource):
        def branch(self, name: str) -> Child:
            raise RuntimeError(f"no room for {name}")

    batcher = BranchBatcher()
    try:
        batcher.branch("src", Refusing(), "g0", lambda child: None, lambda names: None)
    except RuntimeError as exc:
        assert "no room for g0" in str(exc)
    else:
        raise AssertionError("the branch's error was swallowed")
