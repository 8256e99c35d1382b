"""The triton attention backend and the Triton layer ops end to end, on a tiny random model (on CPU
through Triton's interpreter): the same greedy tokens and nearly the same logprobs as the torch
reference, through prefix-cache hits, chunked prefill, mixed extend + decode steps and retraction."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tiny_llama import tiny_llama  # noqa: E402

from shared.model_files import write_dummy_folder  # noqa: E402

TINY = tiny_llama(intermediate_size=96, max_position_embeddings=256)
PROMPTS = [
    list(range(100, 140)),
    list(range(100, 130)) + [7, 8, 9],  # shares 30 tokens with the first: a cached prefix
    [5, 6],
    list(range(300, 317)),
]
PARAMS = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_folder):
    return write_dummy_folder(str(tmp_path_factory.mktemp("tiny")), TINY, seed=3, tokenizer_from=model_folder)


def run(make_engine, folder, backend, **options):
    engine = make_engine(model_path=folder, attention_backend=backend, device="cpu", **options)
    first = engine.generate(input_ids=PROMPTS[0], sampling_params=PARAMS)  # fills the cache
    rest = engine.generate(input_ids=PROMPTS[1:], sampling_params=[PARAMS] * 3, return_logprob=True)
    return [first, *rest], engine.get_stats()


@pytest.fixture(scope="module")
def torch_ref(tiny):
    """The torch backend's outputs, once: its tokens do not depend on the options below (the engine
    tests check that chunking, overlap and retraction keep the output), only the triton runs vary."""
    from sglbus import Engine

    with Engine(model_path=tiny, attention_backend="torch", device="cpu") as engine:
        first = engine.generate(input_ids=PROMPTS[0], sampling_params=PARAMS)
        rest = engine.generate(input_ids=PROMPTS[1:], sampling_params=[PARAMS] * 3, return_logprob=True)
        engine.check_integrity()
    return [first, *rest]


# the tight pool runs what the default options run (a 40-token prefill, a 30-token cache hit, decode
# at batch 3) and retracts a request on top; OVERLAP prefills in 8-token chunks (cached chunks as the
# prefix of the next, extend beside decode in one step) under the GPU's default loop, on CPU
TIGHT = {"max_total_tokens": 60, "new_token_ratio": 0.0}
OVERLAP = {"chunked_prefill_size": 8, "disable_overlap_schedule": False}


@pytest.mark.parametrize("options", [TIGHT, OVERLAP], ids=["tight-pool", "chunked-overlap"])
def test_triton_backend_matches_torch(make_engine, tiny, torch_ref, options):
    got, stats = run(make_engine, tiny, "triton", **options)
    assert stats["cached_tokens"] == 30  # the second prompt's prefix came from the cache
    if "max_total_tokens" in options:
        assert stats["retractions"] > 0
    else:
        assert stats["overlapped_steps"] > 0
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in torch_ref]
    for g, r in zip(got[1:], torch_ref[1:], strict=True):
        for (lg, *_), (lr, *_) in zip(g["meta_info"]["output_token_logprobs"],
                                      r["meta_info"]["output_token_logprobs"], strict=True):  # fmt: skip
            assert abs(lg - lr) < 1e-4


def test_short_extends_as_decode_rows_match_torch(make_engine, tiny, torch_ref):
    """The CUDA-graph path's layout on CPU: the cache hit's 3-token extend runs as three one-token rows
    beside the decodes (each row's attention stops at its own position), with the torch tokens."""
    engine = make_engine(model_path=tiny, attention_backend="triton", device="cpu")
    engine._on_scheduler(lambda s: setattr(s.runner, "rows_max_tokens", 64))
    first = engine.generate(input_ids=PROMPTS[0], sampling_params=PARAMS)
    second = engine.generate(input_ids=PROMPTS[1], sampling_params=PARAMS)  # alone: 3 new tokens as rows
    assert engine.get_stats()["row_steps"] == 1
    assert [first["output_ids"], second["output_ids"]] == [o["output_ids"] for o in torch_ref[:2]]


def test_shared_prefix_decode_matches_torch(make_engine, tiny, monkeypatch):
    """Four requests over one cached 40-token prefix decode through the cascade kernel (thresholds
    lowered to fit the tiny model) and give the torch backend's greedy tokens."""
    import services.scheduler.cascade as cascade
    import sglbus_kernels.decode_attention as decode

    monkeypatch.setattr(cascade, "CASCADE_MIN_GROUP", 4)
    monkeypatch.setattr(cascade, "CASCADE_MIN_PREFIX", 16)
    calls = []
    real = decode.shared_prefix_attention
    monkeypatch.setattr(decode, "shared_prefix_attention", lambda *a: calls.append(1) or real(*a))
    prefix = list(range(400, 440))
    prompts = [prefix + [7 + i, 8 + i, 9] for i in range(4)]
    params = {**PARAMS, "max_new_tokens": 4}

    def run(backend):
        engine = make_engine(model_path=tiny, attention_backend=backend, device="cpu",
                             enable_cascade_attention=True)  # fmt: skip
        engine.generate(input_ids=prefix + [1], sampling_params={**params, "max_new_tokens": 1})  # cached
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=[params] * 4)]

    ref = run("torch")
    assert not calls
    assert run("triton") == ref
    assert calls, "the cascade kernel never ran"


def test_start_up_warm_up_touches_no_request_state(tiny):
    """The CUDA start-up warm-up (every step kind on the padding row, KV slot 0) runs through the
    triton backend and leaves the KV pool, the request rows and the KV of real slots as they were."""
    import torch

    from services.scheduler.model_runner import ModelRunner
    from services.scheduler.warmup import warm_up
    from shared.config import EngineConfig

    runner = ModelRunner(EngineConfig(model_path=tiny, device="cpu", attention_backend="triton",
                                      max_total_tokens=64, max_running_requests=4), tiny)  # fmt: skip
    slots, rows = runner.kv.free_count, runner.req_to_token.free_count
    before = [k[1:].clone() for k in runner.kv.k]
    assert warm_up(runner) > 0
    assert (runner.kv.free_count, runner.req_to_token.free_count) == (slots, rows)
    assert all(torch.equal(k[1:], b) for k, b in zip(runner.kv.k, before, strict=True))
