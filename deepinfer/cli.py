"""`deepinfer` command line: serve | generate | chat. Flags are generated from the config dataclasses."""

from __future__ import annotations

import argparse
import logging
import sys

from deepinfer.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    add_config_arguments,
    config_from_args,
    engine_config_from_args,
)

ENGINE_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig)


def _sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="Maximum tokens to generate (default: 256).")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0).")
    g.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (default: 1.0).")
    g.add_argument("--top-k", type=int, default=0, help="Sample from the k most likely tokens; 0 = off.")


def _sampling_params(args: argparse.Namespace):
    from deepinfer import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k)


def _load_engine(args: argparse.Namespace):
    from deepinfer.engine.engine import LLMEngine

    print("deepinfer: loading model ...", file=sys.stderr, flush=True)
    return LLMEngine(engine_config_from_args(args))


def _stream(engine, prompt_ids: list[int], params) -> str:
    """Run one request, printing text as it is produced; returns the full text."""
    engine.add_request(prompt_ids, params, prompt_token_ids=prompt_ids)
    shown = ""
    while engine.has_unfinished():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")
    return shown


def cmd_serve(args: argparse.Namespace) -> int:
    from deepinfer.server.app import serve

    serve(engine_config_from_args(args), config_from_args(ServerConfig, args))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _load_engine(args)
    params = _sampling_params(args)
    for prompt in args.prompt:
        if args.raw:
            ids = engine.tokenize(prompt)
        else:
            from deepinfer.recipe.tokenizer import render_chat

            ids = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}])
        _stream(engine, ids, params)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from deepinfer.recipe.tokenizer import render_chat

    engine = _load_engine(args)
    params = _sampling_params(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("deepinfer chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = render_chat(engine.tokenizer, messages)
        if len(ids) >= engine.max_model_len:
            print(f"[conversation is {len(ids)} tokens, over the {engine.max_model_len}-token context; "
                  "use /reset]", file=sys.stderr)
            messages.pop()
            continue
        reply = _stream(engine, ids, params)
        messages.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="LLM inference serving.")
    parser.add_argument("--log-level", default="INFO", help="Logging level (default: INFO).")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="Run the OpenAI-compatible API server (default model if no --model).")
    add_config_arguments(srv, ServerConfig, *ENGINE_SECTIONS)
    srv.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="Generate a reply to one or more prompts and print it.")
    gen.add_argument("prompt", nargs="+", help="Prompt text (a user message unless --raw).")
    gen.add_argument("--raw", action="store_true", help="Send the prompt as-is, without the chat template.")
    _sampling_arguments(gen)
    add_config_arguments(gen, *ENGINE_SECTIONS)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="Interactive chat in the terminal.")
    chat.add_argument("--system", default=None, help="System prompt.")
    _sampling_arguments(chat)
    add_config_arguments(chat, *ENGINE_SECTIONS)
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"deepinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
