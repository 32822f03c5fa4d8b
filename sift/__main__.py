"""`python -m sift [command] ...`: the package's commands; with none, the environment report."""

from __future__ import annotations

import importlib
import sys

# command: (module whose main() runs it, what it does)
COMMANDS = {
    "env": ("sift.env", "what is installed and active: torch, the C++ extension, Triton, the backend of each op (the default)"),
    "bench": ("sift.bench.__main__", "benchmark suites against dense AdamW, LoRA and full fine-tuning (--help for the suites)"),
    "demo": ("sift.demo", "the MiniLM and 4-bit demos (--help for their options)"),
}
USAGE = "usage: python -m sift [{" + ",".join(COMMANDS) + "}] [options]\n\ncommands:\n" + "\n".join(
    f"  {name:<7} {what}   (python -m {module.removesuffix('.__main__')})" for name, (module, what) in COMMANDS.items())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    name = argv[0] if argv else "env"
    if name not in COMMANDS:
        raise SystemExit(f"python -m sift: unknown command {name!r}\n\n{USAGE}")
    module = importlib.import_module(COMMANDS[name][0])
    if name == "env":
        module.main()
        return
    sys.argv = [f"python -m sift {name}", *argv[1:]]
    module.main()


if __name__ == "__main__":
    main()
