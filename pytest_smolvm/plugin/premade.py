"""The pytest glue of a test's guest made before its setup (``--smol-concurrency``).

Under ``--smol-concurrency`` every test's setup runs on the worker's one event-loop thread,
one setup at a time (pytest's fixture machinery holds one item's state at a time). Making the
guest is the slow part of a guest test's setup, so the concurrent runner (concurrency.py)
orders it earlier. The making, the waiting, how many and the discarding of what nobody takes
are session/ahead.py's (the one made-ahead mechanism, the pool's next guests included); here
is only what pytest knows: which item, its spec computed exactly as ``smol_vm_factory`` does
(the ``smol`` marker, then the ``pytest_smolvm_configure_vm`` hook, called once), and its
waiting notes. The factory's first plain call takes the guest with :func:`take`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pytest

from pytest_smolvm.session.settings import MarkerSpec, marker_spec

if TYPE_CHECKING:
    from pytest_smolvm.session.pool import LiveGuest
    from pytest_smolvm.session.run import SmolRun
    from pytest_smolvm.session.warm import BaselineSetup


def waiting_note(item: pytest.Item) -> Callable[[str], None]:
    """What a test held back by admission control says: a line in ``-v`` output (serial runs;
    an xdist worker has no terminal of its own) and a section of its report."""
    def note(why: str) -> None:
        item.add_report_section("setup", "smolvm admission", f"waited for admission: {why}")
        config = item.config
        terminal = config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None and config.get_verbosity() > 0 and not hasattr(config, "workerinput"):
            terminal.write_line(f"{item.nodeid}: waiting for admission ({why})")
    return note


def guest_spec(item: pytest.Item, base: MarkerSpec, keywords: Mapping[str, Any]) -> MarkerSpec:
    """The spec of a guest ``item`` asks for: ``base`` with ``keywords``, then the hook's say."""
    spec = base.merged(dict(keywords), "smol_vm_factory")
    proposed = {k: getattr(spec, k) for k in MarkerSpec.__dataclass_fields__}
    item.config.hook.pytest_smolvm_configure_vm(item=item, spec=proposed)
    return MarkerSpec().merged(proposed, "pytest_smolvm_configure_vm")


TAKER_KEY = pytest.StashKey[object]()  # the token the item's ordered guest is kept under
SETUP_KEY = pytest.StashKey["BaselineSetup | None"]()  # the warm setup the test's factory used


def start(item: pytest.Item, run: SmolRun, setup: BaselineSetup | None, ready: Callable[[], None]) -> bool:
    """Order ``item``'s ``smol_vm`` guest from the pool (session/ahead.py makes it); False where
    the fixture should make it itself. ``ready()`` runs, on the making thread, once it is made."""
    try:
        spec = guest_spec(item, marker_spec(item), {})
    except Exception:
        return False  # a bad marker or hook: the fixture meets it again and reports it in setup
    taker = item.stash[TAKER_KEY] = object()  # this item's, however often its node id runs
    run.pool.order(taker, item.nodeid, spec, setup, waiting=waiting_note(item), ready=ready)
    return True


def take(item: pytest.Item, keywords: Mapping[str, Any], setup: BaselineSetup | None,
         run: SmolRun) -> LiveGuest | None:
    """The guest ordered for this plain ``smol_vm_factory()`` call, if one was (what its create
    raised is raised here); one made for another spec or setup is discarded."""
    taker = item.stash.get(TAKER_KEY, None)
    if taker is None:
        return None
    del item.stash[TAKER_KEY]
    if keywords:
        run.pool.ahead.cancel(taker)  # made for another spec: not what this call asked for
        return None
    return run.pool.take_ordered(taker, setup)


def cancel(item: pytest.Item, run: SmolRun) -> None:
    """The item ends: a guest ordered for it that it never took is discarded."""
    taker = item.stash.get(TAKER_KEY, None)
    if taker is not None:
        del item.stash[TAKER_KEY]
        run.pool.ahead.cancel(taker)
