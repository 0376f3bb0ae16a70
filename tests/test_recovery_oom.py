"""Out of memory on the device: the batch is split and retried, never lost.

Driven in-process, through the embedded path (`specq submit` with no broker runs the workers' own chunk
code here), with the fault-injection hook `SPECQ_FAULT_OOM_ABOVE=N`: the engine raises
`torch.OutOfMemoryError` whenever a batch would hold more than N requests, as a device too small for
the batch size does. On CPU the same path takes a MemoryError or the allocator's RuntimeError.
"""

from __future__ import annotations

import json
import logging

import pytest
from sqlalchemy import select

from specq.db.models import Batch
from specq.db.session import open_database
from specq.worker import faults
from specq.worker.chunk import is_out_of_memory
from tests.services import invoke, write_requests

LINES = [{"id": f"q{i}", "prompt": f"def g{i}(y):", "max_tokens": 8, "temperature": 0} for i in range(6)]


def run_embedded(tmp_path, name: str, env: dict) -> tuple[str, list[dict], str]:
    """submit --wait on SQLite in this process; (job id, exported records, database URL)."""
    home = tmp_path / name
    db_url = f"sqlite:///{home / 'specq.db'}"
    path = write_requests(tmp_path / "in.jsonl", LINES)
    environment = {"SPECQ_HOME": str(home), "SPECQ_DATABASE_URL": db_url, **env}
    result = invoke(["submit", path, "--target", TARGET[0], "--batch-size", "8", "--wait"], environment)
    job_id = result.stdout.strip()
    out = home / "out.jsonl"
    assert invoke(["export", job_id, "-o", str(out)], environment).exit_code == 0
    return job_id, [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()], db_url


TARGET: list[str] = []


@pytest.fixture(autouse=True)
def _target(tiny_pair):
    TARGET[:] = [tiny_pair[0]]


def test_batches_split_until_they_fit(tmp_path, monkeypatch, caplog) -> None:
    _, expected, _ = run_embedded(tmp_path, "plain", {})
    monkeypatch.setenv(faults.OOM_ABOVE_ENV, "2")
    with caplog.at_level(logging.WARNING, logger="specq.worker.chunk"):
        job_id, records, db_url = run_embedded(tmp_path, "oom", {})
    assert "out of memory" in caplog.text and "at batch size 4" in caplog.text and "at batch size 2" in caplog.text
    keys = ("id", "completion", "finish_reason", "completion_tokens", "error")
    assert [{k: r[k] for k in keys} for r in records] == [{k: r[k] for k in keys} for r in expected]
    assert all(r["error"] is None for r in records)
    with open_database(db_url).session() as session:
        sizes = session.scalars(select(Batch.size).where(Batch.job_id == job_id).order_by(Batch.id)).all()
    assert sizes == [6, 6, 6]  # three engine runs of the group: batch size 8, 4, then 2, which fits


def test_a_request_that_does_not_fit_alone_fails_alone(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(faults, "oom_above", lambda: 0)  # nothing fits, not even one request
    _, records, _ = run_embedded(tmp_path, "never", {})
    assert len(records) == len(LINES)  # every request still ends with a result
    assert all("out of memory even in a batch of one" in r["error"] for r in records)


def test_what_counts_as_out_of_memory() -> None:
    import torch

    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only the errors torch raises for it
