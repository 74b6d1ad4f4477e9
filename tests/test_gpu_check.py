"""The prepared GPU check (eval/gpu/gpu_check.py) in its tiny mode on the CPU, as CI runs it: every
part records, the device-against-CPU part is exact CPU against CPU, and a spent time limit skips parts
rather than running them."""

from __future__ import annotations

import pytest
import torch

from eval.common.results_io import read_records
from eval.gpu import gpu_check


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_mode_runs_every_part_on_the_cpu(tmp_path, one_thread):
    """Every part runs (about 30 s of the limit here): a part or a case skipped in tiny mode on the CPU
    is a failure, since CI's run is all that checks the parts between GPU runs."""
    assert gpu_check.main(["--tiny", "--device", "cpu", "--time-limit", "900", "--out", str(tmp_path)]) == 0
    records = read_records(tmp_path)
    assert [r["name"] for r in records] == gpu_check.PART_NAMES
    assert {r["name"]: (r["status"], r.get("reason") or r.get("error")) for r in records} == {name: ("ok", None) for name in gpu_check.PART_NAMES}
    for record in records:
        assert record["device"] == "cpu" and record["mode"] == "tiny"
        assert record["torch"] == torch.__version__ and record["transformers"][0].isdigit()
        assert record["date"] and record["command"].startswith("python -m eval gpu_check --tiny")
        cases = [row.get("status") for row in record.get("rows", []) if row.get("status") is not None]
        assert all(status == "ok" for status in cases), (record["name"], cases)
    by_name = {r["name"]: r for r in records}
    compare = [row for row in by_name["device_vs_cpu"]["rows"] if row.get("status") == "ok"]
    assert len(compare) >= 12 and all(row["equal"] and row["kept_equal"] for row in compare)  # the CPU against itself
    assert all(row["max_logit_gap"] == 0 for row in compare if row.get("max_logit_gap") is not None)
    compiled = [row for row in by_name["compiled_decode"]["rows"] if row.get("status") == "ok"]
    assert len(compiled) == 8 and all(row["same_tokens"] and row["decode_step"] == "compiled" for row in compiled), compiled
    oom = by_name["concurrency_oom"]["summary"]
    assert oom["oom_raised"] and oom["served_after"]
    table = (tmp_path / "table.md").read_text()
    assert "device_vs_cpu" in table and "(cpu), tiny mode" in table


def test_a_spent_time_limit_skips_the_parts_instead_of_running_them(tmp_path):
    assert gpu_check.main(["--tiny", "--device", "cpu", "--time-limit", "0.001", "--out", str(tmp_path)]) == 0
    records = read_records(tmp_path)
    assert [r["name"] for r in records] == gpu_check.PART_NAMES
    later = records[1:]
    assert all(r["status"] == "skipped" and r["reason"] == "time limit" for r in later), [(r["name"], r["status"]) for r in later]
    assert all(r["seconds"] < 1 for r in later)


def test_bad_arguments_exit_nonzero(tmp_path):
    assert gpu_check.main(["--time-limit", "0", "--out", str(tmp_path)]) == 2
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--device", "tpu", "--out", str(tmp_path)])
    assert exc.value.code == 2
