"""QPS log writer/reader: round trip, rank merging, and one-line errors on malformed input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distopt.metrics.qps_log import QpsLogError, QpsLogWriter, load_run, log_path, read_log


def write_rank(
    out: Path, rank: int, times: list[float], *, run_id: str = "r1", world_size: int = 2, **kw
) -> Path:
    with QpsLogWriter.create(
        out,
        run_id=run_id,
        variant="baseline",
        rank=rank,
        world_size=world_size,
        global_batch_size=64,
        config={"model": "mlp", "steps": len(times)},
        **kw,
    ) as writer:
        for step, t in enumerate(times):
            writer.log_step(step, t, timestamp=1000.0 + step)
    return writer.path


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    path = write_rank(tmp_path, 0, [0.5, 0.25], extra={"predicted_gain": 1.3})
    assert path == log_path(tmp_path, "r1", 0) == tmp_path / "r1" / "qps-rank0.jsonl"
    log = read_log(path)
    header = log.header
    assert (
        header["type"] == "header" and header["run_id"] == "r1" and header["variant"] == "baseline"
    )
    assert header["config"] == {"model": "mlp", "steps": 2}
    assert header["predicted_gain"] == 1.3
    assert set(header["versions"]) == {"python", "torch", "distopt"}
    assert header["host"]["hostname"] and "git_revision" in header
    assert [s.step for s in log.steps] == [0, 1]
    assert [s.qps for s in log.steps] == [128.0, 256.0]  # global batch / step time
    assert log.steps[1].timestamp == 1001.0 and log.steps[1].world_size == 2
    assert log.footer is not None and log.footer["status"] == "ok" and log.footer["steps"] == 2


def test_every_line_is_flushed_before_close(tmp_path: Path) -> None:
    writer = QpsLogWriter.create(
        tmp_path, run_id="r", variant="v", rank=0, world_size=1, global_batch_size=8, config={}
    )
    writer.log_step(0, 0.1)
    lines = writer.path.read_text().splitlines()  # a crashed job keeps what it logged
    assert [json.loads(line)["type"] for line in lines] == ["header", "step"]
    log = read_log(writer.path)
    assert log.footer is None and len(log.steps) == 1
    writer.close()


def test_exception_inside_writer_marks_footer_failed(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        with QpsLogWriter.create(
            tmp_path, run_id="r", variant="v", rank=0, world_size=1, global_batch_size=8, config={}
        ) as writer:
            writer.log_step(0, 0.1)
            raise ValueError("boom")
    footer = read_log(writer.path).footer
    assert footer is not None and footer["status"] == "failed" and "boom" in footer["error"]


def test_merge_uses_slowest_rank_and_complete_steps(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, [0.1, 0.2, 0.1])
    write_rank(tmp_path, 1, [0.2, 0.1])  # rank 1 logged only two steps
    run = load_run(tmp_path / "r1")
    assert sorted(run.ranks) == [0, 1] and run.world_size == 2
    merged = run.merged_steps()
    assert [m.step for m in merged] == [0, 1]
    assert [m.step_time_s for m in merged] == [0.2, 0.2]
    assert [m.qps for m in merged] == [320.0, 320.0]


def test_single_file_loads_as_a_run(tmp_path: Path) -> None:
    path = write_rank(tmp_path, 1, [0.5])
    run = load_run(path)
    assert list(run.ranks) == [1] and run.run_id == "r1"


def test_reserved_header_keys_cannot_be_overridden(tmp_path: Path) -> None:
    with pytest.raises(QpsLogError, match="'run_id' is reserved"):
        write_rank(tmp_path, 0, [0.1], extra={"run_id": "other"})


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected an object with type header/step/eval/footer"),
        ('{"type": "step"}', "lacks 'run_id'"),
        ('{"type": "header"}', "a second header record"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write_rank(tmp_path, 0, [0.1, 0.1])
    lines = path.read_text().splitlines()
    lines.insert(2, line)  # after the header and the first step
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(QpsLogError) as info:
        read_log(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_field_value_is_named(tmp_path: Path) -> None:
    path = write_rank(tmp_path, 0, [0.1])
    lines = path.read_text().splitlines()
    step = json.loads(lines[1])
    step["step_time_s"] = "fast"
    lines[1] = json.dumps(step)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        QpsLogError, match=rf"{path}:2: step field 'step_time_s' has bad value 'fast'"
    ):
        read_log(path)


def test_first_record_must_be_header(tmp_path: Path) -> None:
    path = write_rank(tmp_path, 0, [0.1])
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[1:]) + "\n")
    with pytest.raises(QpsLogError, match=r":1: the first record must be the header"):
        read_log(path)


def test_missing_and_empty_runs(tmp_path: Path) -> None:
    with pytest.raises(QpsLogError, match="run not found: .*nope"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(QpsLogError, match=r"no QPS logs \(qps-rank\*.jsonl\) in run directory"):
        load_run(tmp_path / "empty")
    (tmp_path / "empty" / "qps-rank0.jsonl").write_text("")
    with pytest.raises(QpsLogError, match="empty QPS log"):
        load_run(tmp_path / "empty")
    path = write_rank(tmp_path, 0, [])
    with pytest.raises(QpsLogError, match="no step records"):
        load_run(path.parent)


def test_ranks_of_different_runs_are_refused(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, [0.1])
    other = write_rank(tmp_path, 1, [0.1], run_id="r2")
    other.rename(tmp_path / "r1" / other.name)
    with pytest.raises(QpsLogError, match="run_id 'r2' differs from 'r1'"):
        load_run(tmp_path / "r1")


def test_step_phases_round_trip_and_bad_phases_are_named(tmp_path: Path) -> None:
    phases = {"data": 0.001, "forward": 0.02, "waits": 0.015, "backward": 0.004}
    with QpsLogWriter.create(
        tmp_path,
        run_id="r1",
        variant="optimized",
        rank=0,
        world_size=1,
        global_batch_size=64,
        config={"model": "mlp"},
    ) as writer:
        writer.log_step(0, 0.03, phases=phases)
        writer.log_step(1, 0.03)
    log = read_log(writer.path)
    assert log.steps[0].phases == phases and log.steps[1].phases is None
    lines = writer.path.read_text().splitlines()
    assert "phases" not in json.loads(lines[2])  # absent when not given
    step = json.loads(lines[1])
    step["phases"] = {"forward": -1}
    lines[1] = json.dumps(step)
    writer.path.write_text("\n".join(lines) + "\n")
    with pytest.raises(QpsLogError, match=r":2: step field 'phases' has bad value"):
        read_log(writer.path)


def test_a_rerun_keeps_the_earlier_attempts_logs(tmp_path: Path) -> None:
    """A restarted or requeued job writes its log anew; earlier attempts stay beside it as
    ``.1``, ``.2`` (newest first) and the run reads only the newest."""
    for times in ([0.5, 0.5, 0.5], [0.25, 0.25], [0.125]):
        write_rank(tmp_path, 0, times, world_size=1)
    path = log_path(tmp_path, "r1", 0)
    kept = [path, path.with_name("qps-rank0.jsonl.1"), path.with_name("qps-rank0.jsonl.2")]
    assert [len(read_log(p).steps) for p in kept] == [1, 2, 3]
    assert [s.step_time_s for s in load_run(tmp_path / "r1").merged_steps()] == [0.125]
