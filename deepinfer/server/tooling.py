"""The recipe as the endpoints use it: tools and tool choice of a request (one plan for all three APIs),
prompt rendering with its errors as 400s, the grammar that enforces a required / named tool choice,
and the output parser of each choice."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.multimodal.inputs import MultiModalInputs
from deepinfer.multimodal.processor import ImageError, split_images
from deepinfer.recipe.output import OutputParser
from deepinfer.recipe.tokenizer import NoChatTemplate
from deepinfer.recipe.tool_parsers import ToolCall
from deepinfer.recipe.tools import (
    ToolChoice,
    ToolError,
    ToolSpec,
    anthropic_tool_choice,
    openai_tool_choice,
    render_prompt,
    specs_from_anthropic,
    specs_from_openai,
    tool_choice_schema,
)
from deepinfer.server.protocol import APIError
from deepinfer.server.serving import ServingContext, with_structured_output


@dataclass(frozen=True)
class ToolPlan:
    specs: list[ToolSpec] = field(default_factory=list)
    choice: ToolChoice = ToolChoice("none")
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools are in the prompt and calls are parsed from the output."""
        return bool(self.specs) and self.choice.mode != "none"


def openai_plan(tools: list[dict] | None, choice: Any, parallel: bool | None) -> ToolPlan:
    try:
        specs = specs_from_openai(tools)
        return ToolPlan(specs, openai_tool_choice(choice, specs), parallel is not False)
    except ToolError as e:
        raise APIError(400, str(e), param=e.param) from e


def anthropic_plan(tools: list[dict] | None, choice: dict | None) -> ToolPlan:
    try:
        specs = specs_from_anthropic(tools)
        parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use"))
        return ToolPlan(specs, anthropic_tool_choice(choice, specs), parallel)
    except ToolError as e:
        raise APIError(400, str(e), param=e.param) from e


def render(ctx: ServingContext, messages: list[dict], plan: ToolPlan, param: str = "messages",
           add_generation_prompt: bool = True, as_text: bool = False, **template_kwargs: Any) -> list[int]:
    """Prompt ids through the chat template (`as_text`: its text); a template that refuses the conversation
    is a 400."""
    try:
        return render_prompt(ctx.engine.tokenizer, messages, plan.specs if plan.active else None,
                             add_generation_prompt, as_text, **template_kwargs)
    except APIError:
        raise
    except NoChatTemplate as e:
        raise APIError(400, str(e), param=param) from e
    except Exception as e:  # template errors (e.g. unsupported role order) are the client's to fix
        raise APIError(400, f"cannot apply the chat template: {e}", param=param) from e


def render_with_images(ctx: ServingContext, messages: list[dict], plan: ToolPlan, param: str = "messages",
                       add_generation_prompt: bool = True, **template_kwargs: Any
                       ) -> tuple[list[int], MultiModalInputs | None]:
    """`render`, for messages whose content may hold image parts (`image_url`): their images read and
    placed by the model's processor. An unreadable image is a 400 naming `param`."""
    messages, images = split_images(messages)
    if not images:
        return render(ctx, messages, plan, param, add_generation_prompt, **template_kwargs), None
    processor = ctx.engine.multimodal_processor
    if processor is None:
        raise APIError(400, "this model takes no images", param=param)
    text = render(ctx, messages, plan, param, add_generation_prompt, as_text=True, **template_kwargs)
    try:
        return processor(text, images, allowed_domains=ctx.media_domains)
    except ImageError as e:
        raise APIError(400, str(e), param=param) from e


def constrain(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """Enforce a required / named tool choice with a JSON schema, so the arguments always parse.

    A response format given with it (OpenAI allows the pair; instructor and the Agents SDK send it) is
    set aside for this turn: a forced turn is a tool call, so the tool grammar governs it, and the
    format governs the text turns that follow."""
    if not plan.choice.constrained:
        return params
    schema = tool_choice_schema(plan.specs, plan.choice, plan.parallel)
    return with_structured_output(dataclasses.replace(params, structured_output=None), "tool_choice",
                                  json_schema=schema)


def grammar_param(plan: ToolPlan, format_param: str | None) -> str | None:
    """The request field whose grammar the engine enforces (for error messages): the tool choice when
    it is forced, else the response format's field."""
    return "tool_choice" if plan.choice.constrained else format_param


def output_parser(ctx: ServingContext, prompt_ids: list[int], plan: ToolPlan,
                  structured: bool = False) -> OutputParser:
    """The parser of one choice's output; `structured`: a grammar (response format) shapes all of it,
    unless a forced tool choice replaced that grammar (see `constrain`)."""
    return OutputParser(ctx.recipe, ctx.engine.tokenizer, prompt_ids, tools=plan.active,
                        constrained_tools=plan.choice.constrained,
                        constrained=structured and not plan.choice.constrained)


def kept_calls(calls: list[ToolCall], plan: ToolPlan) -> list[ToolCall]:
    """The calls a reply returns: only the first when parallel calls are off."""
    return calls if plan.parallel else calls[:1]
