"""The train stage survives a real fault: a Ray Train worker SIGKILLed mid-run is replaced and
the run resumes from its last checkpoint and completes (``train.max_failures=1``).

Nothing in the production code knows about this test. A background thread watches the Ray Train
run directory; once the first checkpoint is on disk and registered, it looks the worker processes
up in Ray's actor table and kills one with SIGKILL. What is asserted afterwards is only what Ray
and MLflow record on their own: the killed actor is dead, a second worker group was started after
the kill, and rank 0 of that group logged its first loss right after a checkpoint step (it resumed,
it did not start over) and went on to the last step.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from components.config import SpeclineConfig, TrainConfig
from components.drafters import load_drafter
from components.tracking import Tracker
from pipelines import train
from tests.pipelines.conftest import TRAIN_DATA, TRAIN_DRAFTER

pytestmark = pytest.mark.slow

DATA = TRAIN_DATA
DRAFTER = TRAIN_DRAFTER
# Ray Train registers a reported checkpoint only when its controller next polls the workers (every
# 2 s); enough steps after the first checkpoint keep the kill well inside the run.
STEPS, CKPT_EVERY, LOG_EVERY, WORKERS = 20, 4, 2, 2
TRAIN = TrainConfig(num_workers=WORKERS, cpus_per_worker=0.5, batch_size=2, max_steps=STEPS, lr=5e-3,
                    warmup_steps=1, log_every=LOG_EVERY, checkpoint_every=CKPT_EVERY, eval_fraction=0.2,
                    eval_batch_size=4, max_failures=1, keep_checkpoints=2)
WORKER_CLASS = "RayTrainWorker"  # the actor class of Ray Train (V2) workers
SNAPSHOT = "checkpoint_manager_snapshot.json"  # written by Ray Train when it registers a checkpoint


@pytest.fixture
def data_dir(train_data_dir) -> Path:
    return train_data_dir


def _train_workers() -> dict[str, dict[str, Any]]:
    """Every Ray Train worker actor the cluster has seen (alive or dead), by actor id.

    Read from the GCS actor table: the session's Ray runs without the dashboard, which the
    ``ray.util.state`` API needs."""
    from ray._private import state

    return {aid: a for aid, a in state.actors().items() if a["ActorClassName"] == WORKER_CLASS}


class WorkerKiller(threading.Thread):
    """Waits for the run's first registered checkpoint, then SIGKILLs one live worker process."""

    def __init__(self, run_dir: Path, timeout_s: float = 400.0):
        super().__init__(name="worker-killer", daemon=True)
        self.run_dir, self.timeout_s = run_dir, timeout_s
        self.done = threading.Event()  # set by the test when the run returned
        self.killed: dict[str, Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._watch_and_kill()
        except BaseException as err:  # noqa: BLE001  (reported by the test)
            self.error = err

    def _checkpointed(self) -> bool:
        return any(p.is_dir() for p in self.run_dir.glob("checkpoint_*")) and (self.run_dir / SNAPSHOT).is_file()

    def _watch_and_kill(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.done.is_set() and time.monotonic() < deadline:
            if self._checkpointed():
                alive = {aid: a for aid, a in _train_workers().items() if a["State"] == "ALIVE" and a["Pid"]}
                if len(alive) == WORKERS:
                    aid, victim = min(alive.items(), key=lambda kv: kv[1]["Pid"])
                    os.kill(victim["Pid"], signal.SIGKILL)
                    self.killed = {"actor_id": aid, "pid": victim["Pid"], "time_ms": time.time() * 1000,
                                   "group": set(alive)}
                    return
            time.sleep(0.05)


def test_a_worker_killed_mid_run_is_replaced_and_the_run_resumes_and_completes(
        tmp_path, tiny_target_cfg, tiny_target, data_dir, ray_session):
    tc = dataclasses.replace(TRAIN, data_dir=str(data_dir), output_dir=str(tmp_path / "runs" / "train"))
    cfg = SpeclineConfig(run_dir=str(tmp_path / "runs"), target=tiny_target_cfg, data=DATA, drafter=DRAFTER, train=tc)
    before = set(_train_workers())  # worker actors of earlier runs in this Ray session
    killer = WorkerKiller(Path(tc.output_dir) / "offline")
    killer.start()
    tracker = Tracker(cfg)
    try:
        with tracker.run("train"):
            out = train.run(cfg, tracker, {})
    finally:
        killer.done.set()
        killer.join(timeout=30)
    assert killer.error is None, repr(killer.error)
    killed = killer.killed
    assert killed is not None, "the run ended before a worker could be killed: nothing was tested"

    # The run came back whole: every step trained, a loadable final drafter.
    assert out["train_steps"] == STEPS, out
    assert load_drafter(out["drafter_path"], tiny_target).num_parameters() > 0

    # Ray saw the kill and started a fresh worker group after it.
    workers = _train_workers()
    assert workers[killed["actor_id"]]["State"] == "DEAD", workers[killed["actor_id"]]
    assert killed["group"] <= set(workers) - before and len(killed["group"]) == WORKERS
    replacements = set(workers) - before - killed["group"]
    assert len(replacements) == WORKERS, f"expected one replacement group, got {len(replacements)} new workers"
    restarted_ms = min(workers[a]["StartTime"] for a in replacements)
    assert restarted_ms > killed["time_ms"], (restarted_ms, killed["time_ms"])  # ms since the epoch, one host

    # MLflow: rank 0 of the first group logged steps 2, 4, ... until the kill; rank 0 of the new
    # group (every entry logged after it started) began right after a checkpoint step, not at the
    # first step, and went on to the last one.
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    history = client.get_metric_history(out["train_objectives"][0]["run_id"], "train/loss")
    first = sorted(m.step for m in history if m.timestamp < restarted_ms)
    second = sorted(m.step for m in history if m.timestamp >= restarted_ms)
    assert second, f"nothing trained after the restart: {first}"
    resumed_at = second[0] - LOG_EVERY
    assert resumed_at >= CKPT_EVERY and resumed_at % CKPT_EVERY == 0, (first, second)
    assert second == list(range(resumed_at + LOG_EVERY, STEPS + 1, LOG_EVERY)), (first, second)
    assert first[:resumed_at // LOG_EVERY] == list(range(LOG_EVERY, resumed_at + 1, LOG_EVERY)), (first, second)
    assert max(first) < STEPS, f"the kill landed after training finished: {first}"
