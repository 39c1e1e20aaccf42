"""`deepinfer` command line: serve | router | generate | chat | cache | bench simulate|eplb|economics|plot. Flags are generated from the config dataclasses."""

from __future__ import annotations

import argparse
import logging
import sys

from deepinfer.config import (
    CacheConfig,
    ClusterConfig,
    KVStoreConfig,
    LimitsConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RouterConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
    add_config_arguments,
    config_from_args,
    engine_config_from_args,
    parse_size,
)
from deepinfer.vllm_cli import add_vllm_arguments, apply_vllm_arguments

ENGINE_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig, KVStoreConfig, ParallelConfig, SpeculativeConfig,
                   LoRAConfig)


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


def _server_config(args: argparse.Namespace) -> ServerConfig:
    import dataclasses

    return dataclasses.replace(config_from_args(ServerConfig, args), limits=config_from_args(LimitsConfig, args))


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from deepinfer.server.app import serve

    for note in apply_vllm_arguments(args):
        print(f"deepinfer: {note}", file=sys.stderr)
    engine, server = engine_config_from_args(args), _server_config(args)
    cluster = config_from_args(ClusterConfig, args)
    if cluster.role != "unified":  # a worker: `auto` admission writes every block (KVStoreConfig.admission)
        engine = dataclasses.replace(engine, kvstore=dataclasses.replace(
            engine.kvstore, kv_store_admit=engine.kvstore.admission(cluster.role)))
    router = config_from_args(RouterConfig, args)
    if cluster.ray is not None:
        from deepinfer.cluster.ray_launcher import serve_ray_cluster

        serve_ray_cluster(engine, server, cluster, router, log_level=args.log_level)
    elif cluster.local_cluster:
        from deepinfer.cluster.launcher import serve_local_cluster

        serve_local_cluster(engine, server, cluster, router, log_level=args.log_level)
    elif cluster.role == "encode":  # the vision tower alone: no engine
        from deepinfer.cluster.encoder import serve_encode_worker

        serve_encode_worker(engine, server, cluster)
    elif cluster.role != "unified":
        from deepinfer.cluster.worker import worker_customizer

        # its API answers only callers with the cluster token: clients go through the router's API keys
        serve(engine, server, customize=worker_customizer(cluster, server), api_token=server.resolved_cluster_token())
    else:
        serve(engine, server)
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from deepinfer.cluster.router import serve_router

    serve_router(config_from_args(ModelConfig, args), config_from_args(KVStoreConfig, args),
                 config_from_args(RouterConfig, args), _server_config(args))
    return 0


def _chat_template_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Chat template (a Jinja file, or the template text) instead of the model's own; models "
                   "without one (base models) need it for chat.")


def _install_chat_template(engine, args: argparse.Namespace) -> bool:
    """Apply --chat-template; returns whether the tokenizer now has a chat template."""
    from deepinfer.recipe.tokenizer import use_chat_template

    use_chat_template(engine.tokenizer, args.chat_template)
    return bool(getattr(engine.tokenizer, "chat_template", None))


def cmd_generate(args: argparse.Namespace) -> int:
    if args.chat_template is not None:
        from deepinfer.recipe.tokenizer import read_chat_template

        read_chat_template(args.chat_template)  # fail before loading the model
    engine = _load_engine(args)
    params = _sampling_params(args)
    raw = args.raw
    if not raw and not _install_chat_template(engine, args):
        print("deepinfer: this model has no chat template (a base model?): sending the prompts as-is "
              "(--chat-template FILE renders them as a chat)", file=sys.stderr)
        raw = True
    for prompt in args.prompt:
        if raw:
            ids = engine.tokenize(prompt)
        else:
            from deepinfer.recipe.tokenizer import render_chat

            ids = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}])
        _stream(engine, ids, params)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from deepinfer.recipe.tokenizer import render_chat

    if args.chat_template is not None:
        from deepinfer.recipe.tokenizer import read_chat_template

        read_chat_template(args.chat_template)
    engine = _load_engine(args)
    if not _install_chat_template(engine, args):
        raise ValueError("this model has no chat template (a base model?): pass --chat-template FILE, or use "
                         "`deepinfer generate` for plain completions")
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


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_cache(args: argparse.Namespace) -> int:
    import json
    import shutil

    from deepinfer.config import resolve_size
    from deepinfer.kvcache import space

    path = KVStoreConfig(kv_store=args.store).store_path()
    if path is None:
        raise ValueError("--store none: no KV store to inspect")
    if not path.is_dir():
        raise FileNotFoundError(f"no KV store at {path}")
    if args.action == "stats":
        result = space.scan(path)
    elif args.action == "gc":
        max_bytes = None
        if args.max_bytes is not None:
            max_bytes = resolve_size(args.max_bytes, shutil.disk_usage(path).total)
        result = space.gc(path, max_bytes, verify=args.verify)
    else:
        result = space.clear(path)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif args.action == "stats":
        print(f"store: {result['path']}")
        print(f"objects: {result['objects']} ({result['blocks']} blocks), {_human(result['bytes'])}")
        for name, c in sorted(result["by_class"].items()):
            print(f"  {name}: {c['objects']} objects, {_human(c['bytes'])}")
        print(f"expired: {result['expired']} ({_human(result['expired_bytes'])})")
        print(f"corrupt: {result['corrupt']}, temp files: {result['tmp_files']}")
    else:
        for key, value in result.items():
            print(f"{key}: {_human(value) if key.endswith('bytes') else value}")
    return 0


def cmd_bench_simulate(args: argparse.Namespace) -> int:
    from deepinfer.bench.simulate import SimConfig, run

    report, _ = run(config_from_args(SimConfig, args))
    print(report)
    return 0


def cmd_bench_economics(args: argparse.Namespace) -> int:
    from deepinfer.bench.economics import EconomicsConfig, run

    print(run(config_from_args(EconomicsConfig, args)))
    return 0


def cmd_bench_plot(args: argparse.Namespace) -> int:
    from deepinfer.bench.plots import render_files

    for src, png in render_files(args.results, out_dir=args.out_dir, name=args.name):
        print(f"{src} -> {png}")
    return 0


def cmd_bench_eplb(args: argparse.Namespace) -> int:
    from deepinfer.bench.eplb import EplbSimConfig, run

    report, _ = run(config_from_args(EplbSimConfig, args))
    print(report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="LLM inference serving.")
    parser.add_argument("--log-level", default="INFO", help="Logging level (default: INFO).")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="Run the OpenAI-compatible API server (default model if no --model).")
    add_config_arguments(srv, ServerConfig, LimitsConfig, *ENGINE_SECTIONS, ClusterConfig, RouterConfig)
    add_vllm_arguments(srv)
    srv.set_defaults(func=cmd_serve)

    rtr = sub.add_parser("router", help="Run the load-balancing router in front of prefill and decode workers "
                         "(the same OpenAI API as serve).")
    add_config_arguments(rtr, ServerConfig, LimitsConfig, RouterConfig, ModelConfig, KVStoreConfig)
    rtr.set_defaults(func=cmd_router)

    gen = sub.add_parser("generate", help="Generate a reply to one or more prompts and print it.")
    gen.add_argument("prompt", nargs="+", help="Prompt text (a user message unless --raw).")
    gen.add_argument("--raw", action="store_true", help="Send the prompt as-is, without the chat template (the "
                     "default for models without one).")
    _sampling_arguments(gen)
    _chat_template_argument(gen)
    add_config_arguments(gen, *ENGINE_SECTIONS)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="Interactive chat in the terminal.")
    chat.add_argument("--system", default=None, help="System prompt.")
    _sampling_arguments(chat)
    _chat_template_argument(chat)
    add_config_arguments(chat, *ENGINE_SECTIONS)
    chat.set_defaults(func=cmd_chat)

    cache = sub.add_parser("cache", help="Inspect or clean the persistent KV block store.")
    store_args = argparse.ArgumentParser(add_help=False)
    store_args.add_argument("--store", default="auto",
                            help="Store directory (default: auto = <cache dir>/kvstore, as --kv-store).")
    store_args.add_argument("--json", action="store_true", help="Print the result as JSON.")
    actions = cache.add_subparsers(dest="action", required=True)
    actions.add_parser("stats", parents=[store_args],
                       help="Objects, bytes, bytes by retention class, expired and corrupt counts.")
    gc = actions.add_parser("gc", parents=[store_args],
                            help="Remove expired and corrupt blocks and stale temp files; with --max-bytes, "
                            "also evict least recently used blocks down to that size.")
    gc.add_argument("--max-bytes", default=None, type=parse_size,
                    help="Capacity to enforce: bytes (e.g. 100GiB) or a fraction of the filesystem's size.")
    gc.add_argument("--verify", action="store_true", help="Also check every payload checksum (reads everything).")
    actions.add_parser("clear", parents=[store_args], help="Remove every block in the store.")
    cache.set_defaults(func=cmd_cache)

    from deepinfer.bench.simulate import add_arguments as simulate_arguments

    bench = sub.add_parser("bench", help="Benchmarks that need no running server.")
    benches = bench.add_subparsers(dest="bench", required=True)
    sim = benches.add_parser("simulate", help="Replay a trace against modelled prefill/decode workers "
                             "(cost model + shared store hit model) and compare routing policies side by side.")
    simulate_arguments(sim)
    sim.set_defaults(func=cmd_bench_simulate)

    from deepinfer.bench.economics import EconomicsConfig

    econ = benches.add_parser("economics", help="Price a measured run (flags or a benchmark results JSON) or the "
                              "seeds' published figures: tokens/day, revenue and cost per accelerator-hour, margin, "
                              "payback, every step of the arithmetic shown.")
    add_config_arguments(econ, EconomicsConfig)
    econ.set_defaults(func=cmd_bench_economics)

    plot = benches.add_parser("plot", help="Render PNG plots from benchmark results JSON files (needs matplotlib: "
                              "the `bench` extra).")
    plot.add_argument("results", nargs="+", help="Results JSON files (benchmarks/results/*.json).")
    plot.add_argument("--out-dir", default=None, help="Where the PNGs go (default: next to each JSON).")
    plot.add_argument("--name", default=None, help="Prefix of the plots drawn over all serving results given "
                      "(<name>_streams.png, <name>_ttft.png; default: serving).")
    plot.set_defaults(func=cmd_bench_plot)

    from deepinfer.bench.eplb import add_arguments as eplb_arguments

    eplb = benches.add_parser("eplb", help="Expert-parallel load balancing at 64-128 ranks by simulation: replay "
                              "(recorded or Zipf) routing, scaled to 256 experts, against modelled ranks and compare "
                              "step time, waiting and imbalance across redundant expert counts.")
    eplb_arguments(eplb)
    eplb.set_defaults(func=cmd_bench_eplb)
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
