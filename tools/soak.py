"""Soak a run: start it for N steps, sample every process of it every few seconds, and say whether anything grows.

    python tools/soak.py --config configs/default.yaml --steps 1000 --out soak/default [--every 5] \\
        [--set checkpoint.save_every=50 ...] [--fault kill_engine_at_step=500 ...] [-- LAUNCHER ARGS]
    python tools/soak.py --out soak/default --verdict-only      # plots and verdict again from samples.csv
    python tools/soak.py --config ... --steps 200 --out soak/faults --sigterm-at-step 150 \
        --fault kill_engine_at_step=50 --fault kill_reward_at_step=100  # faults: compared before and after (below)

What is sampled, every --every seconds, for each process of the run's tree (the launcher's descendants: torchrun,
every rank, Ray's GCS and raylet and their workers, each engine actor and vLLM's processes, the reward actor and
its worker processes; by kind as tools/sample_memory.py names them): resident memory, open file descriptors,
threads and child processes. Per sample also the machine's used memory and the run folder's size, checkpoints/
apart from the rest (the logs, which grow by design). The Ray object store comes from each step's record
(`ray/object_store_bytes` at the step's end, `ray/spilled_bytes_total`: orchestrator/ray_runtime.py).

OUT/samples.csv holds every sample; OUT/<quantity>.png one plot per quantity (per kind, summed over its
processes: a restarted actor's new process continues its kind's line); OUT/verdict.md the slope of each series
over the second half of the steps (least squares against the step) and the bound it is held to. The series is of
floors: for memory the lowest sample in each window of whole steps that holds MIN_SAMPLES samples on average
(what stays, not what a phase holds for a moment; a single step's lowest, when a step is shorter than --every, is
one sample at any phase of it), for counts the lowest of each step's samples:

    resident memory        < 1 MiB per 100 steps, each kind (a fall is no leak: the bounds are one-sided)
    descriptors, threads, children, process count     < 1 per 100 steps, each kind
    checkpoints/           < 1 MiB per 100 steps (keep_last holds it)
    object store           at every step's end within 1 MiB of the first step's; spilled bytes do not grow

With faults (an engine or the reward actor killed at a step by --fault, which runs the job through tools/faults.py,
and --sigterm-at-step N:
SIGTERM to the run once step N is logged, then the same command with --resume, sampled on into the same CSV) the
verdict adds, per kind, the process count and resident memory of the last quarter of the steps before the first
fault against those of the last quarter of the run: after recovery the same number of processes (nothing leaked or
lost) and memory no higher than before (the most it held, plus 10 %). The slopes then span a restart and say less.

Exit code 0: nothing grows; 1: something does, or a kind did not come back (named in the verdict); 2: bad input;
the run's own exit code if it failed. The run's output goes to OUT/run (its launcher log: OUT/launcher.log).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults import FAULTS_ENV, FaultPlan  # noqa: E402
from sample_memory import KINDS, describe  # noqa: E402

SAMPLES_FILE = "samples.csv"
VERDICT_FILE = "verdict.md"
FAULTS_FILE = "faults.json"  # the step of the first fault, for --verdict-only
FAULTS_ENTRY = str(Path(__file__).resolve().with_name("faults.py"))  # the main job with planted faults
BAND_MARGIN = 0.10  # memory after the faults may exceed the most it held before them by this much
FIELDS = ("time", "step", "pid", "kind", "rank", "rss_bytes", "fds", "threads", "children")
QUANTITIES = ("rss_bytes", "fds", "threads", "children", "processes")
MIB = 1 << 20
MIN_SAMPLES = 5  # a floor is the lowest of this many samples, on average
# kinds of the whole-run rows (pid 0)
MACHINE, RUN_LOGS, CHECKPOINTS = "machine", "run_folder_logs", "run_folder_checkpoints"


# ------------------------------------------------------------------------------------------------ sampling
def run_tree(root: psutil.Process) -> List[psutil.Process]:
    try:
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def process_row(process: psutil.Process, now: float, step: int, kinds: Dict[int, str]) -> Optional[dict]:
    """One process's figures; a process no kind names (a reward worker, a Ray helper) is "<its parent's kind>/child".
    `kinds` ({pid: kind} of this sample, parents first) is filled as it goes."""
    kind, rank = describe(process, KINDS)
    try:
        with process.oneshot():
            kinds[process.pid] = kind = kind or f"{kinds.get(process.ppid(), process.name())}/child"
            return {"time": now, "step": step, "pid": process.pid, "kind": kind, "rank": rank,
                    "rss_bytes": process.memory_info().rss, "fds": process.num_fds(),
                    "threads": process.num_threads(), "children": len(process.children())}
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def folder_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass  # removed while walking (a checkpoint pruned by keep_last)
    return total


def whole_run_rows(run_dir: Path, now: float, step: int) -> List[dict]:
    memory = psutil.virtual_memory()
    checkpoints = folder_bytes(run_dir / "checkpoints")
    blank = {"pid": 0, "rank": "", "fds": "", "threads": "", "children": ""}
    return [dict(blank, time=now, step=step, kind=MACHINE, rss_bytes=memory.total - memory.available),
            dict(blank, time=now, step=step, kind=CHECKPOINTS, rss_bytes=checkpoints),
            dict(blank, time=now, step=step, kind=RUN_LOGS, rss_bytes=folder_bytes(run_dir) - checkpoints)]


class StepCounter:
    """The last training step metrics.jsonl holds, read incrementally (the run appends as it goes)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.step = path, 0, 0

    def read(self) -> int:
        if not self.path.is_file():
            return self.step
        with open(self.path, encoding="utf-8") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith("\n"):
                    break  # half-written: read it next time
                self.offset += len(line.encode("utf-8"))
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record.get("kind") == "train":
                    self.step = max(self.step, int(record["step"]))
        return self.step


def first_fault(plan: FaultPlan, sigterm_at: Optional[int]) -> Optional[int]:
    """The step of the soak's first fault: --sigterm-at-step, or a planted kill at step N (0-based: the fault
    strikes while step N + 1 runs, so step N is the last whole step before it)."""
    steps = [s for s in (sigterm_at, plan.first_step()) if s is not None]
    return min(steps) if steps else None


def soak(args: argparse.Namespace, plan: FaultPlan, launcher_args: Sequence[str]) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    command = [sys.executable, "-m", "hacpo_megatron.launch", "--config", args.config,
               "--set", f"run.total_steps={args.steps}", *[x for s in args.overrides for x in ("--set", s)],
               "--output-dir", str(run_dir), *(["--entry", FAULTS_ENTRY] if plan.text() else []), *launcher_args]
    fault = first_fault(plan, args.sigterm_at_step)
    (out / FAULTS_FILE).write_text(json.dumps({"first_fault_step": fault}))
    print("soak:", " ".join(command), flush=True)
    log = open(out / "launcher.log", "w")

    def start(extra: Sequence[str] = ()) -> subprocess.Popen:
        return subprocess.Popen([*command, *extra], cwd=Path(__file__).resolve().parents[1], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, **{FAULTS_ENV: plan.text()}))

    launcher, stop, terminated = start(), [], False
    for signum in (signal.SIGTERM, signal.SIGINT):  # passed on: the run checkpoints and stops; so do we
        signal.signal(signum, lambda *_: (stop.append(1), os.killpg(launcher.pid, signal.SIGTERM)))
    root, steps = psutil.Process(launcher.pid), StepCounter(run_dir / "metrics.jsonl")
    with open(out / SAMPLES_FILE, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        while True:
            if launcher.poll() is not None:
                if not terminated or stop:
                    break
                # torchrun (the launcher execs it) exits 1 on a SIGTERM it passed on to the ranks, which checkpoint
                print(f"soak: the run stopped on SIGTERM after step {steps.read()} (exit {launcher.returncode}): "
                      "--resume", flush=True)
                launcher, terminated = start(["--resume"]), False  # sampled on from the checkpoint's step
                root, steps = psutil.Process(launcher.pid), StepCounter(run_dir / "metrics.jsonl")
                args.sigterm_at_step = None
            now, step = round(time.time(), 1), steps.read()
            if args.sigterm_at_step and step >= args.sigterm_at_step and not terminated:
                os.kill(launcher.pid, signal.SIGTERM)  # as a scheduler would: torchrun passes it on to the ranks,
                # which finish their step and checkpoint (signalling the whole group as well made that fail)
                terminated = True
            kinds: Dict[int, str] = {}
            rows = [row for p in run_tree(root) if (row := process_row(p, now, step, kinds)) is not None]
            writer.writerows(rows + whole_run_rows(run_dir, now, step))
            f.flush()
            time.sleep(args.every)
    log.close()
    if launcher.returncode != 0:
        print(f"soak: the run ended with exit code {launcher.returncode} (log: {out / 'launcher.log'})", flush=True)
        judge(out)
        return launcher.returncode
    return judge(out)


# ------------------------------------------------------------------------------------------------ the verdict
SLOPE = "slope per 100 steps, 2nd half"


@dataclass
class Finding:
    kind: str
    quantity: str
    value: float  # what is measured (`measure`), held to |value| < bound
    bound: float
    unit: str
    first: float  # the series at the second half's first step and at the last
    last: float
    measure: str = SLOPE
    both_ways: bool = False  # a fall fails too (a process lost); for a slope, only growth does

    @property
    def ok(self) -> bool:
        return (abs(self.value) if self.both_ways else self.value) < self.bound


def step_samples(rows: Iterable[dict]) -> Dict[Tuple[str, str], Dict[int, List[float]]]:
    """{(kind, quantity): {step: every sample in that step of the kind's sum over its processes}}."""
    by_sample: Dict[Tuple[str, str, float], float] = {}
    steps: Dict[float, int] = {}
    for row in rows:
        step = int(row["step"])
        if step <= 0:
            continue  # set-up: models loading, engines starting (and the first step, as its samples say "step 0")
        t = float(row["time"])
        steps[t] = step
        quantities = ("rss_bytes",) if row["pid"] in ("0", 0) else QUANTITIES
        for quantity in quantities:
            value = 1.0 if quantity == "processes" else float(row[quantity])
            key = (row["kind"], quantity, t)
            by_sample[key] = by_sample.get(key, 0.0) + value
    last = max(steps.values(), default=0)  # its samples run on into the run's end: final checkpoint, shutdown
    samples: Dict[Tuple[str, str], Dict[int, List[float]]] = {}
    for (kind, quantity, t), value in by_sample.items():
        if steps[t] < last:
            samples.setdefault((kind, quantity), {}).setdefault(steps[t], []).append(value)
    return samples


def floor_series(rows: Iterable[dict]) -> Dict[Tuple[str, str], Dict[int, float]]:
    """{(kind, quantity): {step: value}}: resident memory by its floors (`floors`), counts by each step's lowest
    sample (a window's lowest would catch any momentary dip, such as an actor being restarted)."""
    return {key: lowest(by_step, key[1]) for key, by_step in step_samples(rows).items()}


def lowest(by_step: Dict[int, List[float]], quantity: str) -> Dict[int, float]:
    return floors(by_step) if quantity == "rss_bytes" else {step: min(v) for step, v in by_step.items()}


def floors(by_step: Dict[int, List[float]]) -> Dict[int, float]:
    """The lowest sample in windows of whole steps, as wide as MIN_SAMPLES samples need on average, by each
    window's first step. A 1,000-step soak sampled every 5 s with 3.4 s steps has 0.7 samples a step: a step's
    own lowest is then one sample at a random phase of the step (ranks move 100-200 MiB within one), and its
    slope over 500 steps is noise of a few MiB per 100 steps, above the 1 MiB bound."""
    steps = sorted(by_step)
    if not steps:
        return {}
    per_step = sum(len(values) for values in by_step.values()) / len(steps)
    width = max(1, math.ceil(MIN_SAMPLES / per_step))
    out: Dict[int, float] = {}
    for step in steps:
        start = steps[0] + (step - steps[0]) // width * width
        out[start] = min(out.get(start, math.inf), min(by_step[step]))
    return out


def second_half_slope(series: Dict[int, float]) -> Tuple[float, float, float]:
    """(least-squares slope per step over the second half of the steps, first and last value of that half)."""
    steps = sorted(series)
    half = steps[len(steps) // 2:]
    if len(half) < 2:
        return 0.0, series[steps[-1]], series[steps[-1]]
    xs, ys = half, [series[s] for s in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, ys[0], ys[-1]


def findings(rows: Sequence[dict], store: Dict[int, Dict[str, float]]) -> List[Finding]:
    out = []
    for (kind, quantity), series in sorted(floor_series(rows).items()):
        if kind in (MACHINE, RUN_LOGS):
            continue  # shown in the plots; the machine has other tenants, the logs grow by design
        slope, first, last = second_half_slope(series)
        if quantity == "rss_bytes":
            name = "bytes" if kind == CHECKPOINTS else "rss_bytes"
            out.append(Finding(kind, name, slope * 100 / MIB, 1.0, "MiB", first / MIB, last / MIB))
        else:
            out.append(Finding(kind, quantity, slope * 100, 1.0, "", first, last))
    if store:
        steps = sorted(store)
        used = [store[s].get("ray/object_store_bytes", 0.0) for s in steps]
        worst = max(abs(u - used[0]) for u in used) / MIB
        out.append(Finding("ray", "object_store_bytes", worst, 1.0, "MiB", used[len(used) // 2] / MIB, used[-1] / MIB,
                           measure="largest distance from step 1's, at a step's end"))
        slope, first, last = second_half_slope({s: store[s].get("ray/spilled_bytes_total", 0.0) for s in steps})
        out.append(Finding("ray", "spilled_bytes_total", slope * 100 / MIB, 1.0, "MiB", first / MIB, last / MIB))
    return out


def recovery(rows: Sequence[dict], fault_step: int) -> List[Finding]:
    """Per process kind: its process count and resident memory over the last quarter of the run against the last
    quarter of the steps before the first fault (after start-up and, if the fault comes after it, the first
    checkpoint, whose writer keeps helper processes). Count: the median per step, which must be equal. Memory:
    the median of its floors, which must not exceed the most the kind held before (plus BAND_MARGIN); `value` is
    by how much, in MiB. Each side's floors are its own (no window spans the faults)."""
    out = []
    samples = step_samples(rows)
    last = max((step for by_step in samples.values() for step in by_step), default=0)
    for (kind, quantity), by_step in sorted(samples.items()):
        if kind in (MACHINE, RUN_LOGS, CHECKPOINTS) or quantity not in ("processes", "rss_bytes"):
            continue
        before = list(lowest({s: v for s, v in by_step.items()
                              if fault_step - max(fault_step // 4, 1) < s <= fault_step}, quantity).values())
        after = list(lowest({s: v for s, v in by_step.items()
                             if s > last - max((last - fault_step) // 4, 1)}, quantity).values())
        if not before or not after:
            continue
        now, was = statistics.median_low(after), statistics.median_low(before)
        if quantity == "processes":
            out.append(Finding(kind, "processes", now - was, 0.5, "", was, now,
                               measure="median count after the faults minus before", both_ways=True))
        else:
            hi = max(before) * (1 + BAND_MARGIN)  # below it is fine: a restarted process may hold less
            out.append(Finding(kind, "rss_bytes", max(now - hi, 0.0) / MIB, 1.0, "MiB", was / MIB, now / MIB,
                               measure=f"median after the faults, above the most before (+{BAND_MARGIN:.0%})"))
    return out


def object_store_by_step(metrics_path: Path) -> Dict[int, Dict[str, float]]:
    store: Dict[int, Dict[str, float]] = {}
    if metrics_path.is_file():
        for line in metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("kind") == "train" and "ray/object_store_bytes" in record:
                store[int(record["step"])] = {k: v for k, v in record.items() if k.startswith("ray/") and v is not None}
    return store


def judge(out: Path) -> int:
    with open(out / SAMPLES_FILE, newline="") as f:
        rows = list(csv.DictReader(f))
    store = object_store_by_step(out / "run" / "metrics.jsonl")
    found = findings(rows, store)
    faults = json.loads((out / FAULTS_FILE).read_text()) if (out / FAULTS_FILE).is_file() else {}
    if faults.get("first_fault_step"):
        found += recovery(rows, faults["first_fault_step"])
    steps = sorted({int(r["step"]) for r in rows if int(r["step"]) > 0})
    lines = [f"# Soak verdict: {out}", "",
             f"Steps {steps[0] if steps else 0}-{steps[-1] if steps else 0} sampled ({len(rows)} rows); the slopes "
             "are over the second half of the steps.", "",
             "| kind | quantity | measure | value | bound | at the half | at the end | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in found:
        verdict = "flat" if x.ok else "**GROWS**" if x.measure == SLOPE else "**NOT BACK**"
        lines.append(f"| {x.kind} | {x.quantity} | {x.measure} | {x.value:+.3f} {x.unit} | {x.bound:g} {x.unit} | "
                     f"{x.first:.3f} | {x.last:.3f} | {verdict} |")
    growing = [x for x in found if not x.ok]
    lines += ["", f"**{len(growing)} growing**: " + ", ".join(f"{x.kind} {x.quantity}" for x in growing)
              if growing else "**Nothing grows.**"]
    (out / VERDICT_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    plot(out, rows, store)
    print("\n".join(lines), flush=True)
    return 1 if growing else 0


def plot(out: Path, rows: Sequence[dict], store: Dict[int, Dict[str, float]]) -> None:
    from matplotlib.figure import Figure

    series = floor_series(rows)
    for quantity in QUANTITIES:
        figure = Figure(figsize=(9, 5), layout="constrained")
        axes = figure.subplots()
        for (kind, q), by_step in sorted(series.items()):
            if q == quantity and (quantity != "rss_bytes" or kind not in (CHECKPOINTS, RUN_LOGS)):
                steps = sorted(by_step)
                scale = MIB if quantity == "rss_bytes" else 1
                axes.plot(steps, [by_step[s] / scale for s in steps], label=kind, linewidth=1.2)
        axes.set_xlabel("step")
        axes.set_ylabel("MiB" if quantity == "rss_bytes" else quantity)
        floor = f"; floors: lowest of ~{MIN_SAMPLES} samples" if quantity == "rss_bytes" else "; lowest per step"
        axes.set_title(f"{quantity} per process kind (sum over its processes{floor})")
        axes.legend(fontsize="x-small", ncols=2)
        figure.savefig(out / f"{quantity}.png", dpi=100)
    figure = Figure(figsize=(9, 5), layout="constrained")
    axes = figure.subplots()
    for kind in (CHECKPOINTS, RUN_LOGS):
        by_step = series.get((kind, "rss_bytes"), {})
        axes.plot(sorted(by_step), [by_step[s] / MIB for s in sorted(by_step)], label=kind)
    if store:
        axes.plot(sorted(store), [store[s].get("ray/object_store_bytes", 0) / MIB for s in sorted(store)],
                  label="Ray object store at the step's end")
    axes.set_xlabel("step")
    axes.set_ylabel("MiB")
    axes.set_title("run folder and object store")
    axes.legend(fontsize="small")
    figure.savefig(out / "storage.png", dpi=100)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="the run's YAML config")
    parser.add_argument("--steps", type=int, help="run.total_steps of the soak")
    parser.add_argument("--out", required=True, help="the soak's folder: samples.csv, plots, verdict.md, run/")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples (default 5)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--verdict-only", action="store_true", help="judge OUT/samples.csv again; run nothing")
    parser.add_argument("--sigterm-at-step", type=int, help="SIGTERM the run once this step is logged, then --resume")
    parser.add_argument("--fault", dest="faults", action="append", default=[], metavar="NAME=N",
                        help="a fault planted in the run (tools/faults.py names them), e.g. kill_engine_at_step=50")
    args = parser.parse_args(argv)
    try:
        plan = FaultPlan.parse(",".join(args.faults))
    except ValueError as error:
        print(f"error: --fault: {error}", file=sys.stderr)
        return 2
    if args.verdict_only:
        if not (Path(args.out) / SAMPLES_FILE).is_file():
            print(f"error: {Path(args.out) / SAMPLES_FILE}: no such file", file=sys.stderr)
            return 2
        return judge(Path(args.out))
    if not args.config or not args.steps or args.steps < 2 or args.every <= 0:
        print("error: --config, --steps >= 2 and --every > 0 are needed to run a soak", file=sys.stderr)
        return 2
    return soak(args, plan, launcher_args)


if __name__ == "__main__":
    sys.exit(main())
