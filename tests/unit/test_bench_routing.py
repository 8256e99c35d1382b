"""benchmarks/routing.py without a server: its workload arrives interleaved across groups, its figures
add up from the responses' meta_info, its table compares with M = 1 and round robin, and --tiny
builds a model folder the engine can read."""

from __future__ import annotations

import json
import os

from benchmarks.routing import build_workload, figures, parse_args, print_table, tiny_model
from benchmarks.serving import Output
from shared.model_config import ModelConfig

SMALL = "--num-groups 4 --questions-per-group 3 --system-prompt-len 32 --question-len 8".split()


def info(decisions: dict[str, int], workers: int) -> dict:
    return {"router": {"decisions": decisions, "workers": {str(i): {"routed": 0} for i in range(workers)}},
            "internal_states": [{"max_total_tokens": 100, "stats": {}} for _ in range(workers)]}  # fmt: skip


def test_shared_prefix_requests_arrive_interleaved_across_groups():
    args = parse_args(SMALL)
    workload = build_workload(args)
    groups = [tuple(ids[:32]) for ids, _ in workload]
    assert len(workload) == 12 and len(set(groups)) == 4
    assert all(groups.count(g) == 3 for g in set(groups))
    assert groups != sorted(groups, key=groups.index)  # not one group after another
    assert all(len(ids) == 40 and n_out == 16 for ids, n_out in workload)


def test_random_dataset_has_the_same_lengths_and_no_shared_prefix():
    workload = build_workload(parse_args([*SMALL, "--dataset", "random"]))
    assert all(len(ids) == 40 for ids, _ in workload)
    assert len({tuple(ids[:16]) for ids, _ in workload}) == len(workload)


def test_figures_add_up_from_the_responses():
    args = parse_args(SMALL)
    workload = build_workload(args)
    group = {g: i for i, g in enumerate(dict.fromkeys(tuple(ids[:32]) for ids, _ in workload))}
    outputs = []
    for ids, _ in workload:  # group g on worker g % 2, but group 3's last request on worker 0
        g = group[tuple(ids[:32])]
        worker = "0" if g == 3 and sum(o.meta["group"] == 3 for o in outputs) == 2 else str(g % 2)
        meta = {"group": g, "worker_id": worker, "prompt_tokens": 40, "cached_tokens": 20}
        outputs.append(Output(success=True, output_len=16, ttft=0.5, meta=meta))
    failed = next(i for i, o in enumerate(outputs) if o.meta["group"] == 0)
    outputs[failed] = Output(error="HTTP 500")
    before, after = info({"hit": 1, "miss": 0}, 2), info({"hit": 9, "miss": 4}, 2)
    row = figures(args, 2, "cache_aware", workload, outputs, 2.0, before, after)
    assert row["completed"] == 11 and row["failed"] == 1 and row["errors"] == ["HTTP 500"]
    assert row["prompt_tokens"] == 440 and row["prefill_computed"] == 220 and row["hit_rate"] == 0.5
    assert row["requests_per_worker"] == [6, 5] and row["max_over_mean"] == 6 / 5.5
    assert row["groups_on_several_workers"] == 1
    assert row["decisions"] == {"hit": 8, "miss": 4}
    assert row["output_throughput"] == 11 * 16 / 2.0


def test_table_compares_with_one_worker_and_round_robin(capsys):
    none = {"hit": 0, "miss": 0, "imbalance": 0, "shared": 0}
    base = {"dataset": "shared-prefix", "completed": 1, "failed": 0, "requests_per_worker": [1],
            "max_over_mean": 1.0, "groups_on_several_workers": 0, "output_throughput": 1.0,
            "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "decisions": none}  # fmt: skip
    rows = [
        {**base, "workers": 1, "policy": "cache_aware", "hit_rate": 0.8, "prefill_computed": 100},
        {**base, "workers": 4, "policy": "round_robin", "hit_rate": 0.4, "prefill_computed": 400},
        {**base, "workers": 4, "policy": "cache_aware", "hit_rate": 0.76, "prefill_computed": 120},
    ]
    print_table(rows)
    last = capsys.readouterr().out.strip().splitlines()[-1].split(" | ")
    assert last[4:8] == ["76.0", "0.95", "120", "0.30"]


def test_tiny_model_folder_has_a_llama_config_and_the_default_tokenizer(tmp_path):
    folder = tiny_model(str(tmp_path))
    with open(os.path.join(folder, "config.json")) as f:
        cfg = ModelConfig.from_dict(json.load(f))
    assert cfg.num_layers == 2 and cfg.vocab_size == 49152
    assert os.path.isfile(os.path.join(folder, "tokenizer.json"))
    assert not any(name.endswith(".safetensors") for name in os.listdir(folder))  # --load-format dummy
