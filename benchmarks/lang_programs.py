"""The paper's LM-program workloads through the frontend against a naive client (issue 12).

Each workload is an `@sgl.function` program with synthetic data made here (seeded), run twice against
the same server, its prefix cache flushed before each run:

(a) the frontend: `run_batch(num_threads=P)` on `sgl.RuntimeEndpoint`: the batch's shared prefix is
    cached first, a fork sends its shared text as a hint and runs its branches concurrently, a select
    sends the prompt once and then every choice in one batched request;
(b) a naive client: the same model calls as plain `/generate` requests written by hand, one at a time,
    one program after the other: no prefix hints, fork branches in sequence, and a select scores each
    choice with a request of its own (`return_logprob` from two tokens before the end of the prompt,
    which it tokenizes locally to know where that is; the same rule as SGLang's frontend).

The server's radix cache serves both: what (b) lacks is the frontend's hints and parallelism, so the
ratio is the frontend's doing, not a cache the baseline has switched off. Greedy decoding, so (a) and
(b) must produce the same select decisions and texts; the agreement is printed per workload.

    python -m benchmarks.lang_programs --launch-server --workload all
    python -m benchmarks.lang_programs --url http://127.0.0.1:30000 --workload mmlu --num-programs 32

    mmlu        5-shot prompt (~1,000 tokens) shared by all, `select` over " A" .. " D"
    hellaswag   8-shot prompt shared by all, a context, `select` over 4 endings
    bsm         branch-solve-merge: an essay judged on 3 dimensions (`fork(3)`), merged, graded (`select`)
    tot         tree of thought: `fork(2)` plans, each `fork(2)` attempts, `select` of the best attempt
    json        a city page to JSON by a `json_schema` gen, after a 2-example instruction shared by all
    multi_turn  4 user turns under a system prompt, each answered by a gen (the history is shared)
    react       ReAct agent: 2-example prompt shared by all, then 3 x (thought gen, `select` over tools,
                argument gen, a canned observation)

With --naive-server-args (and --launch-server) the naive client gets a server of its own, e.g.
`--naive-server-args=--disable-radix-cache` (with `=`: the value starts with a dash) for the paper's
baselines, runtimes without prefix reuse; --naive-programs then keeps its run short (it runs the first
K programs; programs/s does not depend on K for a client that runs them one by one).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import sglbus as sgl
from benchmarks.launch import LaunchedServer, add_target_args, append_result, machine_info, target

WORKLOADS = ("mmlu", "hellaswag", "bsm", "tot", "json", "multi_turn", "react")
# programs per workload when --num-programs is not given: the naive client takes ~30-60 s for each
# on a 2-core CPU with the default model (SmolLM2-135M)
DEFAULT_PROGRAMS = {"mmlu": 32, "hellaswag": 32, "bsm": 8, "tot": 8, "json": 16, "multi_turn": 8, "react": 6}


# -- synthetic data ---------------------------------------------------------------------------------
NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lena"]
OBJECTS = ["cart", "block", "ball", "sled", "crate", "cylinder", "puck", "drone"]
SURFACES = ["a frictionless track", "a rough ramp", "an icy lake", "a level table", "a steel rail"]
QUANTITIES = [("kinetic energy", "J"), ("momentum", "kg m/s"), ("acceleration", "m/s^2"), ("force", "N")]


def mmlu_question(rng: random.Random) -> tuple[str, list[str], int]:
    """A high-school-physics question of ~150 tokens, its four options and the right one's index."""
    obj, surface = rng.choice(OBJECTS), rng.choice(SURFACES)
    m, v, t = rng.randint(2, 40), rng.randint(2, 30), rng.randint(2, 12)
    qty, unit = rng.choice(QUANTITIES)
    stem = (
        f"A {obj} of mass {m} kg rests on {surface}. At time t = 0 a student pushes it with a constant "
        f"horizontal force, and after {t} s it moves at {v} m/s. The student records the position every "
        f"half second with a motion sensor and notes that the {obj} never leaves the surface. Air "
        f"resistance is small enough to be ignored, and the {obj} is treated as a point mass. A second, "
        f"identical {obj} waits at rest {rng.randint(3, 20)} m further along. Which of the following is "
        f"closest to the {qty} of the first {obj} just before the two meet, assuming the push continues "
        f"unchanged until then?"
    )
    base = rng.randint(10, 900)
    options = [f"{base * k} {unit}" for k in rng.sample(range(1, 9), 4)]
    return stem, options, rng.randrange(4)


def mmlu_block(stem: str, options: list[str]) -> str:
    return stem + "\n" + "".join(f"{'ABCD'[i]}. {o}\n" for i, o in enumerate(options)) + "Answer:"


def mmlu_few_shot(rng: random.Random) -> str:
    head = "The following are multiple choice questions (with answers) about high school physics.\n\n"
    shots = []
    for _ in range(5):
        stem, options, answer = mmlu_question(rng)
        shots.append(f"{mmlu_block(stem, options)} {'ABCD'[answer]}\n\n")
    return head + "".join(shots)


ACTIVITIES = [
    ("Making a sandwich", "takes two slices of bread from the bag", "spreads butter evenly on one slice"),
    ("Washing a car", "fills a bucket with warm soapy water", "wets the hood with a garden hose"),
    ("Tying a tie", "drapes the tie around the collar", "crosses the wide end over the narrow end"),
    ("Planting a tree", "digs a hole twice as wide as the roots", "loosens the soil at the bottom"),
    ("Painting a fence", "sands the old boards by hand", "stirs a can of white paint with a stick"),
    ("Changing a tire", "loosens the lug nuts with a wrench", "places the jack under the frame"),
]
ENDINGS = [
    "then places the {a} on top and cuts it neatly in half.",
    "starts singing loudly and throws the {a} into the river.",
    "checks the {a} carefully before moving on to the next step.",
    "leaves the room and the {a} floats slowly up to the ceiling.",
    "wipes the {a} with a cloth and smiles at the camera.",
    "drops the {a}, which bounces twice and rolls under a chair.",
]
THINGS = ["slice", "sponge", "knot", "shovel", "brush", "wheel", "bucket", "wrench"]


def hellaswag_item(rng: random.Random) -> tuple[str, list[str], int]:
    """A context (activity label, two sentences, then a space: SGLang's format), 4 endings, the label."""
    label, first, second = rng.choice(ACTIVITIES)
    who = rng.choice(["A man", "A woman", "A boy", "A girl", "An old man"])
    ctx = f"{label}: {who} {first}. The person {second} and"
    endings = [e.format(a=rng.choice(THINGS)) for e in rng.sample(ENDINGS, 4)]
    return ctx + " ", endings, rng.randrange(4)


def hellaswag_few_shot(rng: random.Random) -> str:
    shots = []
    for _ in range(8):
        ctx, endings, label = hellaswag_item(rng)
        shots.append(ctx + endings[label] + "\n\n")
    return "".join(shots)


TOPICS = ["public libraries", "electric buses", "school gardens", "night trains", "city bicycles"]


def essay(rng: random.Random) -> str:
    topic = rng.choice(TOPICS)
    sentences = [
        f"Many towns are debating whether to spend more money on {topic}.",
        f"Supporters argue that {topic} serve people of every age and income.",
        f"A survey in {rng.choice(NAMES)}'s town found that {rng.randint(20, 80)} percent of residents "
        f"used {topic} at least once a month.",
        "Critics reply that the budget is limited and that roads and schools come first.",
        f"However, the cost of {topic} is small compared with the benefits they bring over decades.",
        f"In conclusion, the town should invest in {topic} now, before prices rise again.",
    ]
    return " ".join(sentences)


DIMENSIONS = ["clarity of the argument", "use of evidence", "structure and flow"]


def word_problem(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(["apples", "stickers", "marbles", "pencils", "cards"])
    a, b, c, d = rng.randint(5, 40), rng.randint(2, 6), rng.randint(3, 12), rng.randint(1, 9)
    return (
        f"{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each pack, then gives {d} "
        f"{item} to a friend. How many {item} does {name} have now?"
    )


CITIES = [("Lyon", "France"), ("Porto", "Portugal"), ("Graz", "Austria"), ("Kyoto", "Japan"),
          ("Tartu", "Estonia"), ("Cusco", "Peru"), ("Bergen", "Norway"), ("Leeds", "England")]  # fmt: skip
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}


def city_page(rng: random.Random) -> tuple[str, dict[str, Any]]:
    city, country = rng.choice(CITIES)
    pop = rng.randint(50, 3000) * 1000
    page = (
        f"{city} is a city in {country}. It lies on a river valley and was founded in the year "
        f"{rng.randint(100, 1500)}. As of the last census, {city} had {pop:,} inhabitants. The city is "
        f"known for its old town, its university and a market held every {rng.choice(['Monday', 'Friday'])}."
    )
    return page, {"name": city, "country": country, "population": pop}


JSON_INSTRUCTION = "Extract the name, the country and the population of the city from the page, as JSON.\n\n"


def json_prefix(rng: random.Random) -> str:
    shots = []
    for _ in range(2):
        page, answer = city_page(rng)
        shots.append(f"Page begin.\n{page}\nPage end.\nJSON: {json.dumps(answer)}\n\n")
    return JSON_INSTRUCTION + "".join(shots)


CHAT_SYSTEM = "You are a patient travel assistant. Answer in one or two short sentences."
CHAT_TURNS = [
    "I am planning a {days}-day trip to {city} in {month} with {who}. We like museums, long walks and "
    "local food, but we do not want to spend too much money. Where should we stay?",
    "Thanks. How should we get from the airport to the centre of {city}, and is a travel pass worth it "
    "for {days} days?",
    "What is one museum in {city} that {who} would enjoy, and how long should we plan for it?",
    "Finally, which local dish should we try in {city} in {month}, and where would we find it?",
]


def chat_turns(rng: random.Random) -> list[str]:
    who, month = rng.choice(["my kids", "friends"]), rng.choice(["April", "June", "October"])
    fill = {"days": rng.randint(2, 9), "city": rng.choice(CITIES)[0], "who": who, "month": month}
    return [t.format(**fill) for t in CHAT_TURNS]


REACT_PREFIX = """Solve a question answering task with interleaving Thought, Action, Observation steps. \
Thought can reason about the current situation, and Action can be three types:
(1) Search[entity], which searches the exact entity on Wikipedia and returns the first paragraph if it exists.
(2) Lookup[keyword], which returns the next sentence containing keyword in the current passage.
(3) Finish[answer], which returns the answer and finishes the task.
Here are some examples.

Question: Which magazine was started first, Arthur's Magazine or First for Women?
Thought 1: I need to search Arthur's Magazine and First for Women, and find which was started first.
Action 1: Search[Arthur's Magazine]
Observation 1: Arthur's Magazine (1844-1846) was an American literary periodical published in Philadelphia.
Thought 2: Arthur's Magazine was started in 1844. I need to search First for Women next.
Action 2: Search[First for Women]
Observation 2: First for Women is a woman's magazine published by Bauer Media Group in the USA. \
The magazine was started in 1989.
Thought 3: First for Women was started in 1989. 1844 (Arthur's Magazine) < 1989 (First for Women), \
so Arthur's Magazine was started first.
Action 3: Finish[Arthur's Magazine]

Question: Were Pavel Urysohn and Leonid Levin known for the same type of work?
Thought 1: I need to search Pavel Urysohn and Leonid Levin, find their types of work, then find if they \
are the same.
Action 1: Search[Pavel Urysohn]
Observation 1: Pavel Samuilovich Urysohn (1898-1924) was a Soviet mathematician who is best known for \
his contributions in dimension theory.
Thought 2: Pavel Urysohn is a mathematician. I need to search Leonid Levin next and find its type of work.
Action 2: Search[Leonid Levin]
Observation 2: Leonid Anatolievich Levin is a Soviet-American mathematician and computer scientist.
Thought 3: Leonid Levin is a mathematician and computer scientist. So Pavel Urysohn and Leonid Levin \
have the same type of work.
Action 3: Finish[yes]

"""
TOOLS = ["Search", "Lookup", "Finish"]
BRIDGES = [("Tower Bridge", 1894), ("Brooklyn Bridge", 1883), ("Golden Gate Bridge", 1937),
           ("Charles Bridge", 1402), ("Ponte Vecchio", 1345), ("Harbour Bridge", 1932)]  # fmt: skip


def react_item(rng: random.Random) -> tuple[str, list[str]]:
    (a, ya), (b, yb) = rng.sample(BRIDGES, 2)
    question = f"Which was opened first, the {a} or the {b}?"
    observations = [
        f"The {a} is a bridge that was opened to traffic in {ya}.",
        f"The {b} is a bridge that was opened to traffic in {yb}.",
        f"There is no further information about the {a} or the {b}.",
    ]
    return question, observations


# -- the programs (a) and their naive twins (b) ------------------------------------------------------
@sgl.function
def mmlu(s, few_shot, question):
    s += few_shot  # bound by run_batch's caller: a separate append, so the prefix trace reaches it
    s += question
    s += sgl.select("answer", choices=[" A", " B", " C", " D"])
    return {"answer": s["answer"]}


@sgl.function
def hellaswag(s, few_shot, context, endings):
    s += few_shot
    s += context
    s += sgl.select("answer", choices=endings)
    return {"answer": s["answer"]}


@sgl.function
def bsm(s, essay):
    s += sgl.system("You are an expert writing teacher who judges short essays fairly and briefly.")
    s += sgl.user("Here is an essay.\n\n" + essay)
    forks = s.fork(len(DIMENSIONS))
    for f, dim in zip(forks, DIMENSIONS, strict=True):
        f += sgl.user(f"Judge the essay only on its {dim}, in one sentence.")
        f += sgl.assistant(sgl.gen("judgment", max_tokens=16))
    judgments = [f["judgment"] for f in forks]
    s += sgl.user(
        "Three judgments:\n" + "".join(f"- {d}: {j}\n" for d, j in zip(DIMENSIONS, judgments, strict=True))
        + "Summarize them in one sentence."
    )  # fmt: skip
    s += sgl.assistant(sgl.gen("summary", max_tokens=16))
    s += sgl.user("Give the essay a grade: A, B, C or D.")
    s += sgl.assistant("Grade: " + sgl.select("grade", choices=["A", "B", "C", "D"]))
    return {"judgments": judgments, "summary": s["summary"], "grade": s["grade"]}


@sgl.function
def tot(s, question):
    s += sgl.user("Solve this problem. First write a short plan.\n" + question)
    plans = s.fork(2)
    plans += lambda i: sgl.assistant(f"Plan {i + 1}: " + sgl.gen("plan", max_tokens=12, stop="\n"))
    attempts = []
    for p in plans:
        p += sgl.user("Carry out the plan and give the number.")
        tries = p.fork(2)
        tries += lambda j: sgl.assistant(f"Attempt {j + 1}: " + sgl.gen("solution", max_tokens=12, stop="\n"))
        attempts += [t["solution"] for t in tries]
    s += sgl.user(
        "Attempts:\n" + "".join(f"{k + 1}. {a}\n" for k, a in enumerate(attempts)) + "Which is best?"
    )
    s += sgl.assistant("Best: " + sgl.select("best", choices=["1", "2", "3", "4"]))
    return {"plans": [p["plan"] for p in plans], "solutions": attempts, "best": s["best"]}


@sgl.function
def json_decode(s, prefix, page):
    s += prefix
    s += "Page begin.\n" + page + "\nPage end.\nJSON: "
    s += sgl.gen("json", max_tokens=40, json_schema=JSON_SCHEMA)
    return {"json": s["json"]}


@sgl.function
def multi_turn(s, turns):
    s += sgl.system(CHAT_SYSTEM)
    answers = []
    for i, turn in enumerate(turns):
        s += sgl.user(turn)
        s += sgl.assistant(sgl.gen(f"answer{i}", max_tokens=12))
        answers.append(s[f"answer{i}"])
    return {"answers": answers}


@sgl.function
def react(s, question, observations):
    s += REACT_PREFIX
    s += "Question: " + question + "\n"
    steps = []
    for i, obs in enumerate(observations, 1):
        s += f"Thought {i}:" + sgl.gen(f"thought{i}", max_tokens=12, stop=["\n", "Action"])
        s += f"\nAction {i}: " + sgl.select(f"action{i}", choices=TOOLS)
        s += "[" + sgl.gen(f"arg{i}", max_tokens=6, stop=["]", "\n"]) + "]\n"
        steps.append([s[f"thought{i}"], s[f"action{i}"], s[f"arg{i}"]])
        if s[f"action{i}"] == "Finish":
            break
        s += f"Observation {i}: {obs}\n"
    return {"steps": steps}


class NaiveClient:
    """Plain `/generate` over HTTP, one request at a time, no hints; roles written by hand with the
    model's chat template; a select is one `return_logprob` request per choice."""

    def __init__(self, endpoint: sgl.RuntimeEndpoint, template: sgl.ChatTemplate, tokenizer: Any) -> None:
        self.endpoint, self.template, self.tokenizer = endpoint, template, tokenizer  # the endpoint: its URL
        self.requests = 0

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        self.requests += 1
        req = urllib.request.Request(self.endpoint.base_url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")  # fmt: skip
        with urllib.request.urlopen(req, timeout=600) as resp:
            return json.loads(resp.read())

    def gen(self, prompt: str, max_tokens: int, stop: list[str] | None = None, **constraint: Any) -> str:
        # a chat client stops at the end-of-turn string, as the frontend does for every gen
        stops = [*(stop or []), *(s for s in self.template.stop_str if s not in (stop or []))]
        sampling = {"max_new_tokens": max_tokens, "temperature": 0, "stop": stops, **constraint}
        return self.generate({"text": prompt, "sampling_params": sampling})["text"]

    def select(self, prompt: str, choices: list[str]) -> str:
        """The choice with the highest mean logprob per token (the first of equals). Logprobs from two
        tokens before the prompt's end, in case the choice merges with its last token; that first entry
        is dropped unless it did merge."""
        start = max(len(self.tokenizer.encode(prompt)) - 2, 0)
        scores = []
        for choice in choices:
            out = self.generate({"text": prompt + choice,
                                 "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                                 "return_logprob": True, "return_text_in_logprobs": True,
                                 "logprob_start_len": start})  # fmt: skip
            row = out["meta_info"]["input_token_logprobs"]
            if len(row) > 1 and row[0][2] is not None and prompt.endswith(row[0][2]):
                row = row[1:]
            values = [t[0] for t in row if t[0] is not None]
            scores.append(sum(values) / len(values))
        return choices[max(range(len(choices)), key=scores.__getitem__)]

    def role(self, role: str, content: str) -> str:
        prefix, suffix = self.template.prefix_and_suffix(role)
        return prefix + content + suffix

    def begin(self, role: str) -> str:
        return self.template.prefix_and_suffix(role)[0]

    def end(self, role: str) -> str:
        return self.template.prefix_and_suffix(role)[1]


def naive_mmlu(c: NaiveClient, few_shot: str, question: str) -> dict[str, Any]:
    return {"answer": c.select(few_shot + question, [" A", " B", " C", " D"])}


def naive_hellaswag(c: NaiveClient, few_shot: str, context: str, endings: list[str]) -> dict[str, Any]:
    return {"answer": c.select(few_shot + context, endings)}


def naive_bsm(c: NaiveClient, essay: str) -> dict[str, Any]:
    text = c.role("system", "You are an expert writing teacher who judges short essays fairly and briefly.")
    text += c.role("user", "Here is an essay.\n\n" + essay)
    judgments = []
    for dim in DIMENSIONS:  # the branches, one after the other
        branch = (
            text
            + c.role("user", f"Judge the essay only on its {dim}, in one sentence.")
            + c.begin("assistant")
        )
        judgments.append(c.gen(branch, 16))
    text += c.role(
        "user",
        "Three judgments:\n" + "".join(f"- {d}: {j}\n" for d, j in zip(DIMENSIONS, judgments, strict=True))
        + "Summarize them in one sentence.",
    )  # fmt: skip
    text += c.begin("assistant")
    summary = c.gen(text, 16)
    text += summary + c.end("assistant") + c.role("user", "Give the essay a grade: A, B, C or D.")
    text += c.begin("assistant") + "Grade: "
    return {"judgments": judgments, "summary": summary, "grade": c.select(text, ["A", "B", "C", "D"])}


def naive_tot(c: NaiveClient, question: str) -> dict[str, Any]:
    # the frontend puts the default system prompt before a conversation that starts without one
    text = c.role("system", c.template.default_system_prompt) if c.template.default_system_prompt else ""
    text += c.role("user", "Solve this problem. First write a short plan.\n" + question)
    plans, attempts = [], []
    for i in range(2):
        head = text + c.begin("assistant") + f"Plan {i + 1}: "
        plans.append(c.gen(head, 12, ["\n"]))
    for i, plan in enumerate(plans):
        branch = text + c.begin("assistant") + f"Plan {i + 1}: " + plan + c.end("assistant")
        branch += c.role("user", "Carry out the plan and give the number.")
        for j in range(2):
            attempts.append(c.gen(branch + c.begin("assistant") + f"Attempt {j + 1}: ", 12, ["\n"]))
    text += c.role(
        "user", "Attempts:\n" + "".join(f"{k + 1}. {a}\n" for k, a in enumerate(attempts)) + "Which is best?"
    )
    text += c.begin("assistant") + "Best: "
    return {"plans": plans, "solutions": attempts, "best": c.select(text, ["1", "2", "3", "4"])}


def naive_json(c: NaiveClient, prefix: str, page: str) -> dict[str, Any]:
    prompt = prefix + "Page begin.\n" + page + "\nPage end.\nJSON: "
    return {"json": c.gen(prompt, 40, json_schema=json.dumps(JSON_SCHEMA))}


def naive_multi_turn(c: NaiveClient, turns: list[str]) -> dict[str, Any]:
    text, answers = c.role("system", CHAT_SYSTEM), []
    for turn in turns:
        text += c.role("user", turn) + c.begin("assistant")
        answers.append(c.gen(text, 12))
        text += answers[-1] + c.end("assistant")
    return {"answers": answers}


def naive_react(c: NaiveClient, question: str, observations: list[str]) -> dict[str, Any]:
    text, steps = REACT_PREFIX + "Question: " + question + "\n", []
    for i, obs in enumerate(observations, 1):
        text += f"Thought {i}:"
        thought = c.gen(text, 12, ["\n", "Action"])
        text += thought + f"\nAction {i}: "
        action = c.select(text, TOOLS)
        text += action + "["
        arg = c.gen(text, 6, ["]", "\n"])
        text += arg + "]\n"
        steps.append([thought, action, arg])
        if action == "Finish":
            break
        text += f"Observation {i}: {obs}\n"
    return {"steps": steps}


Batch = tuple[dict[str, Any], list[dict[str, Any]]]  # (arguments every program shares, one set each)


@dataclasses.dataclass
class Workload:
    program: sgl.Function
    naive: Callable[..., dict[str, Any]]
    arguments: Callable[[random.Random, int], Batch]


def _mmlu_args(rng: random.Random, n: int) -> Batch:
    return {"few_shot": mmlu_few_shot(rng)}, [
        {"question": mmlu_block(*mmlu_question(rng)[:2])} for _ in range(n)
    ]


def _hellaswag_args(rng: random.Random, n: int) -> Batch:
    few_shot = hellaswag_few_shot(rng)
    items = [hellaswag_item(rng) for _ in range(n)]
    return {"few_shot": few_shot}, [{"context": ctx, "endings": endings} for ctx, endings, _ in items]


def _json_args(rng: random.Random, n: int) -> Batch:
    return {"prefix": json_prefix(rng)}, [{"page": city_page(rng)[0]} for _ in range(n)]


def _react_args(rng: random.Random, n: int) -> Batch:
    return {}, [dict(zip(("question", "observations"), react_item(rng), strict=True)) for _ in range(n)]


WORKLOAD = {
    "mmlu": Workload(mmlu, naive_mmlu, _mmlu_args),
    "hellaswag": Workload(hellaswag, naive_hellaswag, _hellaswag_args),
    "bsm": Workload(bsm, naive_bsm, lambda rng, n: ({}, [{"essay": essay(rng)} for _ in range(n)])),
    "tot": Workload(tot, naive_tot, lambda rng, n: ({}, [{"question": word_problem(rng)} for _ in range(n)])),
    "json": Workload(json_decode, naive_json, _json_args),
    "multi_turn": Workload(multi_turn, naive_multi_turn,
                           lambda rng, n: ({}, [{"turns": chat_turns(rng)} for _ in range(n)])),
    "react": Workload(react, naive_react, _react_args),
}  # fmt: skip


# -- measuring ------------------------------------------------------------------------------------
class CountingEndpoint(sgl.RuntimeEndpoint):
    """RuntimeEndpoint that counts its /generate calls and the prompts in them."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls = self.prompts = 0
        self._lock = threading.Lock()

    def _request(self, body: dict[str, Any]) -> Any:
        batch = body.get("text", body.get("input_ids"))
        with self._lock:
            self.calls += 1
            self.prompts += len(batch) if isinstance(batch, list) and not isinstance(batch[0], int) else 1
        return super()._request(body)


_STATS = ("prompt_tokens", "cached_tokens", "generated_tokens", "steps", "step_s")


def server_stats(endpoint: sgl.RuntimeEndpoint) -> dict[str, float]:
    stats = endpoint.get_server_info()["stats"]
    return {k: stats[k] for k in _STATS}


def flush(endpoint: sgl.RuntimeEndpoint) -> None:
    for _ in range(50):  # refused while requests run (the previous run's last ones may still end)
        try:
            endpoint.flush_cache()
            return
        except RuntimeError:
            time.sleep(0.2)
    raise RuntimeError("the server did not flush its cache")


def measure(endpoint: sgl.RuntimeEndpoint, run: Callable[[], list[dict[str, Any]]]) -> dict[str, Any]:
    flush(endpoint)
    before = server_stats(endpoint)
    t0 = time.perf_counter()
    outputs = run()
    wall = time.perf_counter() - t0
    after = server_stats(endpoint)
    delta = {k: after[k] - before[k] for k in _STATS}
    return {"wall_s": wall, "outputs": outputs, **delta,
            "hit_rate": delta["cached_tokens"] / max(1, delta["prompt_tokens"]),
            "busy": delta["step_s"] / wall}  # fmt: skip


def leaves(x: Any, path: str = "") -> list[tuple[str, Any]]:
    """The scalar results of a program, by path (`steps.1.2`)."""
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in leaves(v, f"{path}.{k}" if path else k)]
    if isinstance(x, list):
        return [p for i, v in enumerate(x) for p in leaves(v, f"{path}.{i}")]
    return [(path, x)]


def agreement(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[int, int, list[str]]:
    """(fields equal, fields, a few differences) over all programs; a field only one side has counts as
    a difference (a ReAct agent that finished early on one side only)."""
    same = total = 0
    diffs: list[str] = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        fx, fy = dict(leaves(x)), dict(leaves(y))
        for key in sorted(fx.keys() | fy.keys()):
            total += 1
            if fx.get(key) == fy.get(key):
                same += 1
            elif len(diffs) < 5:
                diffs.append(f"program {i} {key}: frontend {fx.get(key)!r} vs naive {fy.get(key)!r}")
    return same, total, diffs


def run_workload(name: str, endpoint: CountingEndpoint, naive: NaiveClient, n: int, parallel: int,
                 seed: int, naive_programs: int | None = None) -> dict[str, Any]:  # fmt: skip
    """(a) then (b), each from an empty cache; (b) runs the first naive_programs programs (all: None)."""
    w = WORKLOAD[name]
    shared, args = w.arguments(random.Random(f"{seed}-{name}"), n)
    program = w.program.bind(**shared)  # bound, so run_batch's prefix trace sees the few-shot text
    prefix_tokens = len(naive.tokenizer.encode(program.shared_prefix(endpoint)))

    def frontend() -> list[dict[str, Any]]:
        states = program.run_batch(args, temperature=0, num_threads=parallel, backend=endpoint)
        for st in states:
            if st.error() is not None:
                raise RuntimeError(f"{name}: a program failed: {st.error()}") from st.error()
        return [st.ret_value for st in states]

    calls0, prompts0 = endpoint.calls, endpoint.prompts
    a = measure(endpoint, frontend)
    a["requests"], a["prompts"] = endpoint.calls - calls0, endpoint.prompts - prompts0
    k = min(n, naive_programs or n)
    requests0 = naive.requests
    b = measure(naive.endpoint, lambda: [w.naive(naive, **shared, **kw) for kw in args[:k]])
    b["requests"] = b["prompts"] = naive.requests - requests0
    same, total, diffs = agreement(a["outputs"][:k], b["outputs"])
    a["programs_per_s"], b["programs_per_s"] = n / a["wall_s"], k / b["wall_s"]
    row = {"workload": name, "programs": n, "naive_programs": k, "parallel": parallel,
           "prefix_tokens": prefix_tokens, "agree": same, "fields": total, "differences": diffs,
           "ratio": a["programs_per_s"] / b["programs_per_s"]}  # fmt: skip
    for side, r in (("frontend", a), ("naive", b)):
        row[side] = {key: v for key, v in r.items() if key != "outputs"}
    if name == "json":
        row["json_valid"] = [sum(_valid_json(o["json"]) for o in r["outputs"]) for r in (a, b)]
    return row


def _valid_json(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def warm_up(naive: NaiveClient) -> None:
    """The first requests of a fresh server (and the JSON schema's grammar) are compiled once; neither
    side should pay for it."""
    naive.gen("Warm-up: count to three.", 4)
    naive.select("The sky is", [" blue", " green"])
    naive.gen("A city as JSON: ", 8, json_schema=json.dumps(JSON_SCHEMA))


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| workload | programs | frontend p/s | naive p/s | ratio | hit rate frontend / naive | "
          "prompt tokens frontend / naive | cached tokens frontend / naive | requests frontend / naive | "
          "agreement |")  # fmt: skip
    print("|" + " --- |" * 10)
    for r in rows:
        a, b = r["frontend"], r["naive"]
        programs = f"{r['programs']}" + (
            f" / {r['naive_programs']}" if r["naive_programs"] != r["programs"] else ""
        )
        print(f"| {r['workload']} | {programs} | {a['programs_per_s']:.3f} | {b['programs_per_s']:.3f} | "
              f"**{r['ratio']:.2f}x** | {a['hit_rate']:.1%} / {b['hit_rate']:.1%} | "
              f"{a['prompt_tokens']:,} / {b['prompt_tokens']:,} | "
              f"{a['cached_tokens']:,} / {b['cached_tokens']:,} | "
              f"{a['requests']} ({a['prompts']} prompts) / {b['requests']} | "
              f"{r['agree']}/{r['fields']} ({r['agree'] / max(1, r['fields']):.0%}) |")  # fmt: skip
    print("\nserver busy (steps' time / wall), generated tokens, wall seconds:")
    for r in rows:
        a, b = r["frontend"], r["naive"]
        extra = f", valid JSON {r['json_valid'][0]} / {r['json_valid'][1]}" if "json_valid" in r else ""
        print(f"  {r['workload']} (shared prefix {r['prefix_tokens']} tokens): "
              f"frontend {a['busy']:.0%} busy, {a['generated_tokens']} gen, {a['steps']} steps, "
              f"{a['wall_s']:.1f} s; "
              f"naive {b['busy']:.0%} busy, {b['generated_tokens']} gen, {b['steps']} steps, "
              f"{b['wall_s']:.1f} s{extra}")  # fmt: skip
        for d in r["differences"]:
            print(f"    differs: {d}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_target_args(p)
    p.add_argument("--url", dest="base_url", help="the server, e.g. http://127.0.0.1:30000 (as --base-url)")
    p.add_argument("--workload", nargs="+", choices=(*WORKLOADS, "all"), default=["all"], help="one or more")
    p.add_argument("--num-programs", type=int, default=None, help=f"default per workload: {DEFAULT_PROGRAMS}")
    p.add_argument("--parallel", type=int, default=16, help="run_batch's num_threads for the frontend")
    p.add_argument(
        "--naive-server-args",
        default=None,
        help="with --launch-server: a second server for the naive client, e.g. "
        "--naive-server-args=--disable-radix-cache (with '=': the value starts with a dash)",
    )
    p.add_argument(
        "--naive-programs", type=int, default=None, help="the naive client runs the first K programs"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append one JSONL row per workload")
    args = p.parse_args(argv)
    if args.naive_server_args is not None and not args.launch_server:
        p.error("--naive-server-args needs --launch-server")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = WORKLOADS if "all" in args.workload else tuple(dict.fromkeys(args.workload))
    from shared.tokenizer import load_tokenizer

    machine = machine_info()
    rows = []
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(target(args)).base
        naive_base = base
        if args.naive_server_args is not None:
            naive_base = stack.enter_context(LaunchedServer(args.naive_server_args, args.host)).url
        endpoint = CountingEndpoint(base)
        naive = NaiveClient(sgl.RuntimeEndpoint(naive_base), endpoint.get_chat_template(),
                            load_tokenizer(endpoint.get_model_info()["tokenizer_path"]))  # fmt: skip
        warm_up(naive)
        if naive_base != base:
            warm_up(NaiveClient(endpoint, naive.template, naive.tokenizer))
        for name in names:
            n = args.num_programs or DEFAULT_PROGRAMS[name]
            print(f"{name}: {n} programs, frontend (parallel {args.parallel}) then naive ...", flush=True)
            row = run_workload(name, endpoint, naive, n, args.parallel, args.seed, args.naive_programs)
            a, b = row["frontend"], row["naive"]
            print(f"  frontend {a['wall_s']:.1f} s, naive {b['wall_s']:.1f} s, ratio {row['ratio']:.2f}x, "
                  f"agreement {row['agree']}/{row['fields']}", flush=True)  # fmt: skip
            rows.append(row)
            if args.output_file:
                append_result(args.output_file, vars(args), machine, row)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
