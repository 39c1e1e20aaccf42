"""JSON whitespace under a schema (issue #17): which grammar serves a small model better, fixed
separators with no optional whitespace (`--json-whitespace compact`) or whitespace allowed between
any two tokens (`any`, xgrammar's and vLLM's default)?

20 hand-made extraction prompts, each with a JSON schema and the values a right answer carries. The
default model answers each greedily under each grammar (one engine per mode, same prompts); an output
counts as *valid* when it parses and follows the schema, and as *right* when it is valid and every
expected field has the expected value (strings compared case-insensitively, trimmed). Prints a
Markdown table and, with `--verbose`, every output.

    HF_HUB_OFFLINE=1 python benchmarks/json_whitespace.py
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jsonschema  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.engine.structured import StructuredOutputParams  # noqa: E402


def _obj(**props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


STR, INT, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
# (text, schema, expected values)
CASES: list[tuple[str, dict, dict]] = [
    ("Alice is 30 years old.", _obj(name=STR, age=INT), {"name": "Alice", "age": 30}),
    ("Bob lives in Paris.", _obj(name=STR, city=STR), {"name": "Bob", "city": "Paris"}),
    ("The book 'Dune' was written by Frank Herbert.", _obj(title=STR, author=STR),
     {"title": "Dune", "author": "Frank Herbert"}),
    ("My name is Carol and my email is carol@example.com.", _obj(name=STR, email=STR),
     {"name": "Carol", "email": "carol@example.com"}),
    ("The meeting is on Monday at 10.", _obj(day=STR, hour=INT), {"day": "Monday", "hour": 10}),
    ("Tom has 3 cats.", _obj(name=STR, cats=INT), {"name": "Tom", "cats": 3}),
    ("The capital of Italy is Rome.", _obj(country=STR, capital=STR), {"country": "Italy", "capital": "Rome"}),
    ("Dave is 45 and works as a doctor.", _obj(name=STR, age=INT, job=STR), {"name": "Dave", "age": 45, "job": "doctor"}),
    ("The red car costs 5000 dollars.", _obj(color=STR, price=INT), {"color": "red", "price": 5000}),
    ("Eve is a student. She is 20.", _obj(name=STR, age=INT), {"name": "Eve", "age": 20}),
    ("The store is open: yes.", _obj(open=BOOL), {"open": True}),
    ("Frank was born in 1990 in London.", _obj(name=STR, year=INT, city=STR),
     {"name": "Frank", "year": 1990, "city": "London"}),
    ("The temperature in Berlin is 18 degrees.", _obj(city=STR, temperature=INT), {"city": "Berlin", "temperature": 18}),
    ("Grace bought 2 apples.", _obj(name=STR, fruit=STR, count=INT), {"name": "Grace", "fruit": "apples", "count": 2}),
    ("The movie Titanic came out in 1997.", _obj(title=STR, year=INT), {"title": "Titanic", "year": 1997}),
    ("Henry's phone number is 555-1234.", _obj(name=STR, phone=STR), {"name": "Henry", "phone": "555-1234"}),
    ("Ivy speaks French.", _obj(name=STR, language=STR), {"name": "Ivy", "language": "French"}),
    ("The train to Madrid leaves at 9.", _obj(destination=STR, hour=INT), {"destination": "Madrid", "hour": 9}),
    ("Jack is 12 years old and likes football.", _obj(name=STR, age=INT, hobby=STR),
     {"name": "Jack", "age": 12, "hobby": "football"}),
    ("Kate's dog is called Max.", _obj(owner=STR, dog=STR), {"owner": "Kate", "dog": "Max"}),
]


def messages(text: str, schema: dict) -> list[dict]:
    keys = ", ".join(schema["properties"])
    return [{"role": "user", "content": f"Extract {keys} from this text as JSON.\nText: {text}"}]


def right(value: object, expected: dict) -> bool:
    if not isinstance(value, dict):
        return False
    for key, want in expected.items():
        got = value.get(key)
        if isinstance(want, str):
            if not isinstance(got, str) or got.strip().lower() != want.lower():
                return False
        elif got != want or type(got) is not type(want):
            return False
    return True


def run(mode: str, max_tokens: int, verbose: bool) -> dict:
    llm = LLM(json_whitespace=mode, dtype="float32", kv_cache_memory="256MiB", max_model_len=2048)
    try:
        params = [SamplingParams(temperature=0, max_tokens=max_tokens,
                                 structured_output=StructuredOutputParams(json_schema=schema))
                  for _, schema, _ in CASES]
        started = time.perf_counter()
        outs = [llm.chat(messages(text, schema), p)[0] for (text, schema, _), p in zip(CASES, params, strict=True)]
        seconds = time.perf_counter() - started
    finally:
        llm.close()
    valid = correct = tokens = 0
    for (text, schema, expected), out in zip(CASES, outs, strict=True):
        c = out.outputs[0]
        tokens += len(c.token_ids)
        try:
            value = json.loads(c.text)
            jsonschema.validate(value, schema)
            ok = True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            value, ok = None, False
        valid += ok
        correct += ok and right(value, expected)
        if verbose:
            print(f"[{mode}] {'ok ' if ok and right(value, expected) else 'BAD'} {text!r} -> {c.text!r}", flush=True)
    return {"mode": mode, "valid": valid, "right": correct, "tokens": tokens, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--modes", default="compact,any", help="comma-separated --json-whitespace values to run")
    args = ap.parse_args()
    rows = [run(mode, args.max_tokens, args.verbose) for mode in args.modes.split(",")]
    n = len(CASES)
    print("| --json-whitespace | schema-valid | valid and right values | output tokens | seconds |\n"
          "|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['valid']}/{n} | {r['right']}/{n} | {r['tokens']} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
