"""Constrained decoding: throughput and forward passes with and without jump-forward, and what the
grammar mask costs a step.

Workloads (seed 001's JSON decoding, §4 / Appendix B of the paper, and a regex one):
    json   extract six fields of a person from a short passage into a JSON object of a fixed schema
    regex  the same facts as one line of a fixed format: `Name: ..., born ..., works as ....`

Each round runs, one after the other in this process: (A) the constrained workload with
jump-forward, (B) the same with `--disable-jump-forward`, and (C) the same prompts unconstrained,
each request asked for exactly B's number of output tokens (`ignore_eos`), so B and C take the same
steps and differ by the mask alone. Reported: requests/s and output tok/s, forward passes (scheduler
steps), the mean step time, the mask's share of B's step (1 - C/B, per step), and how many outputs are
valid. The jump-forward speedup is A's requests/s over B's (the same requests): tokens/s understates it,
since retokenization writes the same text in fewer, canonical tokens (A's outputs are shorter in tokens).

    python -m benchmarks.constrained --workload json --num-prompts 64
    python -m benchmarks.constrained --model-path <config folder> --load-format dummy --num-prompts 256
    python -m benchmarks.constrained --workload json --num-prompts 64 --launch-server

With `--launch-server` each of A and B runs on its own `sglbus serve` (the scheduler, detokenizer and
gateway in processes of their own, as deployed; a batch is one `/generate` of all its prompts); by
default on an in-process Engine, whose detokenizer shares the scheduler's process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.stack_profile import StackProfile

FIRST = ["Alice", "Bruno", "Chiara", "Dmitri", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Julia"]
LAST = ["Moreau", "Okafor", "Lindqvist", "Tanaka", "Silva", "Novak", "Haddad", "Kowalski"]
CITIES = ["Lyon", "Lagos", "Uppsala", "Osaka", "Recife", "Brno", "Beirut", "Krakow", "Porto"]
JOBS = ["chemist", "architect", "violinist", "nurse", "geologist", "pilot", "teacher", "engineer"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "birth_year": {"type": "integer", "minimum": 1900, "maximum": 2010},
        "birth_city": {"type": "string", "maxLength": 24},
        "occupation": {"type": "string", "maxLength": 24},
        "nationality": {"type": "string", "maxLength": 24},
        "is_alive": {"type": "boolean"},
    },
    "required": ["name", "birth_year", "birth_city", "occupation", "nationality", "is_alive"],
    "additionalProperties": False,
}
REGEX = r"Name: [A-Z][a-z]+ [A-Z][a-z]+, born (19|20)\d\d in [A-Z][a-z]+, works as an? [a-z]+\."


def _passages(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        year, city, job = rng.randrange(1930, 2005), rng.choice(CITIES), rng.choice(JOBS)
        alive = rng.random() < 0.8
        out.append(f"{name} was born in {city} in {year}. {name.split()[0]} works as a {job}"
                   f"{'' if alive else ' and died in 2019'}.")  # fmt: skip
    return out


def workload(kind: str, n: int) -> tuple[list[str], dict[str, Any], Any]:
    """Prompts, the sampling parameters, and a validity check of one output text."""
    if kind == "json":
        prompts = [f"Passage: {p}\nExtract the person's facts as JSON.\nJSON:" for p in _passages(n)]
        params = {"temperature": 0, "max_new_tokens": 256, "json_schema": json.dumps(SCHEMA)}

        def valid(text: str) -> bool:
            try:
                obj = json.loads(text)
            except ValueError:
                return False
            return isinstance(obj, dict) and set(obj) == set(SCHEMA["properties"])

        return prompts, params, valid
    prompts = [f"Passage: {p}\nThe same in one line:\n" for p in _passages(n)]
    return (
        prompts,
        {"temperature": 0, "max_new_tokens": 128, "regex": REGEX},
        lambda t: bool(re.fullmatch(REGEX, t)),
    )


class Served:
    """The workload against a launched `sglbus serve`: a batch is one `/generate` of all its prompts
    (SGLang's batch form), counters from `/get_server_info`."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _call(self, method: str, path: str, body: Any = None, timeout: float = 3600) -> bytes:
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read()

    def generate(self, prompts: list[str], params: Any) -> list[dict[str, Any]]:
        out = json.loads(self._call("POST", "/generate", {"text": prompts, "sampling_params": params}))
        return out if isinstance(out, list) else [out]

    def flush_cache(self) -> None:
        import urllib.error

        for _ in range(100):  # refused while the previous batch's last requests still end
            try:
                self._call("POST", "/flush_cache")
                return
            except urllib.error.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("the server did not flush its cache")

    def get_stats(self) -> dict[str, Any]:
        return json.loads(self._call("GET", "/get_server_info"))["stats"]


def run(
    engine, prompts: list[str], params: list[dict[str, Any]], trace: bool = False
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One timed batch on an Engine or a `Served` server; trace (Engine only): print where the
    scheduler thread's time went by phase, and on CUDA the device time by step kind
    (benchmarks/step_trace.py, as `benchmarks.offline --step-trace`)."""
    engine.flush_cache()
    trace = trace and not isinstance(engine, Served)
    if trace:
        engine._on_scheduler(lambda s: (setattr(s.timer, "trace", []), setattr(s.timer, "laps", [])))
    before = engine.get_stats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    if trace:
        from benchmarks.step_trace import summarize, summarize_laps

        print(summarize_laps(engine._on_scheduler(lambda s: s.timer.laps)))
        if steps := engine._on_scheduler(lambda s: s.timer.trace):  # empty on CPU
            print(summarize(steps))
        engine._on_scheduler(lambda s: (setattr(s.timer, "trace", None), setattr(s.timer, "laps", None)))
    after = engine.get_stats()
    keys = ("steps", "step_s", "generated_tokens", "jump_forward_tokens", "retokenized", "row_steps")
    d = {k: after[k] - before.get(k, 0) for k in keys if k in after}
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    d.update(
        seconds=seconds, output_tokens=tokens, tok_s=tokens / seconds, req_s=len(prompts) / seconds,
        step_ms=1e3 * d["step_s"] / d["steps"],
    )  # fmt: skip
    return outs, d


@contextlib.contextmanager
def runner(args: argparse.Namespace, jump: bool) -> Iterator[Any]:
    """An Engine in this process, or with --launch-server a `sglbus serve` (the detokenizer and the
    gateway in processes of their own, as deployed), with or without jump-forward."""
    if args.launch_server:
        from benchmarks.launch import LaunchedServer

        extra = " ".join(x for x in (
            f"--model-path {args.model_path}" if args.model_path else "",
            f"--load-format {args.load_format}" if args.load_format else "",
            "" if jump else "--disable-jump-forward",
            args.server_args,
        ) if x)  # fmt: skip
        with LaunchedServer(extra) as server:
            yield Served(server.url)
        return
    import sglbus

    opts = {k: v for k, v in {"model_path": args.model_path, "load_format": args.load_format}.items() if v}
    with sglbus.Engine(disable_jump_forward=not jump, **opts) as engine:
        yield engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["json", "regex"], default="json")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--model-path", default=None, help="default: the default model")
    p.add_argument("--load-format", default=None, help="dummy: random weights from a config-only folder")
    p.add_argument("--output-file", default=None, help="append the figures as a JSONL row")
    p.add_argument("--profile", action="store_true", help="sample the threads' Python stacks in each run")
    p.add_argument("--step-trace", action="store_true", help="the scheduler's time by phase in each run")
    p.add_argument(
        "--launch-server",
        action="store_true",
        help="run on `sglbus serve` (launched for each of A and B) instead of an in-process Engine",
    )
    p.add_argument("--server-args", default="", help="with --launch-server: more `sglbus serve` options")
    args = p.parse_args(argv)
    prompts, params, valid = workload(args.workload, args.num_prompts)
    rows = []
    for r in range(args.rounds):
        row: dict[str, Any] = {}
        for name, jump in (("jump_forward", True), ("no_jump_forward", False)):
            with runner(args, jump) as engine:
                engine.generate(prompts[:2], params)  # warm up: the grammar compiles, first-step allocations
                with StackProfile() if args.profile else contextlib.nullcontext() as prof:
                    print(f"-- {name}")
                    outs, row[name] = run(engine, prompts, [params] * len(prompts), args.step_trace)
                if prof is not None:
                    print(f"-- profile of {name}\n{prof.report(top=25)}")
                row[name]["valid"] = sum(valid(o["text"]) for o in outs)
                if not jump:  # C: unconstrained, B's token counts
                    lens = [o["meta_info"]["completion_tokens"] for o in outs]
                    free = [{"temperature": 0, "ignore_eos": True, "max_new_tokens": n} for n in lens]
                    print("-- unconstrained")
                    _, row["unconstrained"] = run(engine, prompts, free, args.step_trace)
        a, b, c = row["jump_forward"], row["no_jump_forward"], row["unconstrained"]
        row["speedup"] = a["req_s"] / b["req_s"]
        row["tok_s_ratio"] = a["tok_s"] / b["tok_s"]
        row["forward_ratio"] = b["steps"] / a["steps"]
        row["mask_share"] = 1 - c["step_ms"] / b["step_ms"]
        rows.append(row)
        print(f"round {r + 1}: " + "  ".join(
            f"{k}: {v['req_s']:.1f} req/s, {v['tok_s']:.0f} tok/s ({v['output_tokens']} tokens), "
            f"{v['steps']} steps, {v['step_ms']:.1f} ms/step"
            + (f", valid {v['valid']}/{len(prompts)}" if "valid" in v else "") for k, v in row.items()
            if isinstance(v, dict)))  # fmt: skip
    keys = ("speedup", "tok_s_ratio", "forward_ratio", "mask_share")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    print(f"{args.workload}, {args.num_prompts} prompts, {args.rounds} round(s), medians: jump-forward "
          f"speedup {med['speedup']:.2f}x in requests/s ({med['tok_s_ratio']:.2f}x in tokens/s), forward "
          f"passes {med['forward_ratio']:.2f}x fewer, mask {100 * med['mask_share']:.1f}% of a constrained "
          "step")  # fmt: skip
    if args.output_file:
        from benchmarks.launch import append_result, machine_info

        append_result(args.output_file, vars(args), machine_info(), {"rounds": rows, "median": med})
    return 0


if __name__ == "__main__":
    sys.exit(main())
