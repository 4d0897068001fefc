"""Command line: ``treecompile demo`` (and more subcommands as they land)."""

from __future__ import annotations

import argparse
import sys


class UserError(Exception):
    """A problem with the user's input: reported in one line on stderr, exit status 1."""


def cmd_demo(args) -> int:
    from treecompile.demo import run_demo

    run_demo(steps=args.steps)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="treecompile", description="Train LLMs on trajectory trees.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run the main job on a small embedded example and print what it did")
    p.add_argument("--steps", type=int, default=3, help="training steps to run (default 3)")
    p.set_defaults(func=cmd_demo)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"treecompile {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
