"""When a batch refills its free rows and when a drained batch drops them (decoding/idle_rows.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding.idle_rows import IdleRows
from specq.decoding.prefill_groups import PrefillCost
from tests.tiny_models import EOS, IdTokenizer, reference_greedy

_LONG = 30  # tokens of the rows that run on


def _idle_rows(batch_size: int = 4) -> IdleRows:
    return IdleRows(batch_size, torch.device("cpu"))


def test_free_rows_wait_for_a_row_about_to_end_and_not_for_one_far_off():
    idle = _idle_rows()
    idle.stepped(1.0, live=3, rows=4)  # one row free a step: a quarter of a step idled
    overhead_s = 3.0
    # the next row ends next step: waiting for it costs a quarter step, less than a forward's overhead
    assert not idle.refill_due(np.array([1, 20, 20]), overhead_s)
    # the next row ends 12 steps on: waiting for it would idle 3 s, what the refill it joins saves
    assert idle.refill_due(np.array([12, 20, 20]), overhead_s)
    assert not idle.refill_due(np.array([11, 20, 20]), overhead_s)


def test_ski_rental_refills_once_idling_cost_a_forwards_overhead_and_at_once_when_none_is_live():
    idle = _idle_rows()
    assert not idle.refill_due(np.array([1, 1, 1, 1]), 3.0)  # no row free
    assert idle.refill_due(np.array([], np.int64), 3.0)  # no row live
    for _ in range(11):
        idle.stepped(1.0, live=3, rows=4)
    assert not idle.refill_due(np.array([1, 1, 1]), 3.0)  # 2.75 s idled, and rows end next step
    idle.stepped(1.0, live=3, rows=4)
    assert idle.refill_due(np.array([1, 1, 1]), 3.0)
    idle.refilled()
    assert not idle.refill_due(np.array([1, 1, 1]), 3.0)


def test_a_drained_batch_compacts_once_its_free_rows_idled_what_compacting_costs():
    idle = _idle_rows()
    assert not idle.compaction_due()  # nothing idled yet
    for _ in range(3):
        idle.stepped(1.0, live=3, rows=4)
    assert not idle.compaction_due()  # until a compaction is timed, it is priced at a step's time
    idle.stepped(1.0, live=3, rows=4)
    assert idle.compaction_due()
    with idle.compacting():
        pass  # a compaction that cost (next to) nothing
    assert not idle.compaction_due()  # idle time counts from the compaction on
    idle.stepped(1.0, live=2, rows=3)
    assert idle.compaction_due()


@pytest.fixture
def virtual_time(monkeypatch):
    """Every step takes 1 s and a refill's forwards cost 3 s beyond their tokens, whatever the clock says."""
    stepped = IdleRows.stepped
    monkeypatch.setattr(IdleRows, "stepped", lambda self, t_step, live, rows: stepped(self, 1.0, live, rows))
    monkeypatch.setattr(PrefillCost, "overhead_seconds", lambda self: 3.0)


def _requests(target, max_tokens: list[int]) -> list[GenerationRequest]:
    """Requests of these max_tokens whose greedy completions hold no EOS, so each ends at its max_tokens."""
    generator = torch.Generator().manual_seed(5)
    requests: list[GenerationRequest] = []
    while len(requests) < len(max_tokens):
        prompt = torch.randint(2, 64, (int(torch.randint(3, 12, (1,), generator=generator)),), generator=generator)
        if EOS not in reference_greedy(target, prompt.tolist(), _LONG):
            n = len(requests)
            requests.append(
                GenerationRequest(n, tuple(prompt.tolist()), SamplingParams(max_tokens[n], temperature=0.0))
            )
    return requests


def _run(target, requests, monkeypatch, **config) -> tuple[list[tuple[int, int]], list[int]]:
    """Decode `requests` at batch 4: (rows filled, steps before it) of each admission, and the batch's rows
    at each step. Every completion must be the target's own greedy one."""
    engine = SpeculativeEngine(target, IdTokenizer(), None, DecodingConfig(batch_size=4, strict=True, **config))
    admissions: list[tuple[int, int]] = []
    rows: list[int] = []
    admit, step = engine._admit, engine._step

    def counted_admit(batch, admitted):
        admissions.append((len(admitted), len(rows)))
        return admit(batch, admitted)

    def counted_step(batch):
        rows.append(batch.rows)
        return step(batch)

    monkeypatch.setattr(engine, "_admit", counted_admit)
    monkeypatch.setattr(engine, "_step", counted_step)
    results = {r.key: r.token_ids for r in engine.generate(requests)}
    for request in requests:
        expected = reference_greedy(target, list(request.prompt_token_ids), request.params.max_tokens)
        assert results[request.key] == expected, f"request {request.key}"
    return admissions, rows


def test_a_row_that_ends_long_before_the_rest_is_refilled_at_once(target, virtual_time, monkeypatch):
    # the row of 2 tokens ends at the first step; the others run 28 steps more: idling until then would
    # cost 7 s, so it is refilled at once (the ski rental alone would wait 12 steps)
    admissions, _ = _run(target, _requests(target, [2, _LONG, _LONG, _LONG, _LONG]), monkeypatch)
    assert admissions == [(4, 0), (1, 1)]


def test_a_row_about_to_end_is_waited_for_and_both_refilled_in_one_prefill(target, virtual_time, monkeypatch):
    # the row of 2 tokens ends at the first step, the row of 3 at the second: one prefill takes both
    admissions, _ = _run(target, _requests(target, [2, 3, _LONG, _LONG, _LONG, _LONG]), monkeypatch)
    assert admissions == [(4, 0), (2, 2)]


@pytest.mark.parametrize("static_shapes", [False, True])
def test_a_drained_batch_drops_free_rows_before_half_of_it_is_free(target, virtual_time, monkeypatch, static_shapes):
    # no request waits: the row of 2 tokens ends at the first step and idles a quarter step a step, so
    # the batch drops it after four steps (the price of a compaction not yet timed: a step), long before
    # a second row ends; with static shapes only sizes of the batch's buckets are taken
    _, rows = _run(target, _requests(target, [2, 20, 25, _LONG]), monkeypatch, static_shapes=static_shapes)
    if static_shapes:
        assert set(rows) <= {4, 2, 1} and 2 in rows
    else:
        assert rows[:5] == [4] * 5 and rows[5:20] == [3] * 15
