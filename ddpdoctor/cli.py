"""The command line: the only place that prints usage errors and picks the exit code.

Exit codes follow the Nagios plugin convention: 0 OK, 1 warning, 2 critical,
3 unknown (ddpdoctor itself could not run).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import warnings
import tempfile
from typing import Any, Callable, NoReturn, Optional, Sequence

from ddpdoctor import __version__
from ddpdoctor.core.errors import UsageError
from ddpdoctor.runtime.rank_state import Terminated
from ddpdoctor.core.exits import EXIT_UNKNOWN, hard_exit

DEBUG_VAR = "DDPDOCTOR_DEBUG"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _bounded(convert: Callable[[str], Any], what: str, lo: float, hi: float) -> Callable[[str], Any]:
    """An argparse type: `what` converted by `convert`, within [lo, hi], or a one-line error."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {what} from {lo:g} to {hi:g}")
        return value

    return parse


_positive_int = _bounded(int, "a whole number", 1, 65536)
_seconds = _bounded(float, "a number of seconds", 0.5, 86400)
_port = _bounded(int, "a port number", 1, 65535)
_percent = _bounded(float, "a percentage", 1, 90)


def _size(text: str) -> int:
    from ddpdoctor.judge.busbw import parse_size

    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, or a number with K, M or G") from None
    if not 1 <= value <= 2**40:
        raise argparse.ArgumentTypeError(f"{text} is out of range: give 1 byte to 1024G")
    return value



def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of world sizes, e.g. 1,2,4") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give world sizes of 1 or more, e.g. 1,2,4")
    return sizes


def _targets(text: str) -> tuple[tuple[int, float], ...]:
    points = []
    for part in text.split(","):
        n, sep, pct = part.partition(":")
        try:
            point = (int(n), float(pct))
        except ValueError:
            point = (0, -1.0)
        if not sep or point[0] < 2 or not 1 <= point[1] <= 100:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r}: give RANKS:PERCENT pairs, e.g. 2:95,8:80")
        points.append(point)
    return tuple(sorted(points))


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="MODULE:FUNCTION",
                        help="train your own model instead of the built-in one: FUNCTION() returns a torch.nn.Module "
                             "(module path or path/to/file.py; see docs/scaling.md)")
    parser.add_argument("--batch", default=None, metavar="MODULE:FUNCTION",
                        help="with --model: FUNCTION(batch_size) returns (inputs, targets)")


def _add_run_args(parser: argparse.ArgumentParser) -> None:
    """What every command that starts ranks takes."""
    parser.add_argument("--nproc", type=_positive_int, help="local ranks to spawn (default: visible GPUs, else 2)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--timeout", type=_seconds, default=None,
                        help="deadline in seconds for each stage (rendezvous, init, each probe step); default 30")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument("--inject", default=None,
                        help="make a rank misbehave on purpose, e.g. crash:rank=1:stage=train (also DDPDOCTOR_INJECT)")
    parser.add_argument("--port", type=_port, default=None,
                        help="standalone: loopback port for the rendezvous store (default: a free one)")
    parser.add_argument("--no-live", action="store_true", help="no live view of the ranks while they run")
    _add_trace_arg(parser)
    _add_html_arg(parser)
    _add_force_arg(parser)


def _add_html_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--html", dest="html_path", metavar="PATH",
                        help="also write the report as one self-contained HTML page: verdict, findings, charts, the "
                             "ranks' timeline (charts: pip install 'ddpdoctor[html]'; docs/pictures_html.md)")


def _add_trace_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", dest="trace_path", metavar="PATH",
                        help="also write a timeline of the ranks (Chrome trace-event JSON: open it in ui.perfetto.dev "
                             "or chrome://tracing; see docs/pictures.md)")


def _add_force_arg(parser: argparse.ArgumentParser, top_level: bool = False) -> None:
    """--force, before or after the subcommand. The subcommand's copy has no default, so it
    cannot reset a top-level `ddpdoctor --force check` to False (argparse copies every
    default of the subparser over the namespace)."""
    parser.add_argument("--force", action="store_true", default=False if top_level else argparse.SUPPRESS,
                        help="overwrite existing output files (--json, --csv, --plot, --out, --trace, --html); without it an "
                             "existing file is an error, checked before anything runs")


def _add_history_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--history", default=None, metavar="PATH",
                        help="also append this run to the history store PATH, a SQLite file many nodes may share "
                             "(also DDPDOCTOR_HISTORY; see docs/fleet.md)")


def _add_prom_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prom", dest="prom_path", metavar="PATH",
                        help="also write the verdict, findings and measured speeds as Prometheus metrics for "
                             "node_exporter's textfile collector (replaced on every run; see docs/fleet.md)")


def _date(text: str) -> float:
    """--since: an ISO date or date-time (UTC unless it says otherwise), as unix seconds."""
    import datetime

    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date: give YYYY-MM-DD or YYYY-MM-DDTHH:MM") from None
    return (when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)).timestamp()


def _add_history_command(sub: Any) -> None:
    hist = sub.add_parser("history", help="judge a history store: nodes that drift, lemon nodes, rising GPU counters",
                          description="Read the runs recorded with --history and say, per node, how its measured "
                                      "speed compares with the fleet's median of the same model over time, which "
                                      "node got slower (and since when), which fails more often than its peers, and "
                                      "which GPU's memory error counters keep rising. Exit code as check's.")
    hist.add_argument("store", metavar="PATH", help="the history store (a SQLite file written by --history)")
    hist.add_argument("--json", dest="json_path", metavar="PATH", help="also write the verdicts as JSON to PATH")
    hist.add_argument("--since", type=_date, default=None, metavar="DATE", help="only runs from DATE on (YYYY-MM-DD)")
    hist.add_argument("--node", default=None, metavar="NODE", help="show one node (judged against the whole fleet)")
    hist.add_argument("--plot", dest="plot_path", metavar="PNG", help="also plot each node against its fleet (matplotlib)")
    _add_force_arg(hist)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddpdoctor",
                     description="Diagnose PyTorch DDP jobs: what is wrong, on which rank and node, and the fix.")
    parser.add_argument("--version", action="version", version=f"ddpdoctor {__version__}")
    _add_force_arg(parser, top_level=True)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    check = sub.add_parser("check", help="run the probes on every rank and report",
                           description="Run the probes on every rank. With no rank variables in the environment, "
                                       "spawns --nproc local ranks; under torchrun or srun, each process is one rank.")
    _add_run_args(check)
    _add_history_arg(check)
    _add_prom_arg(check)
    check.add_argument("--probes", default=None, help="comma-separated probe names, 'all' or 'default' (see `ddpdoctor probes`)")
    check.add_argument("--steps", type=_positive_int, default=None,
                       help="measured DDP training steps (default 5; stragglers: as many as --straggler-seconds allow)")
    check.add_argument("--straggler-seconds", type=_bounded(float, "a number of seconds", 0.5, 3600), default=5.0,
                       metavar="S", help="stragglers: how long to measure training steps (default 5)")
    check.add_argument("--slow-threshold", type=_percent, default=None, metavar="PCT",
                       help="flag a rank this many percent slower than its peers (homogeneity: default 10 on "
                            "GPUs, 20 on CPU ranks; stragglers: 8 on GPUs, 10 on CPU ranks)")
    _add_model_args(check)
    scaling = sub.add_parser("scaling", help="measure speedup and efficiency at 1, 2, 4, ... ranks, and why it is lost",
                             description="Train the same per-rank batch on the first 1, 2, 4, ... of the launched "
                                         "ranks (weak scaling): samples/s, speedup and efficiency per size against "
                                         "a target, the time each size loses split into communication, stragglers, "
                                         "data and slower compute, and DDP settings measured on this model.")
    _add_run_args(scaling)
    _add_model_args(scaling)
    scaling.add_argument("--sizes", type=_sizes, default=None, metavar="N,N,...",
                         help="world sizes to measure (default 1, 2, 4, ... and all ranks)")
    scaling.add_argument("--seconds", type=_bounded(float, "a number of seconds", 0.1, 600), default=2.0, metavar="S",
                         help="training time per size (default 2; --steps fixes the step count instead)")
    scaling.add_argument("--steps", type=_positive_int, default=None, help="timed steps per size (default: from --seconds)")
    scaling.add_argument("--batch-size", type=_bounded(int, "a whole number", 1, 1 << 20), default=32,
                         metavar="B", help="samples per rank per step, the same at every size (default 32)")
    scaling.add_argument("--no-knobs", action="store_true", help="do not time DDP settings at the largest size")
    scaling.add_argument("--lr", type=_bounded(float, "a learning rate", 1e-12, 1e6), default=None,
                         help="the learning rate tuned for one rank: the report says what it becomes at N ranks")
    scaling.add_argument("--min-efficiency", type=_targets, default=None, metavar="N:PCT,...",
                         help="efficiency targets by world size (default 2:95,8:80; linear in log2 between)")
    bench = sub.add_parser("allreduce-bench", help="measure collective bandwidth (algbw/busbw as nccl-tests) and find slow links",
                           description="Sweep message sizes through torch.distributed on every rank, as nccl-tests "
                                       "does: time per call (slowest rank), algbw and busbw from the median, every "
                                       "result checked, and a ring of rank pairs to find a slow link. Runs standalone, "
                                       "under torchrun or under srun, like `check`.")
    _add_run_args(bench)
    _add_history_arg(bench)
    _add_prom_arg(bench)
    from ddpdoctor.judge.busbw import OPS

    bench.add_argument("--op", choices=OPS, default="all_reduce", help="the collective (default all_reduce)")
    bench.add_argument("--min-bytes", type=_size, default=None, metavar="SIZE",
                       help="smallest size, e.g. 8, 1K, 4M (default 8 on GPU, 1K on CPU)")
    bench.add_argument("--max-bytes", type=_size, default=None, metavar="SIZE",
                       help="largest size (default 256M on GPU, 32M on CPU)")
    bench.add_argument("--factor", type=_bounded(int, "a whole number", 2, 1024), default=None,
                       help="size multiplier between steps (default 2 on GPU, 4 on CPU)")
    bench.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float64", "int32"), default="float32")
    bench.add_argument("--warmup", type=_bounded(int, "a whole number", 0, 1000), default=5,
                       help="untimed iterations per size (default 5)")
    bench.add_argument("--iters", type=_bounded(int, "a whole number", 1, 10000), default=20,
                       help="timed iterations per size (default 20)")
    bench.add_argument("--no-check", action="store_true", help="do not check results (saves one call per size)")
    bench.add_argument("--localise", choices=("auto", "always", "never"), default="auto",
                       help="time each ring pair of ranks to find a slow link (auto: with 3 or more ranks)")
    bench.add_argument("--min-busbw", type=_bounded(float, "a bandwidth in GB/s", 0.0001, 1e6), default=None,
                       metavar="GBPS", help="fail (exit 2) when busbw at the largest size is below this")
    bench.add_argument("--nccl-algo", dest="nccl_algorithms", action="store_true",
                       help="record the algorithm NCCL chose per size (all_reduce and broadcast; rank 0 logs "
                            "every call while on, unless NCCL_DEBUG is already set)")
    bench.add_argument("--csv", dest="csv_path", metavar="PATH", help="also write the size table as CSV")
    bench.add_argument("--plot", dest="plot_path", metavar="PATH", help="also plot busbw vs size (.svg; .png needs matplotlib)")
    sub.add_parser("probes", help="list the probes with one line each")
    snap = sub.add_parser("snapshot", help="record this node's facts to a JSON file (for a bug report or `diagnose`)",
                          description="Read this node's hardware, software, GPU health and environment (secrets "
                                      "redacted) and measure each device's matmul speed, without starting ranks.")
    snap.add_argument("--out", metavar="FILE", help="where to write it (default ddpdoctor-snapshot-HOST.json)")
    snap.add_argument("--no-measure", action="store_true", help="read facts only, skip the matmul measurement")
    _add_force_arg(snap)
    _add_history_arg(snap)
    _add_history_command(sub)
    diag = sub.add_parser("diagnose", help="diagnose snapshots (one per node) or earlier JSON reports",
                          description="Judge snapshot files from several nodes, or `check --json` reports, as if "
                                      "their ranks were one job: ranks are numbered file by file.")
    diag.add_argument("files", nargs="+", metavar="FILE", help="snapshot or report JSON files")
    diag.add_argument("--json", dest="json_path", metavar="PATH", help="also write the diagnosis as JSON to PATH")
    diag.add_argument("--slow-threshold", type=_percent, default=None, metavar="PCT",
                      help="flag a rank this many percent slower than its peers (default 10 on GPUs, 20 on CPU)")
    diag.add_argument("--trace", dest="trace_path", metavar="PATH",
                      help="also draw the one `check --json` report given as a timeline (Chrome trace-event JSON for "
                           "ui.perfetto.dev): its ranks' stages, measured steps and findings")
    _add_html_arg(diag)
    _add_force_arg(diag)
    expl = sub.add_parser("explain", help="explain a failed job from its logs and Flight Recorder dumps",
                          description="Read the output of a failed job (files, folders, - for stdin; plain or "
                                      "gzip; torchrun, srun --label or plain logs; Flight Recorder dumps) and say "
                                      "which rank failed first, why, which ranks it dragged down, and the fix.")
    expl.add_argument("logs", nargs="+", metavar="LOG", help="log files, folders of them, or - for standard input")
    expl.add_argument("--json", dest="json_path", metavar="PATH", help="also write the explanation as JSON to PATH")
    _add_html_arg(expl)
    expl.add_argument("--world-size", type=_positive_int, default=None, metavar="N",
                      help="the job's number of ranks, when its logs do not say (ranks that printed nothing count)")
    expl.add_argument("--all", action="store_true", help="every rank and every timeline entry, not the first few")
    expl.add_argument("--exit-code", dest="exit_code_mode", choices=("verdict", "requeue"), default="verdict",
                      help="verdict (default): 0 OK, 1 warning, 2 critical; requeue: whether to run the job again, "
                           "as codes a job script or Kubeflow's restartPolicy: ExitCode acts on (docs/explain.md)")
    _add_force_arg(expl)
    sub.add_parser("run", parents=[_run_options()], add_help=False, help="run a training script with the Doctor "
                   "attached, unedited (in it, under torchrun or srun, or around a launcher)",
                   usage=RUN_USAGE, description=RUN_DESCRIPTION)
    return parser


RUN_USAGE = ("ddpdoctor run [OPTIONS] SCRIPT [ARGS...]\n       ddpdoctor run [OPTIONS] -m MODULE [ARGS...]\n"
             "       ddpdoctor run [OPTIONS] -- COMMAND [ARGS...]   (torchrun, accelerate launch, python ...)")
RUN_DESCRIPTION = ("Run a training script as it would run without ddpdoctor, with the callback (ddpdoctor.Doctor) "
                   "attached to the DDP model it builds, its optimizer's steps and the DataLoader it iterates; "
                   "Lightning and Hugging Face Trainers get their adapters. Inside a launcher: torchrun "
                   "--nproc_per_node=N -m ddpdoctor run train.py ARGS, or srun python -m ddpdoctor run train.py. "
                   "The exit status is the script's. docs/callback.md, `ddpdoctor run`.")


def _run_options() -> _Parser:
    """The Doctor's options as `ddpdoctor run` takes them (callback/options.py checks their values)."""
    p = _Parser(prog="ddpdoctor run", add_help=False, usage=RUN_USAGE, description=RUN_DESCRIPTION)
    p.add_argument("-h", "--help", action="help", help="show this help and exit")
    p.add_argument("--json", dest="json_path", metavar="PATH",
                   help="rank 0's report (findings and the run summary) as JSON; other ranks write PATH.rank<N> "
                        "where they have findings")
    p.add_argument("--trace", dest="trace_path", metavar="PATH",
                   help="rank 0's timeline of the run (Chrome trace-event JSON for ui.perfetto.dev): every rank's kept "
                        "steps as data, compute and waiting for peers, the findings, a hang's stuck rank")
    p.add_argument("--html", dest="html_path", metavar="PATH",
                   help="rank 0's report at the end as one self-contained HTML page (findings, the summary's chart, "
                        "the timeline; charts: pip install 'ddpdoctor[html]')")
    p.add_argument("--every", type=_positive_int, metavar="N", help="steps between two checks at least (default 50)")
    p.add_argument("--check-every-s", type=_bounded(float, "a number of seconds", 0, 3600), metavar="S",
                   help="seconds of training between two checks at least (default 2; 0: by --every alone)")
    p.add_argument("--step-deadline", dest="step_deadline_s", type=_seconds, metavar="S",
                   help="the longest a step may take before it is called hung (default 600; learned below it)")
    p.add_argument("--on-hang", choices=("report", "exit"),
                   help="report (default): name a hang and keep waiting; exit: name it, then end the rank")
    p.add_argument("--history", metavar="PATH", help="the fleet history store rank 0 appends the run to (docs/fleet.md)")
    p.add_argument("--batch-size", type=_positive_int, metavar="N",
                   help="samples per rank and step, where the batch the model sees does not show it")
    p.add_argument("--tensorboard", metavar="DIR", help="write each check's numbers as TensorBoard scalars to DIR")
    p.add_argument("--no-measure-comm", dest="measure_comm", action="store_false", default=None,
                   help="do not read the gradient all-reduce's wait from DDP's timers")
    p.add_argument("--no-summary", dest="summary", action="store_false", default=None,
                   help="no run summary on the terminal at the end (it stays in the JSON)")
    return p


def _run(tokens: list[str]) -> int:
    """`ddpdoctor run`: the script's own exit status; 3 (one line) where ddpdoctor's own arguments are wrong.
    Ctrl-C in a script run here ends its Doctor first, then ends this process as it would have ended it."""
    import shutil

    from ddpdoctor import autorun
    from ddpdoctor.attach import command, script
    from ddpdoctor.attach.settings import RunSettings
    from ddpdoctor.callback.options import checked

    parser = _run_options()
    takes_value = {o for a in parser._actions if a.nargs != 0 for o in a.option_strings}
    split = command.split(tokens, takes_value)
    parsed = parser.parse_args(split.options)  # --help prints and exits 0 (main catches SystemExit)
    if split.target is None and split.command is None:
        raise UsageError("give the training script (or -m MODULE, or -- COMMAND): ddpdoctor run train.py ARGS")
    options = command.absolute({k: v for k, v in vars(parsed).items() if v is not None})
    try:
        checked(options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if split.target is not None:
        split.target.check()
    settings = RunSettings(options=options, run_dir=tempfile.mkdtemp(prefix="ddpdoctor-run-"))
    try:
        if split.command is not None:
            status = command.run_around(split.command, settings)
        else:
            assert split.target is not None
            os.environ.update({k: v for k, v in settings.environment(dict(os.environ)).items()
                               if os.environ.get(k) != v})  # so the script's own children attach (mp.spawn)
            autorun.start(settings)
            try:
                status = script.run(split.target)
            except KeyboardInterrupt:
                autorun.finish()
                raise
            autorun.finish()
        command.report_unattached(settings, options.get("json_path"), status)
        return status
    finally:
        shutil.rmtree(settings.run_dir or "", ignore_errors=True)


def _check_output_path(flag: str, path: Optional[str]) -> None:
    """Refuse an unwritable output before measuring anything, not after."""
    if path is None:
        return
    if not path.strip():
        raise UsageError(f"{flag} {path!r}: give a file path")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{flag} {path}: folder {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"{flag} {path}: folder {directory} is not writable")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a folder: give a file path")
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        # Writes are a rename onto the path: over /dev/null (as root) that would replace the device.
        raise UsageError(f"{flag} {path} is not a regular file (a device, FIFO or socket): give a file path")
    problem = _cannot_create_in(directory)
    if problem:
        raise UsageError(f"{flag} {path}: cannot create a file in {directory} ({problem}): "
                         "give a path in a writable folder")


def _cannot_create_in(directory: str) -> Optional[str]:
    """Why no file can be made in `directory`, or None. os.access tells root yes in /proc
    and /sys, where the write would fail only after the measuring."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".ddpdoctor-", suffix=".tmp", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(probe)
    return None


def _refuse_existing(outputs: Sequence[tuple[str, Optional[str]]], force: bool) -> None:
    """Before any rank starts or anything is measured: an existing output is never replaced
    silently, and two outputs never share a file (the second would land on a sibling name)."""
    seen: dict[str, str] = {}
    for flag, path in outputs:
        if not path:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise UsageError(f"{seen[real]} and {flag} both name {path}: give each its own file")
        seen[real] = flag
        if not force and os.path.lexists(path):
            raise UsageError(f"{path} already exists: pass --force to overwrite it, or choose another {flag} path")


def _config(args: argparse.Namespace):
    from ddpdoctor import probes
    from ddpdoctor.runtime.config import DEFAULT_TIMEOUT_S, BenchConfig, CheckConfig
    from ddpdoctor.core.faults import ENV_VAR, parse_faults

    _check_output_path("--json", args.json_path)
    spec = args.inject if args.inject is not None else os.environ.get(ENV_VAR)
    common = dict(nproc=args.nproc, backend=args.backend, device=args.device,
                  timeout_s=args.timeout if args.timeout is not None else DEFAULT_TIMEOUT_S,
                  json_path=args.json_path, force=args.force, inject=parse_faults(spec), port=args.port,
                  live=not args.no_live, prom_path=getattr(args, "prom_path", None), trace_path=args.trace_path,
                  html_path=args.html_path)
    if args.command == "allreduce-bench":
        # topology first: it is quick, and its links give the bandwidth the sweep is measured against.
        return CheckConfig(probes=("topology", "allreduce"), command="allreduce-bench", bench=_bench_config(args),
                           **common)
    model = _model_spec(args)
    if args.command == "scaling":
        from ddpdoctor.runtime.config import DEFAULT_EFFICIENCY_TARGETS, ScalingConfig

        scaling = ScalingConfig(sizes=args.sizes or (), seconds_per_size=args.seconds, batch=args.batch_size,
                                knobs=not args.no_knobs, lr=args.lr,
                                targets=args.min_efficiency or DEFAULT_EFFICIENCY_TARGETS)
        return CheckConfig(probes=("scaling",), command="scaling", steps=args.steps, scaling=scaling, model=model,
                           **common)
    names = probes.select(args.probes)
    if not names:  # "--probes ," : a check of nothing would say OK
        raise UsageError(f"--probes {args.probes!r} names no probe: give names from `ddpdoctor probes`, "
                         "'default' or 'all'")
    # Inside check the allreduce probe is a quick look (the same sweep, fewer iterations);
    # `allreduce-bench` is the full measurement.
    return CheckConfig(probes=names, steps=args.steps, straggler_s=args.straggler_seconds,
                       slow_threshold_pct=args.slow_threshold, model=model,
                       bench=BenchConfig(warmup=2, iters=5), **common)


def _model_spec(args: argparse.Namespace) -> Any:
    """--model/--batch resolved now: a wrong path is one line before any rank starts, and the
    launcher (not every rank) also builds the model once and runs a batch through it."""
    from ddpdoctor.runtime import launch_env
    from ddpdoctor.runtime.user_model import ModelSpec, resolve, validate

    spec = ModelSpec(model=args.model, batch=args.batch)
    if spec.model is None and spec.batch is None:
        return spec
    if spec.model is None or spec.batch is None or launch_env.detect(os.environ) is None:
        validate(spec)  # also says that the two go together
    else:  # a rank under torchrun or srun: import only; building the model is the rank's work
        resolve(spec.model, "--model")
        resolve(spec.batch, "--batch")
    return spec


def _check_plot_path(path: str) -> None:
    """Before any rank starts: a plot that cannot be made is a usage error, not a lost run."""
    import importlib.util

    from ddpdoctor.probes.allreduce.outputs import PLOT_SUFFIXES

    suffix = os.path.splitext(path)[1].lower()
    if suffix not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {path}: give a {' or '.join(PLOT_SUFFIXES)} path")
    if suffix == ".png" and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"--plot {path} needs matplotlib (pip install matplotlib), or give a .svg path")


def _bench_config(args: argparse.Namespace):
    from ddpdoctor.measure import nccl_tuning
    from ddpdoctor.runtime.config import BenchConfig

    if args.min_bytes is not None and args.max_bytes is not None and args.min_bytes > args.max_bytes:
        raise UsageError(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if args.nccl_algorithms and args.op not in nccl_tuning.SIZES_AGREE:
        raise UsageError(f"--nccl-algo records NCCL's choices for {' and '.join(nccl_tuning.SIZES_AGREE)} only "
                         f"(its logged sizes for {args.op} differ between NCCL versions); drop --nccl-algo or "
                         f"use --op all_reduce")
    _check_output_path("--csv", args.csv_path)
    _check_output_path("--plot", args.plot_path)
    if args.plot_path:
        _check_plot_path(args.plot_path)
    return BenchConfig(op=args.op, min_bytes=args.min_bytes, max_bytes=args.max_bytes, factor=args.factor,
                       dtype=args.dtype, warmup=args.warmup, iters=args.iters, check=not args.no_check,
                       localise=args.localise, min_busbw_gbps=args.min_busbw, csv_path=args.csv_path,
                       plot_path=args.plot_path, nccl_algorithms=args.nccl_algorithms)


def _check(args: argparse.Namespace, argv: list[str]) -> int:
    from ddpdoctor.runtime import launch_env

    outputs = [("--json", args.json_path), ("--csv", getattr(args, "csv_path", None)),
               ("--plot", getattr(args, "plot_path", None)), ("--trace", args.trace_path), ("--html", args.html_path)]
    for flag, path in outputs + [("--prom", getattr(args, "prom_path", None))]:  # --prom is rewritten each run
        _check_output_path(flag, path)
    if launch_env.LAUNCHER_PID_VAR not in os.environ:
        # First of all (before --model is built and tried): the process that may write the
        # report checks its outputs. That is our launcher, or under torchrun/srun every rank
        # (any may become the reporter). The ranks our launcher spawns write nothing.
        _refuse_existing(outputs, args.force)
    recording = _begin_recording(args)
    cfg = _config(args)
    env = launch_env.detect(os.environ)
    launch_env.check_thread_vars(os.environ)
    command = ["ddpdoctor", *argv]
    if env is None:
        from ddpdoctor.session.launcher import run_standalone

        return _finish_recording(recording, run_standalone(cfg, argv, command))
    from ddpdoctor.session.rank import run_rank

    code = _finish_recording(recording, run_rank(cfg, env, command))
    # Everything this rank knows is published and flushed; interpreter teardown with torch
    # loaded costs about a second per rank and can itself hang on a broken backend.
    sys.stdout.flush()
    sys.stderr.flush()
    hard_exit(code)


def _begin_recording(args: argparse.Namespace) -> Any:
    """--history (or DDPDOCTOR_HISTORY) on the process that may report: the report goes to a
    private file, and from it to --json and the store once the run is over (history/recording.py)."""
    from ddpdoctor.history.recording import begin, store_path
    from ddpdoctor.history.store import HistoryError
    from ddpdoctor.runtime.launch_env import LAUNCHER_PID_VAR

    store = store_path(getattr(args, "history", None), os.environ) if hasattr(args, "history") else None
    if store is None or LAUNCHER_PID_VAR in os.environ:
        return None
    try:
        recording = begin(store, args.json_path, args.force)
    except HistoryError as exc:  # a path that cannot be a store: refused before anything runs
        raise UsageError(str(exc)) from None
    args.json_path = recording.report_path
    return recording


def _finish_recording(recording: Any, code: int) -> int:
    """The run's exit code, or 3 with one line when the store refused the run (its report is written)."""
    problem = recording.finish() if recording is not None else None
    if problem:
        sys.stderr.write(f"ddpdoctor: error: {one_line(problem)}\n")
        return EXIT_UNKNOWN
    return code


def _snapshot(args: argparse.Namespace) -> int:
    from ddpdoctor.history.recording import store_path
    from ddpdoctor.history.store import HistoryError, check_path
    from ddpdoctor.snapshot import default_snapshot_path, take_snapshot, write_snapshot

    out = args.out if args.out is not None else default_snapshot_path()
    _check_output_path("--out", out)
    _refuse_existing([("--out", out)], args.force)
    store = store_path(args.history, os.environ)
    if store is not None:
        try:
            check_path(store)
        except HistoryError as exc:
            raise UsageError(str(exc)) from None
    snapshot = take_snapshot(measure=not args.no_measure)
    path = write_snapshot(snapshot, out, overwrite=args.force)
    devices = snapshot["probes"]["homogeneity"]
    print(f"ddpdoctor: wrote {path}: {len(devices)} device{'s' if len(devices) != 1 else ''} on {snapshot['host']} "
          f"({', '.join(sorted({d['device'] for d in devices}))}); secrets in the environment are redacted")
    return _record_snapshot(snapshot, store)


def _record_snapshot(snapshot: dict[str, Any], store: Optional[str]) -> int:
    """--history on a snapshot: 0, or 3 with one line when the store refused it (the file is written)."""
    from ddpdoctor.history.record import from_snapshot
    from ddpdoctor.history.store import HistoryError, append

    if store is None:
        return 0
    try:
        append(store, from_snapshot(snapshot))
    except HistoryError as exc:
        sys.stderr.write(f"ddpdoctor: error: {one_line(str(exc))} (the snapshot file is written)\n")
        return EXIT_UNKNOWN
    return 0


def _check_reports(files: list[str]) -> list[dict[str, Any]]:
    """The `check --json` reports among diagnose's files (what their ranks ran is what is drawn)."""
    from ddpdoctor.render.trace_check import is_check_report

    reports = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue  # said below as the diagnosis reads it
        if is_check_report(data):
            reports.append(data)
    return reports


def _one_check_report(files: list[str]) -> dict[str, Any]:
    """--trace on diagnose: the one `check --json` report among the files (its ranks' stages are what is drawn)."""
    reports = _check_reports(files)
    if len(reports) != 1:
        raise UsageError(f"--trace draws one `ddpdoctor check --json` report; {len(reports)} given among the files: "
                         "give exactly one")
    return reports[0]


def _diagnose(args: argparse.Namespace) -> int:
    from ddpdoctor.render.console import make_console, render_diagnosis
    from ddpdoctor.core.files import atomic_write_json
    from ddpdoctor.snapshot import diagnose_inputs, read_inputs

    outputs = [("--json", args.json_path), ("--trace", args.trace_path), ("--html", args.html_path)]
    for flag, path in outputs:
        _check_output_path(flag, path)
    _refuse_existing(outputs, args.force)
    report = _one_check_report(args.files) if args.trace_path else None
    reports = _check_reports(args.files) if args.html_path else []
    inputs = read_inputs(args.files)
    if args.slow_threshold is not None:
        inputs.settings["slow_threshold_pct"] = args.slow_threshold
    diagnosis = diagnose_inputs(inputs)
    if args.json_path:
        atomic_write_json(diagnosis.to_json(), args.json_path, overwrite=args.force)
    if report is not None:
        from ddpdoctor.render.trace_check import from_report

        atomic_write_json(from_report(report).to_json(), args.trace_path, overwrite=args.force)
    if args.html_path:
        from ddpdoctor.render import html_report

        html_report.write(args.html_path, "diagnose", diagnosis.to_json(), reports=reports, overwrite=args.force)
    for line in inputs.unreadable:  # the other files are judged below; these could not be
        sys.stderr.write(f"ddpdoctor: error: {one_line(line)}\n")
    render_diagnosis(diagnosis, make_console())
    return diagnosis.exit_code


def _explain(args: argparse.Namespace) -> int:
    from ddpdoctor.explain.command import explain
    from ddpdoctor.render.console import make_console
    from ddpdoctor.render.explain import render_explanation
    from ddpdoctor.core.files import atomic_write_json

    outputs = [("--json", args.json_path), ("--html", args.html_path)]
    for flag, path in outputs:
        _check_output_path(flag, path)
    _refuse_existing(outputs, args.force)
    run = explain(args.logs, world_size=args.world_size)
    if args.json_path:
        atomic_write_json(run.to_json(), args.json_path, overwrite=args.force)
    if args.html_path:
        from ddpdoctor.render import html_report

        html_report.write(args.html_path, "explain", run.to_json(), overwrite=args.force)
    requeue = args.exit_code_mode == "requeue"
    render_explanation(run, make_console(), full=args.all, requeue_exit=requeue)
    return run.requeue.exit_code if requeue else run.exit_code


def _history(args: argparse.Namespace) -> int:
    import importlib.util

    from ddpdoctor.core.files import atomic_write_json
    from ddpdoctor.history.schema import SCHEMA_VERSION
    from ddpdoctor.history.store import HistoryError, read_history
    from ddpdoctor.history.verdicts import for_node, judge, since
    from ddpdoctor.render.console import make_console
    from ddpdoctor.render.history import render_history, write_plot

    outputs = [("--json", args.json_path), ("--plot", args.plot_path)]
    for flag, path in outputs:
        _check_output_path(flag, path)
    _refuse_existing(outputs, args.force)
    if args.plot_path and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"--plot {args.plot_path} needs matplotlib (pip install 'ddpdoctor[plot]')")
    try:
        history = read_history(args.store)
    except HistoryError as exc:
        raise UsageError(str(exc)) from None
    if history.schema_version > SCHEMA_VERSION:
        raise UsageError(f"history store {args.store} has schema version {history.schema_version}, newer than this "
                         f"ddpdoctor knows ({SCHEMA_VERSION}): upgrade ddpdoctor to judge it")
    verdicts = judge(since(history, args.since) if args.since is not None else history)
    if args.node is not None:
        known = sorted(s.node for s in verdicts.summaries)
        if args.node not in known:
            raise UsageError(f"--node {args.node}: no such node in {args.store} "
                             f"(it has {', '.join(known[:8]) or 'none'}{', ...' if len(known) > 8 else ''})")
        verdicts = for_node(verdicts, args.node)
    if args.json_path:
        atomic_write_json({"store": args.store, **verdicts.to_json()}, args.json_path, overwrite=args.force)
    if args.plot_path:
        write_plot(verdicts, args.plot_path, overwrite=args.force)
    render_history(verdicts, make_console())
    return verdicts.exit_code


def _list_probes() -> int:
    from ddpdoctor.probes import DEFAULT_PROBES, all_probes

    for name, probe in all_probes().items():
        mark = "*" if name in DEFAULT_PROBES else " "
        print(f"{mark} {name:<14} {probe.summary}")
    print("(* runs by default)")
    return 0


def _quiet_torch_logs() -> None:
    """c10d logs every failed connect with a C++ stack; we report the same fact in one line.

    Must run before torch is imported. A user who sets TORCH_CPP_LOG_LEVEL keeps theirs.
    """
    from ddpdoctor.measure.host import set_for_ourselves

    # Ours, not the user's: a crash's list of the settings the ranks ran with (RUN013) leaves them out.
    set_for_ourselves({name: value for name, value in (("TORCH_CPP_LOG_LEVEL", "FATAL"),
                                                       ("TORCH_SHOW_CPP_STACKTRACES", "0"))
                       if name not in os.environ})
    # torch warns at import when numpy is missing; ddpdoctor needs no numpy, so the warning
    # would only put a second line under every one-line error (torch emits it as a UserWarning).
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)


def one_line(text: str) -> str:
    """Messages quote what the user typed, which may hold a newline, a U+2028 or a byte argv
    could not decode: escaped, so an error stays one line (and encodable on any stderr)."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _run_main(tokens: list[str]) -> int:
    """`ddpdoctor run`'s errors: ours are one line and exit 3, as every command's; the script's are its own
    (its traceback, its status), and Ctrl-C ends the process as it would end the script alone."""
    try:
        if any("\x00" in t for t in tokens):
            raise UsageError("an argument contains a NUL byte: paths and values cannot hold one")
        return _run(tokens)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except UsageError as exc:
        sys.stderr.write(f"ddpdoctor run: error: {one_line(str(exc))}\n")
        return EXIT_UNKNOWN


def main(argv: Optional[Sequence[str]] = None) -> int:
    _quiet_torch_logs()
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["run"]:
        return _run_main(args_list[1:])
    try:
        if any("\x00" in a for a in args_list):  # no shell can pass one; a Python caller can
            raise UsageError("an argument contains a NUL byte: paths and values cannot hold one")
        try:
            args = build_parser().parse_args(args_list)
        except SystemExit as exc:  # --help and --version print, then argparse exits 0
            return exc.code if isinstance(exc.code, int) else 0
        if args.command in ("check", "allreduce-bench", "scaling"):
            return _check(args, args_list)
        if args.command == "probes":
            return _list_probes()
        if args.command == "snapshot":
            return _snapshot(args)
        if args.command == "diagnose":
            return _diagnose(args)
        if args.command == "history":
            return _history(args)
        if args.command == "explain":
            return _explain(args)
        build_parser().print_help()
        return EXIT_UNKNOWN
    except UsageError as exc:
        sys.stderr.write(f"ddpdoctor: error: {one_line(str(exc))}\n")
        return EXIT_UNKNOWN
    except KeyboardInterrupt:
        sys.stderr.write("ddpdoctor: interrupted\n")
        return EXIT_UNKNOWN
    except Terminated:
        # SIGTERM to a rank before its stages began (its launcher stopping it while it imported).
        sys.stderr.write("ddpdoctor: stopped by SIGTERM before the check began\n")
        return EXIT_UNKNOWN
    except Exception as exc:  # never a traceback for users; DDPDOCTOR_DEBUG=1 shows it
        if os.environ.get(DEBUG_VAR):
            raise
        sys.stderr.write(f"ddpdoctor: internal error: {type(exc).__name__}: {one_line(str(exc))} "
                         f"(rerun with {DEBUG_VAR}=1 for the traceback, and report it)\n")
        return EXIT_UNKNOWN
