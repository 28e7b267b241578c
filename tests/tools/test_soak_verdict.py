"""tools/soak.py's verdict on hand-made samples: a series growing past its bound is named, a flat one is not."""
import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import soak  # noqa: E402

MIB = 1 << 20


def rows(steps=range(1, 21), rank_leak_mib=0.0, engine_fds=lambda step: 40):
    """Two samples per step: both ranks (one kind), an engine, the checkpoints folder."""
    out = []
    for step in steps:
        for sample in range(2):
            t = step * 10 + sample
            for pid, rank in ((11, "0"), (12, "1")):
                rss = (500 + (rank_leak_mib * step if rank == "0" else 0)) * MIB + sample * 4096  # noise inside a step
                out.append({"time": t, "step": step, "pid": pid, "kind": "examples/hacpo_pretrain_style.py",
                            "rank": rank, "rss_bytes": rss, "fds": 30, "threads": 8, "children": 0})
            out.append({"time": t, "step": step, "pid": 21, "kind": "ray::EngineActor", "rank": "",
                        "rss_bytes": 800 * MIB, "fds": engine_fds(step), "threads": 20, "children": 1})
            out.append({"time": t, "step": step, "pid": 0, "kind": soak.CHECKPOINTS, "rank": "",
                        "rss_bytes": 2 * 300 * MIB, "fds": "", "threads": "", "children": ""})
    return [{k: str(v) for k, v in r.items()} for r in out]


def verdicts(found):
    return {(x.kind, x.quantity): x.ok for x in found}


def test_flat_series_pass_and_a_leak_is_named_with_its_slope():
    assert all(verdicts(soak.findings(rows(), {})).values())
    found = soak.findings(rows(rank_leak_mib=0.05), {})  # 5 MiB per 100 steps, both ranks' sum
    (leak,) = [x for x in found if not x.ok]
    assert (leak.kind, leak.quantity) == ("examples/hacpo_pretrain_style.py", "rss_bytes")
    assert leak.value == pytest.approx(5.0)
    assert all(verdicts(soak.findings(rows(rank_leak_mib=-0.5), {})).values())  # memory given back is no leak
    assert soak.findings(rows(rank_leak_mib=0.005), {})[0].ok  # 0.5 MiB per 100 steps: under the bound


def test_the_floor_is_taken_over_several_samples_when_steps_are_shorter_than_the_sampling():
    """One sample a step (steps shorter than --every): most land in a phase that holds more memory, and here that
    phase's memory rises, while every third sample finds the floor, which stays. The floor is what is judged."""
    sparse = [r for r in rows(steps=range(1, 61)) if int(r["time"]) % 10 == 0]  # one sample a step
    for r in sparse:
        step = int(r["step"])
        if r["kind"] == "examples/hacpo_pretrain_style.py" and step % 3:
            r["rss_bytes"] = str(float(r["rss_bytes"]) + step * 0.5 * MIB)
    found = {(x.kind, x.quantity): x for x in soak.findings(sparse, {})}
    assert found[("examples/hacpo_pretrain_style.py", "rss_bytes")].ok
    assert found[("examples/hacpo_pretrain_style.py", "rss_bytes")].value == pytest.approx(0.0, abs=1e-9)
    windows = sorted(soak.floor_series(sparse)[("examples/hacpo_pretrain_style.py", "rss_bytes")])
    assert windows == list(range(1, 60, 5))  # 5 steps each, by their first step (step 60 runs into the shutdown)


def test_only_the_second_half_is_judged():
    def warming(step):  # descriptors opened while starting, then flat
        return 40 if step > 10 else 20 + 2 * step

    assert verdicts(soak.findings(rows(engine_fds=warming), {}))[("ray::EngineActor", "fds")]

    def leaking(step):  # one more descriptor every step of the second half
        return 40 + (step > 10) * step

    assert not verdicts(soak.findings(rows(engine_fds=leaking), {}))[("ray::EngineActor", "fds")]


def test_the_object_store_must_come_back_to_step_one_at_every_step_end():
    flat = {s: {"ray/object_store_bytes": 1000.0, "ray/spilled_bytes_total": 0.0} for s in range(1, 21)}
    assert verdicts(soak.findings(rows(), flat))[("ray", "object_store_bytes")]
    kept = {s: {"ray/object_store_bytes": 1000.0 + (s == 15) * 3 * MIB, "ray/spilled_bytes_total": 0.0}
            for s in range(1, 21)}  # one step's objects outlived it
    assert not verdicts(soak.findings(rows(), kept))[("ray", "object_store_bytes")]


def test_verdict_file_and_exit_code(tmp_path):
    with open(tmp_path / soak.SAMPLES_FILE, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=soak.FIELDS)
        writer.writeheader()
        writer.writerows(rows(rank_leak_mib=1.0))
    assert soak.main(["--out", str(tmp_path), "--verdict-only"]) == 1
    verdict = (tmp_path / soak.VERDICT_FILE).read_text()
    assert "**1 growing**: examples/hacpo_pretrain_style.py rss_bytes" in verdict
    assert (tmp_path / "rss_bytes.png").stat().st_size > 10_000 and (tmp_path / "storage.png").is_file()
    assert soak.main(["--out", str(tmp_path / "none"), "--verdict-only"]) == 2


def engines(steps, count, rss_mib):
    """`count` engine processes of `rss_mib` each, one sample per step (pids change: restarted actors)."""
    return [{k: str(v) for k, v in dict(time=step * 10, step=step, pid=100 * step + i, kind="ray::EngineActor",
                                         rank="", rss_bytes=rss_mib(step) * MIB, fds=40, threads=20,
                                         children=0).items()}
            for step in steps for i in range(count(step))]


def test_after_the_faults_the_same_processes_and_no_more_memory():
    """First fault after step 40 of 80: steps 31-40 (the last quarter before it) are the reference (800-836 MiB a
    process, 2 processes; earlier steps, with 1 process, are start-up), steps 61-80 (the last quarter) are judged."""
    def held(step):  # 800..836
        return 800 + 4 * (step % 10)

    recovered = engines(range(1, 81), lambda step: 1 if step < 20 else 2,
                        lambda step: held(step) if step <= 40 else 850)
    assert all(x.ok for x in soak.recovery(recovered, 40))  # 850 <= 836 x 1.1
    smaller = engines(range(1, 81), lambda step: 2, lambda step: held(step) if step <= 40 else 400)
    assert all(x.ok for x in soak.recovery(smaller, 40))  # a restarted process holding less is no fault
    leaked = engines(range(1, 81), lambda step: 3 if step > 50 else 2, lambda step: 820)
    (count, memory) = soak.recovery(leaked, 40)
    assert (count.quantity, count.ok, count.first, count.last) == ("processes", False, 2, 3)
    assert not memory.ok and memory.value == pytest.approx(3 * 820 - 2 * 820 * 1.1)  # the kind's sum: 3 processes
    lost = engines(range(1, 81), lambda step: 1 if step > 50 else 2, lambda step: 820)
    assert not soak.recovery(lost, 40)[0].ok  # a process lost fails too
    grown = engines(range(1, 81), lambda step: 2, lambda step: 820 if step <= 40 else 1000)
    memory = [x for x in soak.recovery(grown, 40) if x.quantity == "rss_bytes"][0]
    assert not memory.ok and memory.value == pytest.approx(2 * 1000 - 2 * 820 * 1.1)


def test_the_first_fault_is_the_earliest_sigterm_or_kill():
    plan = soak.FaultPlan.parse("kill_engine_at_step=50,leak_mib_per_step=8,kill_reward_at_step=30")
    assert soak.first_fault(plan, 80) == 30 and soak.first_fault(plan, 20) == 20
    assert soak.first_fault(soak.FaultPlan.parse("leak_mib_per_step=8"), None) is None  # a leak is no fault
    assert soak.first_fault(soak.FaultPlan(kill_engine_before_step=0), None) == 0


def test_a_fault_plan_reads_back_as_written_and_refuses_unknown_names():
    plan = soak.FaultPlan.parse(" kill_engine_in_sync_at_step=0, kill_engine_in_eval_at_step=3 ")
    assert plan == soak.FaultPlan(kill_engine_in_sync_at_step=0, kill_engine_in_eval_at_step=3)
    assert soak.FaultPlan.parse(plan.text()) == plan and soak.FaultPlan.parse("") == soak.FaultPlan()
    for bad in ("kill_engine_at=1", "kill_engine_at_step=one", "kill_engine_at_step"):
        with pytest.raises(ValueError, match="HACPO_FAULTS"):
            soak.FaultPlan.parse(bad)
    assert soak.main(["--config", "c.yaml", "--steps", "4", "--out", "x", "--fault", "kill_it=1"]) == 2
