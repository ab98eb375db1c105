"""A job's own retention of its result (``keep_result_s``), as the worker reads it from the job's record."""

from __future__ import annotations

import pytest

from mlxq.worker.host import keep_of

pytestmark = pytest.mark.unit


def test_a_jobs_keep_is_read_from_its_record_within_bounds() -> None:
    assert keep_of({"keep_result_s": 60}) == 60 and keep_of({"keep_result_s": 0}) == 0
    assert keep_of({"keep_result_s": 10**9}) == 30 * 86_400  # at most 30 days
    assert keep_of({}) is None and keep_of({"keep_result_s": True}) is None and keep_of("x") is None
    assert keep_of({"keep_result_s": -1}) is None and keep_of({"keep_result_s": "60"}) is None
