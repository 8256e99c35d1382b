"""llguidance against xgrammar on the default model's tokenizer: compile time, the per-token cost of
filling the next-token bitmask and advancing the matcher along a valid output, and the cost of
asking for the forced continuation (jump-forward). The measurement behind the choice of backend in
services/scheduler/constrained/ (xgrammar is not a dependency: install it to run this).

    python -m benchmarks.grammar_backends
"""

from __future__ import annotations

import json
import os
import sys
import time

from benchmarks.constrained import REGEX, SCHEMA

JSON_OUT = ('{"name":"Chiara Novak","birth_year":1987,"birth_city":"Brno","occupation":"geologist",'
            '"nationality":"Czech","is_alive":true}')  # fmt: skip
REGEX_OUT = "Name: Chiara Novak, born 1987 in Brno, works as a geologist."


def _time(fn, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def llguidance_row(folder: str, vocab: int, eos: int, kind: str, text: str, output: list[int]) -> dict:
    import llguidance
    import torch

    from shared.grammar_text import grammar_text

    tok = llguidance.LLTokenizer(os.path.join(folder, "tokenizer.json"), n_vocab=vocab, eos_token=[eos])
    grammar = grammar_text(kind, text)
    compile_s = _time(lambda: llguidance.LLMatcher(tok, grammar, log_level=0), 3)
    pristine = llguidance.LLMatcher(tok, grammar, log_level=0)
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def walk(ff: bool) -> None:
        m = pristine.deep_copy()
        for t in output:
            m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            if ff:
                m.compute_ff_tokens()
            assert m.consume_token(t), m.get_error()

    return {"compile_ms": 1e3 * compile_s, "mask_us": 1e6 * _time(lambda: walk(False)) / len(output),
            "mask_and_ff_us": 1e6 * _time(lambda: walk(True)) / len(output)}  # fmt: skip


def xgrammar_row(folder: str, vocab: int, kind: str, text: str, output: list[int]) -> dict:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(folder), vocab_size=vocab)

    def build():
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        if kind == "json_schema":
            return compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
        return compiler.compile_regex(text)

    compile_s = _time(build, 3)
    compiled = build()
    mask = xgr.allocate_token_bitmask(1, vocab)

    def walk(ff: bool) -> None:
        m = xgr.GrammarMatcher(compiled)
        for t in output:
            m.fill_next_token_bitmask(mask)
            if ff:
                m.find_jump_forward_string()
            assert m.accept_token(t)

    return {"compile_ms": 1e3 * compile_s, "mask_us": 1e6 * _time(lambda: walk(False)) / len(output),
            "mask_and_ff_us": 1e6 * _time(lambda: walk(True)) / len(output)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from shared.model_files import resolve_model_folder

    folder = resolve_model_folder(None)
    hf = AutoTokenizer.from_pretrained(folder)
    vocab, eos = len(hf), hf.eos_token_id
    cases = [("json_schema", json.dumps(SCHEMA), JSON_OUT), ("regex", REGEX, REGEX_OUT)]
    print(
        f"{'grammar':<12} {'backend':<11} {'compile ms':>10} {'mask us/token':>14} {'mask+ff us/token':>17}"
    )
    for kind, text, out in cases:
        ids = hf.encode(out, add_special_tokens=False) + [eos]
        rows = {"llguidance": llguidance_row(folder, vocab, eos, kind, text, ids)}
        try:
            rows["xgrammar"] = xgrammar_row(folder, vocab, kind, text, ids)
        except ImportError:
            print("(xgrammar is not installed: its rows are missing)", file=sys.stderr)
        for name, r in rows.items():
            cells = f"{r['compile_ms']:>10.1f} {r['mask_us']:>14.1f} {r['mask_and_ff_us']:>17.1f}"
            print(f"{kind:<12} {name:<11} {cells}")
    print("(per token: the best of 5 walks along the output, EOS included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
