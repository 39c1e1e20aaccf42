"""`vllm serve` command lines accepted by `deepinfer serve`, and vLLM's `LLM(...)` engine arguments accepted by
the offline `LLM`, so a launch script or a program written for vLLM runs unchanged.

Each vLLM flag here either means the same thing in deepinfer (the model as a positional argument,
`--tool-call-parser`), asks for what deepinfer always does (`--enable-auto-tool-choice`, `--enforce-eager`,
`--enable-chunked-prefill`, `--trust-remote-code`: no model code is ever run), only tunes vLLM itself
(request and stats logging; `--gpu-memory-utilization`, whose budget here is `--kv-cache-memory`), or takes
the one value deepinfer supports (`--tensor-parallel-size 1`, `--pipeline-parallel-size 1`,
`--kv-cache-dtype auto`). Any other value is an error naming the flag, never a silent change of what is
served; flags not listed here are argparse's "unrecognized arguments" (offline: a TypeError naming the argument).
"""

from __future__ import annotations

import argparse
import json

# vLLM's --tool-call-parser names -> deepinfer's --tool-parser names
TOOL_PARSERS = {"hermes": "hermes", "llama3_json": "llama3_json", "llama4_json": "llama3_json"}


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's spellings, in a group of their own (`deepinfer serve --help` lists them last)."""
    g = parser.add_argument_group("vLLM compatibility", "vllm serve flags, accepted as described in "
                                  "deepinfer/vllm_cli.py")
    g.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="The model, as `vllm serve MODEL` takes it (the same as --model).")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="vLLM's name of --tool-parser.")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, help="Only 1.")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, help="Only 1.")
    g.add_argument("--kv-cache-dtype", default=None, help="Only auto (the KV cache is in the model's dtype).")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="Accepted; the KV cache budget here is --kv-cache-memory.")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='Images per request, as {"image": N}: sets --max-images-per-request.')
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="Always on: the scheduler fits prefill chunks to a step budget.")
    for name, why in (("--enable-auto-tool-choice", "tool calls are always parsed when a request has tools"),
                      ("--trust-remote-code", "no model code from the model's repository is ever run"),
                      ("--enforce-eager", "no graphs are captured"),
                      ("--disable-log-requests", "requests are not logged"),
                      ("--enable-log-requests", "requests are not logged"),
                      ("--disable-log-stats", "stats are on /metrics, not in the log")):
        g.add_argument(name, action="store_true", help=f"Accepted: {why}.")


# vLLM's engine arguments (`vllm serve` flags and `LLM(...)` keywords) that deepinfer takes without a setting
# of its own; each is checked by `check_vllm_settings`
VLLM_SETTINGS = ("tensor_parallel_size", "pipeline_parallel_size", "kv_cache_dtype", "gpu_memory_utilization",
                 "enable_chunked_prefill", "trust_remote_code", "enforce_eager", "disable_log_stats")


def check_vllm_settings(kv_cache_memory: object = "auto", **settings: object) -> list[str]:
    """ValueError for a vLLM engine setting deepinfer cannot honour (any of `VLLM_SETTINGS`; None: not given);
    returns notes for the user about those accepted without effect."""
    notes: list[str] = []
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = settings.get(name)
        if value not in (None, 1):
            raise ValueError(f"{name} {value}: deepinfer runs a model on one device per process; scale out with "
                             "--prefill-workers / --decode-workers, MoE models with --expert-parallel-size")
    if settings.get("kv_cache_dtype") not in (None, "auto"):
        raise ValueError(f"kv_cache_dtype {settings['kv_cache_dtype']}: only auto (the model's dtype) is supported")
    if settings.get("enable_chunked_prefill") is False:
        raise ValueError("enable_chunked_prefill False: prefill is always chunked to the step budget here")
    fraction = settings.get("gpu_memory_utilization")
    if fraction is not None:
        if not isinstance(fraction, int | float) or not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
        notes.append(f"gpu_memory_utilization is not used: the KV cache budget is kv_cache_memory (now "
                     f"{kv_cache_memory})")
    return notes


def apply_vllm_arguments(args: argparse.Namespace) -> list[str]:
    """Fold the vLLM flags into deepinfer's (`args.model`, `args.tool_parser`); ValueError for a value deepinfer
    cannot honour. Returns notes for the user about flags accepted without effect."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.tool_call_parser is not None:
        name = TOOL_PARSERS[args.tool_call_parser]
        if args.tool_parser not in ("auto", name):
            raise ValueError(f"--tool-call-parser {args.tool_call_parser} contradicts --tool-parser {args.tool_parser}")
        args.tool_parser = name
    if args.limit_mm_per_prompt is not None:
        args.max_images_per_request = images_per_prompt(args.limit_mm_per_prompt)
    return check_vllm_settings(args.kv_cache_memory, **{name: getattr(args, name, None) for name in VLLM_SETTINGS})


def images_per_prompt(spec: str) -> int:
    """`--limit-mm-per-prompt`'s image count ({"image": N}; another modality is an error: only images are served)."""
    try:
        limits = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"--limit-mm-per-prompt takes JSON such as '{{\"image\": 4}}', got {spec!r}") from e
    if not isinstance(limits, dict) or set(limits) - {"image"} or not isinstance(limits.get("image", 1), int) \
            or isinstance(limits.get("image"), bool) or limits.get("image", 1) < 1:
        raise ValueError(f"--limit-mm-per-prompt: only images are served, as {{\"image\": N >= 1}}; got {spec!r}")
    return int(limits.get("image", 8))


def split_vllm_kwargs(kwargs: dict[str, object]) -> tuple[dict[str, object], list[str]]:
    """`LLM(...)`'s keyword arguments without vLLM's `VLLM_SETTINGS` (checked), and the notes about them."""
    vllm = {k: kwargs[k] for k in VLLM_SETTINGS if k in kwargs}
    notes = check_vllm_settings(kwargs.get("kv_cache_memory", "auto"), **vllm)
    return {k: v for k, v in kwargs.items() if k not in vllm}, notes
