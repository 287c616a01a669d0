"""The trainers' shared step loop (metasd.training.loop.StepLoop), with a stand-in training step."""
from metasd.training.common import Tracker
from metasd.training.loop import StepLoop


def _loop(**kw) -> tuple[StepLoop, dict]:
    seen = {"steps": [], "val": [], "save": [], "report": [], "log": []}
    base = dict(steps=10, log_every=4, eval_every=3, save_every=5, tracker=Tracker(False, "", None, None, {}),
                log=seen["log"].append, report=lambda step, m: seen["report"].append((step, m)))
    return StepLoop(**{**base, **kw}), seen


def _run(loop: StepLoop, seen: dict, start: int = 0):
    def train_step(step):
        seen["steps"].append(step)
        return {"loss": float(step), "lr": 0.1 * step}

    return loop.run(start, train_step, seen["save"].append, seen["val"].append)


def test_schedule_of_reports_validations_and_saves():
    loop, seen = _loop()
    assert _run(loop, seen) == ("finished", 10)
    assert seen["steps"] == list(range(10))
    assert seen["val"] == [3, 6, 9]  # every eval_every steps, never after the last (the caller validates then)
    assert seen["save"] == [5, 10]
    # after the first step, every log_every steps and after the last; means over the window, lr the latest
    assert seen["report"] == [(1, {"loss": 0.0, "lr": 0.0}), (4, {"loss": 2.0, "lr": 0.30000000000000004}),
                              (8, {"loss": 5.5, "lr": 0.7000000000000001}), (10, {"loss": 8.5, "lr": 0.9})]


def test_until_step_interrupts_and_a_resume_continues_where_it_stopped():
    loop, seen = _loop(until_step=6)
    assert _run(loop, seen) == ("interrupted", 6)
    assert seen["steps"] == list(range(6))
    again, seen2 = _loop()
    assert _run(again, seen2, start=6) == ("finished", 10)
    assert seen2["steps"] == [6, 7, 8, 9] and seen2["val"] == [9] and seen2["save"] == [10]


def test_until_step_counts_global_steps_with_an_offset():
    loop, seen = _loop(until_step=12, offset=10)  # a second stage starting at global step 10
    assert _run(loop, seen) == ("interrupted", 2)


def test_wall_budget_counts_earlier_invocations():
    loop, seen = _loop(max_minutes=1.0, elapsed=61.0)
    assert _run(loop, seen, start=3) == ("time", 3)
    assert seen["steps"] == [] and "time budget of 1.0 min reached at step 3/10" in seen["log"][0]
    loop, seen = _loop(max_minutes=1.0, elapsed=59.0)
    assert _run(loop, seen) == ("finished", 10)


def test_without_report_it_logs_lines_and_no_first_report_when_asked():
    loop, seen = _loop(report=None, log_first=False)
    _run(loop, seen)
    assert [line.split()[1] for line in seen["log"]] == ["4/10", "8/10", "10/10"]
