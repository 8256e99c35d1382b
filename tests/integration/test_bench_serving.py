"""`benchmarks.serving` (SGLang's bench_serving for our server) against the shared server: its streamed
outputs are the server's greedy ones, whether one client process sends every request or two split
them, and the figures add up."""

from __future__ import annotations

from benchmarks.serving import benchmark, metrics, parse_args
from benchmarks.workloads import random_workload


def run(srv, tokenizer, processes: int) -> tuple[list, float, dict]:
    args = parse_args(["--dataset-name", "random", "--num-prompts", "6", "--random-input", "12",
                       "--random-output", "5", "--random-range-ratio", "1.0", "--disable-tqdm",
                       "--client-processes", str(processes)])  # fmt: skip
    workload = random_workload(6, 12, 5, 1.0, 49152, 7)
    outputs, duration = benchmark(args, srv.url, workload)
    return outputs, duration, metrics(workload, outputs, duration, tokenizer)


def test_one_and_two_client_processes_stream_the_same_greedy_outputs(srv, tokenizer):
    one, d1, m1 = run(srv, tokenizer, 1)
    two, d2, m2 = run(srv, tokenizer, 2)
    for outs, m, duration in ((one, m1, d1), (two, m2, d2)):
        assert all(o.success and not o.error for o in outs), [o.error for o in outs]
        assert [o.output_len for o in outs] == [5] * 6  # ignore_eos: every requested token
        assert all(0 < o.ttft <= o.latency <= duration for o in outs)
        assert all(len(o.itl) == 4 for o in outs)  # a gap per token after the first
        assert m["completed"] == 6 and m["total_output_tokens"] == 30
    assert [o.text for o in two] == [o.text for o in one]  # in workload order, whoever sent them
