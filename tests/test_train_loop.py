"""The trainers' shared step loop (metasd.training.loop.StepLoop, KeepBest), with stand-in trainer pieces."""
import pytest

from metasd.training import loop as loop_module
from metasd.training.common import Tracker
from metasd.training.loop import KeepBest, StepLoop


def _loop(scores=None, **kw) -> tuple[StepLoop, dict]:
    """A loop of 10 steps whose validation at step s scores ``scores[s]`` (default: the step)."""
    seen = {"steps": [], "val": [], "save": [], "report": [], "log": [], "best": []}

    def train_step(step):
        seen["steps"].append(step)
        return {"loss": float(step), "lr": 0.1 * step}

    def validate(step):
        seen["val"].append(step)
        return {"score": float(step if scores is None else scores[step])}

    base = dict(steps=10, log_every=4, eval_every=3, save_every=5, tracker=Tracker(False, "", None, None, {}),
                log=seen["log"].append, train_step=train_step, save=seen["save"].append, validate=validate,
                report=lambda step, m: seen["report"].append((step, m)))
    return StepLoop(**{**base, **kw}), seen


def test_schedule_of_reports_validations_and_saves():
    loop, seen = _loop()
    assert loop.run(0) == ("finished", 10)
    assert seen["steps"] == list(range(10))
    assert seen["val"] == [3, 6, 9]  # every eval_every steps
    assert seen["save"] == [5, 10]
    # after the first step, every log_every steps and after the last; means over the window, lr the latest
    assert seen["report"] == [(1, {"loss": 0.0, "lr": 0.0}), (4, {"loss": 2.0, "lr": 0.30000000000000004}),
                              (8, {"loss": 5.5, "lr": 0.7000000000000001}), (10, {"loss": 8.5, "lr": 0.9})]


def test_no_validation_after_the_last_step():
    loop, seen = _loop(eval_every=5)
    loop.run(0)
    assert seen["val"] == [5]  # not 10: the caller validates after the last step


def test_until_step_interrupts_and_a_resume_continues_where_it_stopped():
    loop, seen = _loop(until_step=6)
    assert loop.run(0) == ("interrupted", 6)
    assert seen["steps"] == list(range(6))
    again, seen2 = _loop()
    assert again.run(6) == ("finished", 10)
    assert seen2["steps"] == [6, 7, 8, 9] and seen2["val"] == [9] and seen2["save"] == [10]


def test_until_step_counts_global_steps_with_an_offset():
    loop, seen = _loop(until_step=12, offset=10)  # a second stage starting at global step 10
    assert loop.run(0) == ("interrupted", 2) and seen["steps"] == [0, 1]


def test_wall_budget_counts_earlier_invocations():
    loop, seen = _loop(max_minutes=1.0, elapsed=61.0)
    assert loop.run(3) == ("time", 3)
    assert seen["steps"] == [] and "time budget of 1.0 min reached at step 3/10" in seen["log"][0]
    loop, seen = _loop(max_minutes=1.0, elapsed=59.0)
    assert loop.run(0) == ("finished", 10)


def test_wall_budget_stops_a_running_loop(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(loop_module.time, "time", lambda: clock[0])
    loop, seen = _loop(max_minutes=0.5, elapsed=5.0)
    step = loop.train_step

    def slow_step(s):  # each step takes 10 s of wall time
        clock[0] += 10.0
        return step(s)

    loop.train_step = slow_step
    assert loop.run(0) == ("time", 3)  # 5 + 3 * 10 s > 30 s before step 3
    assert seen["steps"] == [0, 1, 2] and loop.wall() == 35.0


@pytest.mark.parametrize("mode,scores,best_at", [
    ("max", {0: 1.0, 3: 2.0, 6: 2.0, 9: 1.5, 10: 3.0}, [0, 3, 10]),  # equal is no improvement
    ("min", {0: 1.0, 3: 2.0, 6: 0.5, 9: 0.5, 10: 0.7}, [0, 6]),
])
def test_keep_best_is_called_only_on_improvement(mode, scores, best_at):
    calls = []
    loop, seen = _loop(scores, keep_best=KeepBest("score", mode, lambda step, m: calls.append((step, m["score"]))))
    loop.validation(0)  # before training, as the trainers do
    loop.run(0)
    loop.validation(10)  # after the last step
    assert seen["val"] == [0, 3, 6, 9, 10]
    assert [s for s, _ in calls] == best_at and [v for _, v in calls] == [scores[s] for s in best_at]
    assert loop.keep_best.best == scores[best_at[-1]]


def test_keep_best_starts_from_the_best_of_an_earlier_invocation():
    calls = []
    loop, _ = _loop({3: 2.0, 6: 4.0, 9: 3.5},
                    keep_best=KeepBest("score", "max", lambda step, m: calls.append(step), best=3.0))
    loop.run(0)
    assert calls == [6]


def test_an_empty_validation_is_not_offered_to_keep_best():
    calls = []
    loop, _ = _loop(validate=lambda step: None, keep_best=KeepBest("score", "max", lambda step, m: calls.append(step)))
    assert loop.validation(0) is None and loop.run(0) == ("finished", 10) and calls == []


def test_without_report_it_logs_lines_and_no_first_report_when_asked():
    loop, seen = _loop(report=None, log_first=False)
    loop.run(0)
    assert [line.split()[1] for line in seen["log"]] == ["4/10", "8/10", "10/10"]


def test_a_trainers_mlflow_artifacts_go_beside_its_sqlite_store(tmp_path, monkeypatch):
    """Not into ./mlruns of the working directory (MLflow's default for a SQLite store), as metasd bench does."""
    store, work = tmp_path / "store", tmp_path / "work"
    store.mkdir(), work.mkdir()
    monkeypatch.chdir(work)
    tracker = Tracker(True, "artifact-place", "run", None, {"a": 1}, uri=f"sqlite:///{store / 'mlflow.db'}")
    card = tmp_path / "card.md"
    card.write_text("a model card")
    tracker.artifact(card)
    tracker.end()
    assert list(store.glob("mlartifacts/artifact-place/*/artifacts/card.md"))
    assert not any(work.iterdir()), f"the working directory got {sorted(p.name for p in work.iterdir())}"
