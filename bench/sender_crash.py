"""The federation sender killed mid fan-out (issue 28), as the issue tells it: figures.

The worker layout (main, two event persisters, a generic worker, a federation sender worker, over
Redis) and a destination homeserver (another Tributary, or Synapse with ``--synapse``) whose user
Bob joined Alice's room. Alice sends ``--messages`` (200) messages through the generic worker; the
sender worker is SIGKILLed ``--kill-at`` (1.5) seconds into the fan-out and started again
``--down`` (1) seconds later. Prints, per run: how many of the messages Bob's /sync on the
destination shows (and whether in order, each once), the same for /messages back-paginated, how
long after the restart /sync had them all, the PDUs the destination refused (as the sender stored
them) and the get_missing_events and /state_ids requests it made to the source (0: no gap to fill).

Needs PostgreSQL on 127.0.0.1:5432 and Redis on 6379, as the tests do. Run by hand:

    .venv/bin/python bench/sender_crash.py [--messages 200] [--kill-at 1.5] [--down 1] [--runs 1]
    .venv/bin/python bench/sender_crash.py --synapse .venv-synapse/bin/python   # `make interop` installs it
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psycopg2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.twisted_plugin import run_sync  # noqa: E402  (installs the reactor first)

from tests.conftest import REDIS_URL  # noqa: E402
from tests.integration.test_sender_crash import (  # noqa: E402
    Kill, Layout, fan_out_with_kills, started_layout,
)

_ = run_sync  # imported for its side effect


def refused(layout: Layout) -> int:
    with psycopg2.connect(layout.source_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM destination_pdu_errors")
        row = cur.fetchone()
    conn.close()
    return int(row[0]) if row else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--kill-at", type=float, default=1.5, help="seconds into the fan-out (default 1.5)")
    parser.add_argument("--down", type=float, default=1.0, help="seconds the sender stays down (default 1)")
    parser.add_argument("--runs", type=int, default=1, help="fan-outs, each in a new room, one layout")
    parser.add_argument("--converge", type=float, default=120.0, help="seconds to wait for the destination")
    parser.add_argument("--synapse", type=Path, default=None, metavar="PYTHON",
                        help="Synapse as the destination: the python of a venv with matrix-synapse")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="run in DIR and keep every process's log there (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sender-crash-") as scratch:
        tmp = str(args.keep.absolute()) if args.keep else scratch
        started = time.monotonic()
        synapse = args.synapse.absolute() if args.synapse else None  # a venv python: never resolve its symlink
        with started_layout(Path(tmp), None, REDIS_URL, synapse_python=synapse) as layout:
            kind = "Synapse" if args.synapse else "Tributary"
            # Empty databases, migrated by the processes as they start.
            print(f"layout and destination ({kind}) up in {time.monotonic() - started:.1f}s", flush=True)
            for run in range(args.runs):
                refused_before = refused(layout)
                kill = Kill("sender", args.down, after_seconds=args.kill_at)
                outcome = fan_out_with_kills(layout, args.messages, [kill], f"bench{run}", args.converge)
                wanted = set(outcome.sent)
                took = "never" if outcome.converged_seconds is None else f"{outcome.converged_seconds:.1f}s"
                print(
                    f"run {run}: {len(wanted & set(outcome.synced))}/{len(outcome.sent)} in /sync "
                    f"({outcome.live_limited} answers limited) "
                    f"({'in order, once' if outcome.synced == outcome.sent else 'NOT in order once'}), "
                    f"{len(wanted & set(outcome.synced_since))}/{len(outcome.sent)} in one /sync since before, "
                    f"{len(wanted & set(outcome.paginated))}/{len(outcome.sent)} by /messages "
                    f"({'in order, once' if outcome.paginated == outcome.sent else 'NOT in order once'}); "
                    f"fan-out {outcome.fan_out_seconds:.1f}s, sender killed after {outcome.killed_after} messages, "
                    f"all in /sync {took} after the restart; "
                    f"refused PDUs {refused(layout) - refused_before}, "
                    f"get_missing_events and /state_ids served {outcome.gap_fetches:.0f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
