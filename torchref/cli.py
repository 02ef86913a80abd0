"""`torchref train|compare [--config FILE.yaml] [key=value ...]`.

Exit codes: 0 success; 2 invalid configuration/input or a dead worker (one `error: ...` line
on stderr, no traceback); other non-zero for internal faults.
"""

from __future__ import annotations

import json
import os
import sys

from gpt2common.grammar import one_line


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    from gpt2common.grammar import ConfigError, given_twice

    cfg_file, rest, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--config" or a.startswith("--config="):
            if a == "--config" and i + 1 >= len(argv):
                raise ConfigError("--config needs a file")
            given = argv[i + 1] if a == "--config" else a.split("=", 1)[1]
            if not given:  # `--config=` (an unset shell variable): not a run on the defaults
                raise ConfigError("--config needs a file")
            if cfg_file is not None:  # the first file would be dropped
                raise given_twice("--config", cfg_file, given)
            cfg_file = given
            i += 2 if a == "--config" else 1
            continue
        else:
            rest.append(a)
        i += 1
    return cfg_file, rest


def _print_help(text: str) -> int:
    """Help, exit 0, also into a pipe whose reader is gone (`torchref train --help | head`): no traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush finds no pipe
    return 0


def main(argv: list[str] | None = None) -> int:
    entry = argv is None  # the process's own entry (the `torchref` script, python -m): not a call from Python
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        from gpt2common.versions import version_line

        print(version_line("torchref"))
        return 0
    from torchref import help as help_text  # the key tables: torchref's dataclasses (no torch)

    if not argv:  # a command is required: usage on stderr, exit 2 (as a bad command)
        sys.stderr.write(f"{help_text.usage().splitlines()[0]}\nerror: no command given (choose from "
                         f"{', '.join(help_text.COMMANDS)}; torchref --help)\n")
        return 2
    if argv[0] in ("-h", "--help", "help"):
        return _print_help(help_text.usage())
    cmd, args = argv[0], argv[1:]
    if cmd in help_text.COMMANDS and any(a in ("-h", "--help") for a in args):
        return _print_help(help_text.command_help(cmd))
    from gpt2common.grammar import ConfigError
    from gpt2common.writes import WRITE_FAILED_EXIT, WriteFailed, failure_line
    from torchref.config import WorkerDied

    try:
        cfg_file, args = _split_config(args)
        if cmd == "train":
            from torchref.config import ref_to_dict, resolve_ref
            from torchref.launch import train

            cfg, ref = resolve_ref(args, cfg_file)
            s = train(cfg, ref, on_start=lambda: print(json.dumps(
                {"torchref": ref_to_dict(ref), "model": cfg.model.__dict__, "train": cfg.train.__dict__,
                 "data": cfg.data or "(built-in)", "init": cfg.init, "init_state": cfg.init_state, "seed": cfg.seed,
                 "out": cfg.out}), flush=True))
            print(json.dumps({k: s[k] for k in ("strategy", "workers", "steps", "final_loss", "wall_s", "out")}))
        elif cmd == "compare":
            from torchref.compare import main as compare_main

            compare_main(args, cfg_file)
        else:
            raise ConfigError(f"unknown command {cmd!r} (choose from train, compare)")
    except (ConfigError, WorkerDied) as e:
        sys.stderr.write(f"error: {one_line(str(e))}\n")  # one write: lines of several processes never join
        return 2
    except (WriteFailed, OSError, MemoryError) as e:  # any storage errno, out of memory: gpt2common/writes.py
        if (msg := failure_line(e)) is None:
            raise
        sys.stderr.write(f"error: {one_line(msg)}\n")
        return WRITE_FAILED_EXIT
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        if entry:  # out without the interpreter's teardown, which torch's threads can crash (exit 139)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
