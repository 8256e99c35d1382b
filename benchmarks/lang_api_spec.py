"""API speculative execution (the SGLang paper, §5): calls and tokens of the few-shot field extraction
against our OpenAI endpoints, with and without `num_api_spec_tokens`.

The program: a system message, two few-shot examples (a biography, then `Name: ...\\nBirthday: ...\\n
Job: ...`), then a new biography and one assistant turn with three gens in it. Configurations, each
over the same biographies at temperature 0:

    completion             /v1/completions, one call per gen (the prompt sent again each time)
    completion + spec      /v1/completions, num_api_spec_tokens: one call, later gens matched
    chat + spec            /v1/chat/completions, num_api_spec_tokens: one call per turn
    chat (no spec)         refused: a chat API cannot continue a partial reply, so gens 2 and 3 of the
                           turn have no call that could answer them

Reported per configuration: calls, prompt tokens and completion tokens as the API counted them, wall
time, and how many biographies gave the same three fields as the first configuration.

    python -m benchmarks.lang_api_spec --launch-server
    python -m benchmarks.lang_api_spec --base-url http://127.0.0.1:30000 --num-api-spec-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import sglbus as sgl
from benchmarks.launch import add_target_args, append_result, machine_info, target

SYSTEM = "Extract the name, birthday and job from the biography."
EXAMPLES = [
    ("Ada Lovelace was born on December 10, 1815 in London. She was a mathematician.",
     "Name: Ada Lovelace\nBirthday: December 10, 1815\nJob: mathematician"),
    ("Born on March 14, 1879 in Ulm, Albert Einstein worked as a physicist.",
     "Name: Albert Einstein\nBirthday: March 14, 1879\nJob: physicist"),
]  # fmt: skip
BIOS = [
    "Marie Curie was born on November 7, 1867 in Warsaw. She was a chemist.",
    "Alan Turing, born on June 23, 1912 in London, was a computer scientist.",
    "Frida Kahlo was born on July 6, 1907 in Coyoacan. She was a painter.",
    "Born on April 15, 1452 in Vinci, Leonardo da Vinci was an artist and engineer.",
]
FIELDS = ("name", "birthday", "job")


def extraction(s: Any, bio: str) -> None:
    s += sgl.system(SYSTEM)
    for example, answer in EXAMPLES:
        s += sgl.user(example)
        s += sgl.assistant(answer)
    s += sgl.user(bio)
    s += sgl.assistant("Name:" + sgl.gen("name", stop="\n") + "\nBirthday:" + sgl.gen("birthday", stop="\n")
                       + "\nJob:" + sgl.gen("job", stop="\n"))  # fmt: skip


def measure(
    program: sgl.Function, backend: sgl.OpenAI, bios: list[str], max_new_tokens: int
) -> dict[str, Any]:
    backend.reset_usage()
    start = time.perf_counter()
    fields = []
    for bio in bios:
        state = program.run(bio=bio, temperature=0, max_new_tokens=max_new_tokens, backend=backend)
        if state.error() is not None:
            raise RuntimeError(f"the program failed on {bio!r}: {state.error()}")
        fields.append([state[f] for f in FIELDS])
    usage = backend.reset_usage()
    return {"calls": usage.calls, "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens, "wall_s": round(time.perf_counter() - start, 2),
            "fields": fields}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_args(p)
    p.add_argument("--num-api-spec-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=16, help="every gen's max_tokens")
    p.add_argument("--output-file", default=None, help="append the figures as a JSONL row")
    args = p.parse_args(argv)
    plain = sgl.function(extraction)
    spec = sgl.function(num_api_spec_tokens=args.num_api_spec_tokens)(extraction)
    with target(args) as t:
        import httpx

        model = httpx.get(t.base + "/v1/models", timeout=30).json()["data"][0]["id"]

        def backend(chat: bool) -> sgl.OpenAI:
            # chatml: the model's (SmolLM2's) own template once a system message is given
            return sgl.OpenAI(model, base_url=t.base + "/v1", is_chat_model=chat, chat_template="chatml")

        completion, chat = backend(False), backend(True)
        refused = plain.run(bio=BIOS[0], temperature=0, backend=chat).error()
        rows = {
            "completion": measure(plain, completion, BIOS, args.max_new_tokens),
            "completion + spec": measure(spec, completion, BIOS, args.max_new_tokens),
            "chat + spec": measure(spec, chat, BIOS, args.max_new_tokens),
        }
    reference = rows["completion"]["fields"]
    print(
        f"model {model}, {len(BIOS)} biographies, 3 gens each, num_api_spec_tokens {args.num_api_spec_tokens}"
    )
    header = ("configuration", "calls", "prompt tok", "completion tok", "wall s", "same")
    print("{:<20} {:>6} {:>11} {:>15} {:>7} {:>5}".format(*header))
    for name, r in rows.items():
        same = sum(a == b for a, b in zip(r["fields"], reference, strict=True))
        r["same_fields"] = same
        print(f"{name:<20} {r['calls']:>6} {r['prompt_tokens']:>11} {r['completion_tokens']:>15} "
              f"{r['wall_s']:>7} {same:>3}/{len(BIOS)}")  # fmt: skip
    print(f"{'chat (no spec)':<20} refused: {refused}")
    for bio, fields in zip(BIOS, rows["chat + spec"]["fields"], strict=True):
        print(f"  {bio[:40]!r}... -> {[f.strip() for f in fields]}")
    if args.output_file:
        append_result(args.output_file, vars(args), machine_info(), {"model": model, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
