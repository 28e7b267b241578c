"""Running a study: the Study (variants x seeds under one folder), every input check that can be made before a
run starts, the cells run one after another through the launcher (a subprocess that SIGTERM/SIGINT are passed on
to), one study process per folder, then results.md and accuracy.png; the exit codes of tools/compare_algorithms.py."""
from __future__ import annotations

import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hacpo_megatron.study.cells import (
    FINISHED,
    OVERRIDE_KEY,
    RESUMABLE,
    Cell,
    StudyInputError,
    Variant,
    cell_state,
    launcher_command,
    plan_cells,
    read_run_config,
)
from hacpo_megatron.study.plots import plot_accuracy
from hacpo_megatron.study.report import PLOT_FILE, collect_cell, results_markdown

EXIT_OK, EXIT_INCOMPLETE, EXIT_BAD_INPUT = 0, 1, 2
# What the training entry returns after a preemption (PREEMPTED_EXIT_CODE in orchestrator/preemption.py,
# 128 + SIGTERM; a test keeps the two equal). Read here, not imported: that module imports torch.
PREEMPTED_EXIT_CODE = 143
# Exit codes of a cell that was stopped on request and left a checkpoint to resume from: the entry's own
# code, 75 (EX_TEMPFAIL, what job wrappers use for "try again"), 130 (128 + SIGINT), and a launcher killed
# by the signal itself (subprocess reports -SIGNAL). torchrun itself exits 1 after forwarding a signal, so
# the runner also reports a cell it passed a signal to as preempted (run_launcher).
PREEMPTED_EXIT_CODES = frozenset({PREEMPTED_EXIT_CODE, 75, 130, -signal.SIGTERM, -signal.SIGINT})

LAUNCHER_LOG = "launcher.log"
RESULTS_FILE = "results.md"
LOCK_FILE = ".study.lock"

Launch = Callable[[List[str], Path], int]  # (command, log file) -> exit code
Resolve = Callable[[str, Sequence[str]], Dict[str, Any]]  # (config, overrides) -> resolved config as plain data


def run_launcher(command: List[str], log_path: Path) -> int:
    """Run one cell's launcher, its output appended to `log_path`; returns its exit code.

    The launcher runs in its own session, so a Ctrl-C in the terminal reaches it once, through this tool:
    SIGTERM/SIGINT here are passed on (the run finishes its step, writes a checkpoint and stops; a second
    signal stops it at once). A run that ends non-zero after such a signal is reported as preempted:
    torchrun itself exits 1 after forwarding a signal, whatever the ranks returned.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n=== {datetime.datetime.now():%Y-%m-%d %H:%M:%S} {shlex.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        received: List[int] = []

        def forward(signum, _frame):
            received.append(signum)
            process.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            returncode = process.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if received and returncode != 0:
        return PREEMPTED_EXIT_CODE
    return returncode


def resolve_config(config: str, overrides: Sequence[str]) -> Dict[str, Any]:
    """The config a run of (config, overrides) writes as config.yaml, as plain data; StudyInputError if invalid."""
    from hacpo_megatron.config import ConfigError, config_to_dict, load_config

    try:
        return json.loads(json.dumps(config_to_dict(load_config(config, list(overrides)))))
    except ConfigError as error:
        head, *problems = [line.strip() for line in str(error).splitlines()]
        raise StudyInputError(" ".join([head, "; ".join(problems)]).strip()) from None  # one line


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class Study:
    base_config: str
    variants: List[Variant]
    seeds: List[int]
    out: Path
    baseline: Optional[str] = None
    comparisons: List[Tuple[str, str]] = field(default_factory=list)  # --compare A:B, paired like the baseline
    common_overrides: List[str] = field(default_factory=list)
    only: List[Tuple[str, int]] = field(default_factory=list)
    command: Optional[str] = None  # how this study was started, for results.md

    @property
    def labels(self) -> List[str]:
        return [v.label for v in self.variants]

    def cells(self) -> List[Cell]:
        return plan_cells(self.variants, self.seeds, self.out)

    def cell_overrides(self, cell: Cell) -> List[str]:
        return [f"run.seed={cell.seed}", *self.common_overrides, *cell.variant.overrides]


def check_study(study: Study, resolve: Optional[Resolve]) -> None:
    """Every input problem that can be found before a run starts, as StudyInputError."""
    labels = study.labels
    if not study.variants:
        raise StudyInputError("no --variant given (e.g. --variant hacpo=)")
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise StudyInputError(f"--variant labels repeat: {', '.join(repeated)}")
    if len(set(study.seeds)) != len(study.seeds):
        raise StudyInputError(f"--seeds repeat: {' '.join(map(str, study.seeds))}")
    if study.baseline is not None and study.baseline not in labels:
        raise StudyInputError(f"--baseline {study.baseline}: not among the variants ({', '.join(labels)})")
    for label, other in study.comparisons:
        unknown = [x for x in (label, other) if x not in labels]
        if unknown or label == other:
            raise StudyInputError(f"--compare {label}:{other}: " + (f"{', '.join(unknown)} not among the variants "
                                  f"({', '.join(labels)})" if unknown else "a variant against itself"))
    for override in study.common_overrides:
        if "=" not in override or not OVERRIDE_KEY.match(override.split("=", 1)[0].strip()):
            raise StudyInputError(f"--set {override!r}: expected KEY=VALUE")
        if override.split("=", 1)[0].strip() == "run.seed":
            raise StudyInputError("--set run.seed: seeds come from --seeds")
    cells = {(c.variant.label, c.seed) for c in study.cells()}
    for label, seed in study.only:
        if (label, seed) not in cells:
            raise StudyInputError(f"--only {label}:{seed}: no such cell (variants {', '.join(labels)}; "
                                  f"seeds {' '.join(map(str, study.seeds))})")
    if resolve is None:
        return
    for cell in study.cells():
        try:
            expected = resolve(cell.variant.config, study.cell_overrides(cell))
        except StudyInputError as error:
            raise StudyInputError(f"--variant {cell.variant.label}: {error}") from None
        found = read_run_config(cell.folder)
        differences = config_differences(expected, found) if found else []
        if differences:
            raise StudyInputError(f"{cell.folder} was run with another config ({'; '.join(differences)}): "
                                  "move it away or use another --out")


def config_differences(expected: Mapping[str, Any], found: Mapping[str, Any], limit: int = 3) -> List[str]:
    """'key: X here, Y in the folder' for keys both configs hold with different values (keys only one of them
    holds are not compared: a key added to the schema since the folder was written is no change of the run)."""
    ours, theirs = _flatten(expected), _flatten(found)
    return [f"{key}: {ours[key]!r} here, {theirs[key]!r} in the folder"
            for key in sorted(ours.keys() & theirs.keys()) if ours[key] != theirs[key]][:limit]


def _flatten(value: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return {prefix: value}
    flat: Dict[str, Any] = {}
    for key, item in items:
        flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def run_study(study: Study, *, launch: Launch = run_launcher, resolve: Optional[Resolve] = resolve_config,
              dry_run: bool = False, report: bool = False, python: str = sys.executable,
              echo: Callable[[str], None] = print) -> int:
    """Check the study, run the cells that need it, write results.md and accuracy.png; returns the exit code.

    StudyInputError before any run starts if the input is unusable (tools/compare_algorithms.py's main() makes it
    exit code 2).
    """
    check_study(study, resolve)
    cells = study.cells()
    chosen = [c for c in cells if not study.only or (c.variant.label, c.seed) in study.only]
    if dry_run:
        for cell in chosen:
            state = cell_state(cell.folder)
            action = ("skip" if state.status == FINISHED else
                      shlex.join(launcher_command(cell, study.common_overrides, resume=state.status == RESUMABLE,
                                                  python=python)))
            echo(f"{cell.name} [{state.status}]: {action}")
        return EXIT_OK

    study.out.mkdir(parents=True, exist_ok=True)
    with _StudyLock(study.out / LOCK_FILE):
        outcomes, preempted = ({}, None) if report else _run_cells(study, chosen, launch, python, echo)
    results = [collect_cell(c, outcomes.get(c.name, "not run")) for c in cells]
    shown = _shown_out(study.out)
    rerun = {c.name: shlex.join(launcher_command(c, study.common_overrides, python=_shown_python(python)))
             .replace(str(study.out), shown) for c in cells}
    text = results_markdown(results, study.labels, study.baseline, rerun, base_config=study.base_config,
                            seeds=study.seeds, workdir=os.getcwd(), study_command=study.command,
                            comparisons=study.comparisons, report=report)
    (study.out / RESULTS_FILE).write_text(text, encoding="utf-8")
    plot_accuracy(results, study.labels, study.baseline, study.out / PLOT_FILE)
    echo(text)
    echo(f"wrote {study.out / RESULTS_FILE} and {study.out / PLOT_FILE}")
    if preempted:
        echo(f"stopped on request at {preempted}: run the same command again to resume")
        return PREEMPTED_EXIT_CODE
    unfinished = [r.cell.name for r in results if (not study.only or r.outcome != "not run") and not r.finished]
    if unfinished:
        echo(f"not finished: {', '.join(unfinished)}")
        return EXIT_INCOMPLETE
    return EXIT_OK


def _run_cells(study: Study, cells: Sequence[Cell], launch: Launch, python: str,
               echo: Callable[[str], None]) -> Tuple[Dict[str, str], Optional[str]]:
    """Run each cell that needs it; {cell name: what happened}, and the cell a preemption stopped (or None)."""
    outcomes: Dict[str, str] = {}
    for index, cell in enumerate(cells, 1):
        state = cell_state(cell.folder)
        prefix = f"[{index}/{len(cells)}] {cell.name}"
        if state.status == FINISHED:
            outcomes[cell.name] = "skipped (finished)"
            echo(f"{prefix}: finished, skipped")
            continue
        resume = state.status == RESUMABLE
        command = launcher_command(cell, study.common_overrides, resume=resume, python=python)
        log_path = cell.folder / LAUNCHER_LOG
        echo(f"{prefix}: {'resuming from step ' + str(state.checkpoint_step) if resume else 'starting'} "
             f"(log: {log_path})")
        returncode = launch(command, log_path)
        done = "resumed" if resume else "ran fresh"
        if returncode in PREEMPTED_EXIT_CODES:
            outcomes[cell.name] = f"{done}, preempted"
            return outcomes, cell.name
        if returncode != 0:
            outcomes[cell.name] = f"{done}, failed (exit {returncode})"
            echo(f"{prefix}: failed with exit code {returncode}; the end of {log_path}:\n{_tail(log_path)}")
            continue
        if cell_state(cell.folder).status != FINISHED:  # exit 0, yet the folder does not show the end
            outcomes[cell.name] = f"{done}, exit 0 but not finished"
            echo(f"{prefix}: exit 0, but {cell.folder} does not hold the final step's records")
            continue
        outcomes[cell.name] = done
        echo(f"{prefix}: finished")
    return outcomes, None


def _shown_python(path: str) -> str:
    """The interpreter as results.md shows it: relative to the working folder when inside it (.venv/bin/python),
    else plain `python` (a folder of the machine the study ran on means nothing to a reader)."""
    relative = os.path.relpath(path)
    return "python" if relative.startswith("..") else relative


def _shown_out(out: Path) -> str:
    """The study folder as results.md shows it: relative to the working folder when inside it, else `OUT`."""
    relative = os.path.relpath(out)
    return "OUT" if relative.startswith("..") else relative


def shown_command(argv: Sequence[str], script: str, python: str = sys.executable) -> str:
    """The study's command line as results.md shows it: no folder of the machine it ran on."""
    args = list(argv)
    for i, arg in enumerate(args[:-1]):
        if arg == "--out":
            args[i + 1] = _shown_out(Path(args[i + 1]))
    script = os.path.relpath(script)
    return shlex.join([_shown_python(python), script if not script.startswith("..") else "tools/compare_algorithms.py",
                       *args])


class _StudyLock:
    """One study process per --out folder: two would run the same cell into the same folder at once."""

    def __init__(self, path: Path):
        self.path = path
        self._file = None

    def __enter__(self) -> "_StudyLock":
        import fcntl

        self._file = open(self.path, "w")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.close()
            raise StudyInputError(f"{self.path.parent}: another compare_algorithms is running on this folder") from None
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()  # releases the lock
