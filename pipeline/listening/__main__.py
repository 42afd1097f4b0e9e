"""`python -m pipeline.listening check SESSION.yaml`: validate a session file (exit 2 with the file,
line and problem; 0 with a summary)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.listening import SessionError, load_session, trials


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.listening")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a session file")
    check.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    try:
        session = load_session(args.file)
    except SessionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    example = trials(session, "example-listener")
    print(f"{session.name}: {session.test.upper()}, {len(session.systems)} systems ({', '.join(s.name for s in session.systems)}), "
          f"{len(session.items)} items, {len(example)} trials per listener")
    return 0


if __name__ == "__main__":
    sys.exit(main())
