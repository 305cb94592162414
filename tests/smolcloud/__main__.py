"""``python -m tests.smolcloud [--port N] [--image NAME=PATH] [--fail OP:N:STATUS[:RETRY_AFTER]]``."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType

from pytest_smolvm.baselines.baseline import Baseline, bundled_rootfs_tarball, file_digest, resolve
from pytest_smolvm.errors import UsageError
from tests.smolcloud.faults import Fault, Faults, parse_fault
from tests.smolcloud.machines import Store
from tests.smolcloud.server import CloudServer, reaper


def _image(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--image {text}: expected NAME=PATH")
    return name, path


def _fault(text: str) -> Fault:
    try:
        return parse_fault(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fail_create(text: str) -> Fault:
    return _fault(f"create:{text}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.smolcloud", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: one the OS picks)")
    parser.add_argument("--image", type=_image, action="append", default=[], metavar="NAME=PATH",
                        help="an image reference served from a rootfs dir or tarball (repeatable)")
    parser.add_argument("--fail", type=_fault, action="append", default=[], metavar="OP:N:STATUS[:RA]",
                        help="make the Nth OP call (create, start, branch, exec, delete, list) fail "
                             "with STATUS, optionally with retry-after RA seconds; STATUS drop, lost or stall "
                             "hangs up; branch:N:unready answers with children never ready (repeatable)")
    parser.add_argument("--fail-create", type=_fail_create, action="append", default=[], metavar="N:STATUS",
                        help="shorthand for --fail create:N:STATUS")
    parser.add_argument("--ready-delay", type=float, default=0.0,
                        help="seconds a started machine reports ready=false (exercises the SDK's wait)")
    parser.add_argument("--legacy-fork-routes", action="store_true",
                        help="answer 404 on /branches routes, as a control plane from before them did")
    parser.add_argument("--legacy-exec-routes", action="store_true",
                        help="answer 404 on the resumable /execs routes, as a control plane from before them "
                             "did (the SDK then runs every exec through /exec and /exec/stream)")
    parser.add_argument("--untimed-execs", action="store_true",
                        help="run resumable execs without their timeoutSeconds, as a node whose agent never "
                             "enforced one (only the client's DELETE ends such a command)")
    parser.add_argument("--execs-ignore-user", action="store_true",
                        help="run resumable execs as the image's default account whatever user they name, "
                             "as a plane that ignores the field (the SDK checks no user echo there)")
    parser.add_argument("--ttl-scale", type=float, default=1.0,
                        help="multiply every TTL by this (0.001: an hour passes in 3.6 s), for TTL tests")
    parser.add_argument("--reap-interval", type=float, default=0.5, help="seconds between TTL sweeps")
    parser.add_argument("--state-dir", help="the namespace guests' state dir (default: a private temp dir)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="stop, as on SIGTERM, once the process that started this one is gone "
                             "(a test run killed before its fixture's teardown)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    parent = os.getppid()
    work = Path(tempfile.mkdtemp(prefix="smolcloud-"))
    os.environ["PYTEST_SMOLVM_STATE_DIR"] = args.state_dir or str(work / "state")
    try:
        tarball = bundled_rootfs_tarball()
        alpine = Baseline("alpine", "bundled", tarball, file_digest(tarball))
        images = {"alpine": alpine, "alpine:latest": alpine}
        for name, path in args.image:
            images[name] = resolve(path, Path.cwd())
    except UsageError as exc:
        print(f"smolcloud: {exc}", file=sys.stderr)
        return 2
    store = Store(images, work / "lowers", Faults([*args.fail, *args.fail_create]), args.ready_delay,
                  args.ttl_scale, untimed_execs=args.untimed_execs, execs_ignore_user=args.execs_ignore_user)
    (work / "lowers").mkdir()
    server = CloudServer(("127.0.0.1", args.port), store, legacy_fork_routes=args.legacy_fork_routes,
                         legacy_exec_routes=args.legacy_exec_routes)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    serving.start()
    sweeping = threading.Thread(target=reaper, args=(store, stop, args.reap_interval), daemon=True)
    sweeping.start()
    print(f"SMOL_CLOUD_URL=http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        while not stop.wait(0.5):
            if args.exit_with_parent and os.getppid() != parent:  # orphaned: reparented to a reaper
                break
    finally:
        server.shutdown()
        server.server_close()
        left = len(store.machines)
        store.close()
        shutil.rmtree(work, ignore_errors=True)
        print(f"smolcloud: stopped; destroyed {left} machine(s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
