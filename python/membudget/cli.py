"""The ``membudget`` command line (also ``python -m membudget``).

Where this sits in the flow: ``membudget run train.py`` is the no-code-change
entry point. It validates its flags with :mod:`membudget.config`, writes them
into the environment as ``MEMBUDGET_*`` (so that ``install()`` reads them
through ``Config.from_env`` like any other setting), calls
``membudget.install()`` before the script's first line, then runs the script
(or ``-m module``) as ``__main__`` the way ``python`` would: same ``sys.argv``,
same ``sys.path[0]``, same exit code. ``membudget demo`` and ``membudget info``
hand over to :mod:`membudget.demo` and :mod:`membudget.info`, ``membudget
simulate`` to :mod:`membudget.sim_cli`.
"""
from __future__ import annotations

import argparse
import atexit
import os
import runpy
import sys
from typing import List, Optional, Sequence, Tuple

__all__ = ["main"]

PROG = "membudget"

# (flag, environment variable, help). Flags override the environment.
_RUN_SETTINGS: Tuple[Tuple[str, str, str], ...] = (
    ("--budget", "MEMBUDGET_BUDGET", "device budget: bytes, units (12GiB, 512MB) or a percentage (60%%)"),
    ("--host-budget", "MEMBUDGET_HOST_BUDGET", "host memory for swapped tensors (default: half of RAM)"),
    ("--policy", "MEMBUDGET_POLICY", "eviction policy: delta (default), dtr, msps, lru, largest"),
    ("--actions", "MEMBUDGET_ACTIONS", "swap, recompute or both (default)"),
    ("--lineage", "MEMBUDGET_LINEAGE", "recorder of forward ops for recompute: auto (default: cxx on the CPU, python on CUDA), python or cxx"),
    ("--min-tensor-bytes", "MEMBUDGET_MIN_TENSOR_BYTES", "leave saved tensors below this size alone (default 1MiB)"),
    ("--prefetch-bytes", "MEMBUDGET_PREFETCH_BYTES", "prefetch window in backward, 0 disables (default 256MiB)"),
    ("--expandable-segments", "MEMBUDGET_EXPANDABLE_SEGMENTS",
     "1 (default): device memory in growing virtual ranges; 0: fixed segments"),
    ("--recompute-ahead", "MEMBUDGET_RECOMPUTE_AHEAD",
     "auto (default), 1 or 0: replay dropped activations ahead of use within the prefetch window"),
    ("--checkpoint", "MEMBUDGET_CHECKPOINT",
     "replace (default): run torch.utils.checkpoint regions as plain code under a budget; keep"),
    ("--compile", "MEMBUDGET_COMPILE",
     "plan (default): split torch.compile'd graphs into forward and backward under the budget; off"),
)
_VALUE_FLAGS = frozenset(flag for flag, _, _ in _RUN_SETTINGS)


class _UsageError(Exception):
    """A command-line error reported as ``membudget: error: ...`` with exit 2."""


def _build_parser() -> Tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run PyTorch training under a device-memory budget.",
        epilog="Settings also come from MEMBUDGET_* environment variables; see `membudget info`.",
    )
    parser.add_argument("--version", action="store_true", help="print membudget's version and exit")
    commands = parser.add_subparsers(dest="command", metavar="command")
    run = commands.add_parser(
        "run",
        help="run a script (or -m module) with membudget installed before its first line",
        usage=f"{PROG} run [options] [--] script.py [args ...]\n       {PROG} run [options] -m module [args ...]",
        description="Install membudget, then run a script or module as __main__, as python would. "
        "Flags override the matching MEMBUDGET_* environment variables.",
        allow_abbrev=False,  # the argv split below must know every flag by its full name
    )
    for flag, variable, help_text in _RUN_SETTINGS:
        run.add_argument(flag, metavar="VALUE", help=f"{help_text} [{variable}]")
    run.add_argument("--stats", action="store_true", help="print membudget.stats() to stderr at exit")
    commands.add_parser("demo", help="run the built-in demo (arguments go to the demo)", add_help=False)
    commands.add_parser("info", help="print versions, build info and the active configuration")
    from membudget import sim_cli

    sim_cli.add_parser(commands)
    return parser, run


def _split_run_arguments(tokens: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Split ``run``'s arguments into membudget's options and the target, the way
    ``python`` does: options end at ``--``, at ``-m`` or at the first word that
    is not an option; everything after belongs to the script."""
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if token == "--":
            return list(tokens[:index]), list(tokens[index + 1:])
        if token.startswith("-m") or not token.startswith("-") or token == "-":
            return list(tokens[:index]), list(tokens[index:])
        index += 2 if token in _VALUE_FLAGS else 1
    return list(tokens), []


def _apply_settings(options: argparse.Namespace) -> None:
    """Validate each given flag, then the whole resulting environment, and only
    then write the flags into ``os.environ``, so that a bad value changes
    nothing and install() sees exactly what was validated."""
    from membudget.config import Config, ConfigError, parse_value

    updates = {}
    for flag, variable, _ in _RUN_SETTINGS:
        value = getattr(options, flag[2:].replace("-", "_"))
        if value is None:
            continue
        try:
            parse_value(variable, value, label=flag)
        except ConfigError as error:
            raise _UsageError(str(error)) from None
        updates[variable] = value
    try:
        Config.from_env({**os.environ, **updates})
    except ConfigError as error:
        raise _UsageError(str(error)) from None
    os.environ.update(updates)


def _module_exists(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _print_stats_at_exit() -> None:
    import membudget

    try:
        stats = membudget.stats()
    except Exception as error:  # the script may have left things half torn down
        print(f"membudget: stats unavailable: {error}", file=sys.stderr)
        return
    print(f"membudget stats:\n{stats}", file=sys.stderr)


# Note [Launchers run their workers under membudget]: ``membudget run
# torchrun --nproc-per-node 8 train.py`` used to install membudget in the
# launcher, which trains nothing, while the workers it started ran as plain
# ``python train.py``: unmanaged, silently. (On a GPU machine it would also
# have opened a CUDA context on device 0 in the launcher.) Now the launcher
# runs uninstalled, and its worker command becomes ``-m membudget run
# train.py``, which each worker installs from the settings the launcher's
# flags wrote into the environment, on its LOCAL_RANK's device (Note [Device
# chosen before torch.cuda starts] in _runtime.py). The launcher's own parser
# finds where its options end, so its flags stay as given.
_LAUNCHER_MODULES = frozenset({"torch.distributed.run"})
_LAUNCHER_SCRIPTS = frozenset({"torchrun"})


def _workers_under_membudget(launcher_args: Sequence[str], stats: bool) -> List[str]:
    """The launcher's arguments with its worker command run through
    ``membudget run`` (Note [Launchers run their workers under membudget])."""
    from torch.distributed.run import get_args_parser

    launcher_args = list(launcher_args)
    parsed = get_args_parser().parse_args(launcher_args)
    if parsed.no_python:
        raise _UsageError(
            "the launcher's workers are not Python (--no-python): put membudget in the worker "
            "command instead, e.g. torchrun --no-python ... membudget run train.py")
    position = len(launcher_args) - len(parsed.training_script_args) - 1
    if position < 0 or launcher_args[position] != parsed.training_script:
        raise _UsageError("cannot tell where the launcher's options end: put membudget in the worker "
                          "command instead, e.g. torchrun ... -m membudget run train.py")
    worker = ["run"] + (["--stats"] if stats else []) + (["-m"] if parsed.module else [])
    worker += [parsed.training_script, *parsed.training_script_args]
    # As a module: the launcher then runs `python -m membudget run ...`.
    module_flag = [] if parsed.module else ["--module"]
    return launcher_args[:position] + module_flag + ["membudget"] + worker


def _run_command(tokens: Sequence[str], run_parser: argparse.ArgumentParser) -> object:
    option_tokens, target = _split_run_arguments(tokens)
    options = run_parser.parse_args(option_tokens)
    module: Optional[str] = None
    if target and target[0].startswith("-m"):
        module = target[0][2:] or (target[1] if len(target) > 1 else None)
        script_args = target[1:] if target[0][2:] else target[2:]
        if not module:
            run_parser.error("-m needs a module name")
    elif target and not os.path.isfile(target[0]) and target[0] in _LAUNCHER_SCRIPTS:
        module, script_args = "torch.distributed.run", target[1:]  # torchrun's own entry point
    elif target:
        script, script_args = target[0], target[1:]
        if not os.path.isfile(script):
            run_parser.error(f"cannot run {script!r}: no such file")
        if os.path.basename(script) in _LAUNCHER_SCRIPTS:
            module = "torch.distributed.run"
    else:
        run_parser.error("missing script: give script.py [args ...] or -m module [args ...]")
    try:
        _apply_settings(options)
    except _UsageError as error:
        run_parser.error(str(error))
    if module in _LAUNCHER_MODULES:
        try:
            launcher_args = _workers_under_membudget(script_args, options.stats)
        except _UsageError as error:
            run_parser.error(str(error))
        from torch.distributed.run import main as run_launcher  # torchrun's entry point

        sys.argv = ["torchrun", *launcher_args]
        try:
            run_launcher(launcher_args)
        except SystemExit as exit_request:
            return exit_request.code
        return 0

    import membudget

    install = getattr(membudget, "install", None)
    if install is None:
        print(f"{PROG}: error: membudget.install() is not available in this build", file=sys.stderr)
        return 1
    install()
    if options.stats:
        atexit.register(_print_stats_at_exit)

    if module is not None:
        sys.path[0] = os.getcwd()  # as `python -m`: the module is found from here
        if not _module_exists(module):
            run_parser.error(f"cannot run -m {module}: no module named {module!r}")
    from membudget._runtime import let_collective_threads_finish

    try:
        if module is not None:
            sys.argv = [module, *script_args]  # run_module replaces argv[0] with the file
            script_globals = runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *script_args]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            script_globals = runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_request:
        # The script's globals go with the exception, as this returns.
        let_collective_threads_finish()
        return exit_request.code
    let_collective_threads_finish()
    del script_globals  # the script's objects (a DDP model, its process group) go here
    return 0


def main(argv: Optional[Sequence[str]] = None) -> object:
    """Entry point of the ``membudget`` command: parse ``argv`` (default
    ``sys.argv[1:]``) and run the ``run``, ``demo``, ``info`` or ``simulate``
    subcommand.
    Returns the exit status for ``sys.exit`` (for ``run``, the script's own
    ``SystemExit`` code); usage errors exit 2 with a message naming the bad
    flag or variable."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    parser, run_parser = _build_parser()
    if tokens and tokens[0] == "run":
        return _run_command(tokens[1:], run_parser)
    if tokens and tokens[0] == "demo":
        from membudget import demo

        return demo.main(tokens[1:])
    args = parser.parse_args(tokens)
    if args.version:
        from membudget.info import membudget_version

        print(f"{PROG} {membudget_version()}")
        return 0
    if args.command == "info":
        from membudget import info

        return info.main()
    if args.command == "simulate":
        from membudget import sim_cli

        return sim_cli.main(args)
    parser.print_help(sys.stderr)
    return 2
