"""Host-side extraction fuzzed: Hypothesis makes hostile tar streams (tests/tarfuzz.py) and each
wall alone (the in-process fd walker, and the confined helper around it) must, for every
policy (copy_out, an image layer, a guest's warm export), unpack them inside the destination or
refuse them with UnsafeArchive; never raise anything else, never change a byte or inode of the
canary tree beside the destination, and stay within a memory bound.

A short run here (~40 s of the CI budget on one core, spread over xdist workers); the long run
is ``python benchmarks/fuzz_extract.py``. A failure prints the case's reproduction blob.
"""

from __future__ import annotations

import tarfile

import pytest
from hypothesis import HealthCheck, example, given, settings

from tests.tarfuzz import POLICIES, Case, cases, check


def deep_dir_replaced(depth: int) -> Case:
    """Found by this fuzzer: a dir ``depth`` deep replaced by a file was removed one Python frame
    per level (RecursionError, no UnsafeArchive) or one fd per level (EMFILE in the helper)."""
    return Case([{"kind": "dir", "name": "payload/" + "a/" * depth, "mode": 0o755},
                 {"kind": "file", "name": "payload/a", "mode": 0o644, "data": b"x"}],
                tarfile.GNU_FORMAT, cut=None, flips=[], trailer=True)

# Cases per (wall, policy): the confined helper costs a process per case.
EXAMPLES = {"in-process": 80, "confined": 40}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("wall", sorted(EXAMPLES))
def test_hostile_streams_land_inside_or_are_refused(wall: str, policy: str) -> None:
    @settings(max_examples=EXAMPLES[wall], deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cases())
    @example(deep_dir_replaced(2040))  # Hypothesis runs cases with a recursion limit of ~2,000
    def fuzz(case: Case) -> None:
        check(case, wall, policy)

    fuzz()


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("wall", sorted(EXAMPLES))
def test_a_deep_dir_replaced_by_a_file_is_replaced(wall: str, policy: str) -> None:
    assert check(deep_dir_replaced(1100), wall, policy) == "ok"
