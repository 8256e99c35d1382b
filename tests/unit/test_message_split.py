"""encode_split: a step's output over the bus's max payload goes out as several messages of whole
requests, each request's NewReqInfo with it, nothing lost or reordered."""

from __future__ import annotations

from shared.finish import Length
from shared.messages import (
    BatchTextOut,
    BatchTokenOut,
    Decoder,
    LogprobOut,
    NewReqInfo,
    TextOut,
    encode,
    encode_split,
)


def token_out(with_logprobs: bool) -> BatchTokenOut:
    rids = [f"r{i}" for i in range(5)]
    infos = [NewReqInfo(rid=r, out_subject="g") for r in ("r1", "r3")]
    lps = [LogprobOut(input_token=bytes(3000)) if i % 2 else None for i in range(5)]
    return BatchTokenOut(
        new_reqs=infos, rids=rids, token_ids=[[i] for i in range(5)], cached_tokens=[0] * 5,
        offsets=list(range(5)), finish_reasons=[None, Length(1), None, None, None],
        logprobs=lps if with_logprobs else [],
    )  # fmt: skip


def test_small_messages_stay_one():
    msg = token_out(True)
    assert encode_split(msg, 1 << 20) == [encode(msg)]


def test_token_out_splits_into_whole_requests():
    dec = Decoder(BatchTokenOut)
    for with_lp in (True, False):
        msg = token_out(with_lp)
        limit = 3500 if with_lp else 60
        parts = [dec(d) for d in encode_split(msg, limit)]
        assert len(parts) > 1
        assert all(len(encode(p)) <= limit or len(p.rids) == 1 for p in parts)
        assert [r for p in parts for r in p.rids] == msg.rids
        assert [t for p in parts for t in p.token_ids] == msg.token_ids
        assert [f for p in parts for f in p.finish_reasons] == msg.finish_reasons
        assert [lp for p in parts for lp in (p.logprobs or [None] * len(p.rids))] == (
            msg.logprobs or [None] * 5
        )
        for p in parts:  # a request's announcement travels with its first item
            assert {i.rid for i in p.new_reqs} <= set(p.rids)
        assert sorted(i.rid for p in parts for i in p.new_reqs) == ["r1", "r3"]


def test_text_out_splits_by_request():
    msg = BatchTextOut(outs=[TextOut(rid=f"r{i}", text="x" * 100, output_ids=[i]) for i in range(4)])
    parts = [Decoder(BatchTextOut)(d) for d in encode_split(msg, 250)]
    assert len(parts) >= 2 and [o.rid for p in parts for o in p.outs] == ["r0", "r1", "r2", "r3"]
