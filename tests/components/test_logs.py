"""The log session: what reaches the console, what reaches the file, and Ray workers' output."""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import pytest

from components import cluster, logs
from components.config import ConfigError, SpeclineConfig


def _cfg(tmp_path: Path, level: str = logs.INFO) -> SpeclineConfig:
    return SpeclineConfig(run_dir=str(tmp_path), log_level=level)


def _emit_one_of_each() -> None:
    logging.getLogger("specline.pipeline").info("stage line")
    logging.getLogger("components.evaluation.prompts").warning("our own warning")
    logging.getLogger("components.evaluation.prompts").info("our own detail")
    logging.getLogger("some.library").info("library chatter")
    logging.getLogger("some.library").error("library failure")
    logging.getLogger(logs.WORKER_LOGGER).info("(Worker pid=1 stdout) worker line")
    logging.getLogger("specline").info("the result", extra=logs.FILE_ONLY)


def test_info_console_shows_stage_lines_and_errors_the_file_everything(tmp_path, capsys):
    with logs.session(_cfg(tmp_path), "demo") as path:
        assert logs.console_level() == logs.INFO and logs.log_file() == path
        _emit_one_of_each()
    err = capsys.readouterr().err
    assert "stage line" in err and "library failure" in err and "our own warning" in err
    assert "library chatter" not in err and "worker line" not in err and "the result" not in err
    assert "our own detail" not in err
    text = path.read_text()
    for line in ("stage line", "library chatter", "library failure", "worker line", "the result", "our own detail"):
        assert line in text, line
    assert path.parent == tmp_path.resolve() / "logs" and path.name.endswith("-demo.log")


def test_verbose_console_shows_library_records_but_not_worker_lines(tmp_path, capsys):
    with logs.session(_cfg(tmp_path, logs.VERBOSE), "demo"):
        _emit_one_of_each()
    err = capsys.readouterr().err
    assert "library chatter" in err and "stage line" in err
    assert "worker line" not in err  # Ray prints those itself in verbose mode


def test_session_ends_cleanly_and_a_second_one_replaces_the_first(tmp_path, capsys):
    root = logging.getLogger()
    before = list(root.handlers)
    # a session opened before the last one ended (e.g. a test calling main twice): replaced
    with logs.session(_cfg(tmp_path / "a"), "one") as first, logs.session(_cfg(tmp_path / "b"), "two") as second:
        logging.getLogger("specline").info("only in the second")
        assert sum(isinstance(h, logs.RunFileHandler) for h in root.handlers) == 1
    assert root.handlers == before and logs.console_level() is None and logs.log_file() is None
    assert "only in the second" in second.read_text() and "only in the second" not in first.read_text()
    logging.getLogger("specline").info("after the session")
    assert "after the session" not in capsys.readouterr().err


def test_python_warnings_go_to_the_file_only(tmp_path, capsys):
    with logs.session(_cfg(tmp_path), "demo") as path:
        warnings.warn("a deprecated thing", FutureWarning, stacklevel=1)
    assert "a deprecated thing" not in capsys.readouterr().err
    assert "a deprecated thing" in path.read_text()


def test_a_library_with_its_own_console_handler_is_adopted_only_within_a_session(tmp_path, capsys):
    lib = logging.getLogger("selfish.library")
    lib.addHandler(logging.StreamHandler())
    lib.propagate = False
    try:
        logs.adopt_library_loggers(("selfish.library",))  # outside a session: left alone
        assert lib.handlers and not lib.propagate
        with logs.session(_cfg(tmp_path), "demo") as path:
            logs.adopt_library_loggers(("selfish.library",))
            lib.warning("routed")
        assert not lib.handlers and lib.propagate
        assert "routed" in path.read_text() and "routed" not in capsys.readouterr().err
    finally:
        lib.handlers.clear()
        lib.propagate = True


def test_unknown_log_level_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="log_level: 'loud' is not one of"), logs.session(_cfg(tmp_path, "loud"), "x"):
        pass


def test_log_path_is_stamped_and_named():
    stamp = time.mktime((2026, 12, 1, 11, 45, 54, 0, 0, -1))
    assert logs.log_path(Path("/r"), "pipeline", stamp) == Path("/r/logs/20261201-114554-pipeline.log")


def test_worker_lines_land_in_the_file_without_tqdm_or_autoscaler_noise(tmp_path, ray_session):
    with logs.session(_cfg(tmp_path), "demo") as path:
        cluster.write_worker_lines({"pid": 42, "actor_name": "ShardWriter", "is_err": True, "ip": "1.2.3.4",
                                    "localhost": "1.2.3.4",
                                    "lines": ["real line", '{"__ray_tqdm_magic_token__": true}']})
        cluster.write_worker_lines({"pid": "autoscaler", "lines": ["======== Autoscaler status ========"]})
    text = path.read_text()
    assert "(ShardWriter pid=42 stderr) real line" in text
    assert "tqdm_magic" not in text and "Autoscaler status" not in text


def test_workers_draw_no_bars_only_within_an_info_session():
    from components.config import RayConfig

    assert cluster.local_init_kwargs(RayConfig(), logs.INFO)["runtime_env"] == {"env_vars": cluster.QUIET_WORKER_ENV}
    assert "runtime_env" not in cluster.local_init_kwargs(RayConfig(), logs.VERBOSE)
    assert "runtime_env" not in cluster.local_init_kwargs(RayConfig())


def test_ray_worker_output_goes_to_the_file_not_the_console(tmp_path, ray_session, capfd):
    """Through Ray's own log stream: a task's print reaches the session's file, and Ray's printer
    is off at info (restored afterwards for the rest of the test session)."""
    import ray
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    saved = list(dispatcher.handlers)
    assert cluster.RAY_PRINTER in [name for name, _ in saved]  # the mechanism this relies on
    marker = f"marker-{time.time_ns()}"

    @ray.remote(num_cpus=0.25)
    def shout(text: str) -> None:
        print(text, flush=True)

    try:
        with logs.session(_cfg(tmp_path), "demo") as path:
            cluster.route_worker_output(logs.INFO)
            assert [name for name, _ in dispatcher.handlers].count(cluster.LOG_WRITER) == 1
            assert cluster.RAY_PRINTER not in [name for name, _ in dispatcher.handlers]
            ray.get(shout.remote(marker))
            deadline = time.monotonic() + 20
            while marker not in path.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert marker in path.read_text()
    finally:
        dispatcher.handlers = saved
    out, err = capfd.readouterr()
    assert marker not in out and marker not in err


def test_a_workers_progress_line_is_a_console_line(tmp_path, ray_session, capsys):
    with logs.session(_cfg(tmp_path), "demo") as path:
        cluster.write_worker_lines({"pid": 7, "actor_name": "RayTrainWorker", "is_err": False,
                                    "lines": [logs.progress_line("train: step 10/200, loss 1.234"), "chatter"]})
        cluster.write_worker_lines({"pid": 7, "lines": [logs.progress_line("train: step 10/200, loss 1.234")]})
    err = capsys.readouterr().err
    assert err.count("train: step 10/200, loss 1.234") == 1  # delivered twice, shown once
    assert "[specline progress]" not in err and "chatter" not in err
    assert "train: step 10/200" in path.read_text() and "(RayTrainWorker pid=7 stdout) chatter" in path.read_text()


def test_the_train_loops_progress_text_names_step_loss_and_acceptance():
    from components.training.loop import _progress_text

    text = _progress_text({"train/step": 20, "train/loss": 1.5, "train/alpha/1": 0.25, "train/step_seconds": 2.5}, 200)
    assert text == "train: step 20/200, loss 1.500, α1 0.25, s/step 2.5"
