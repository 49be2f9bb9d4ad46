"""`dsv41 generate`: chat and thinking generation with the V4.1 chat encoding."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from dsv41_cli.common import DeviceOpt, JsonOpt, ModelOpt, load_on_ranks, resolve_model_dir, start_ranks
from dsv41_cli.console import err, fail, out, print_json


def input_file_prompts(text: str) -> list[str]:
    """The prompts of an `--input-file`: blank-line separated, each stripped, empty ones dropped."""
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def command(
    prompt: Optional[str] = typer.Argument(None, help="The user message (one turn)."),
    messages: Optional[Path] = typer.Option(None, "--messages", help="JSON file: a message list in the official encoder's schema."),
    tools: Optional[Path] = typer.Option(None, "--tools", help="JSON file: an OpenAI tool list, attached to the system message."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message placed first."),
    input_file: Optional[Path] = typer.Option(None, "--input-file", help="A batch: prompts separated by blank lines, one turn each."),
    interactive: bool = typer.Option(False, "--interactive", help="Chat with history; /exit quits, /clear forgets."),
    mode: str = typer.Option("thinking", "--mode", help="thinking|chat"),
    effort: str = typer.Option("high", "--effort", help="Reasoning effort 1..100, or low|high|max (50|75|100)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.6, "--temperature", min=0.0, help="0 = greedy."),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0),
    seed: Optional[int] = typer.Option(None, "--seed", help="Makes sampling reproducible."),
    use_dspark: bool = typer.Option(False, "--dspark/--no-dspark", help="DSpark speculative decoding."),
    thinking_budget: Optional[int] = typer.Option(None, "--thinking-budget", min=0,
                                                  help="Close </think> after this many reasoning tokens."),
    prefill_chunk: Optional[int] = typer.Option(None, "--prefill-chunk", min=1, help="Prefill the prompt in chunks of N tokens."),
    ced: str = typer.Option("full", "--ced", help="Prefill: full (exact) or replay (CED: the decoder runs on the last "
                                                  "window of the prompt only; docs/generation.md measures the cost)."),
    prefix_cache: Optional[Path] = typer.Option(None, "--prefix-cache", help="Directory of a persistent prefix cache "
                                                "(global KV on disk, SWA state in memory)."),
    image: Optional[List[Path]] = typer.Option(None, "--image", help="An image file placed before the prompt's text "
                                               "(repeatable; with --messages: in the last user message)."),
    print_prompt: bool = typer.Option(False, "--print-prompt", help="Print the exact prompt text and exit (no weights loaded)."),
    model: Optional[str] = ModelOpt,
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
):
    from dsv41.model import encoding

    if mode not in ("thinking", "chat"):
        fail(f"--mode must be thinking or chat, not {mode!r}")
    if ced not in ("full", "replay"):
        fail(f"--ced must be full or replay, not {ced!r}")
    try:
        effort_value = encoding.parse_effort(effort)
    except ValueError as e:
        fail(str(e))
    sources = [s for s in (prompt is not None, messages is not None, input_file is not None, interactive) if s]
    if len(sources) > 1:
        fail("give one of PROMPT, --messages, --input-file or --interactive")
    if not sources:
        fail("nothing to generate from: give a PROMPT, --messages FILE, --input-file FILE or --interactive")

    # one process, or one rank of `torchrun --nproc-per-node N -m dsv41_cli generate`: rank 0 owns the console
    ctx = start_ranks(device)
    tool_list = _read_json_file(tools, "--tools", list) if tools else None
    image_blocks = [{"type": "image_url", "image_url": {"url": str(p)}} for p in image or ()]
    if image_blocks and input_file is not None:
        fail("--image works with PROMPT, --messages or --interactive, not --input-file (use <image>path</image> tags)")
    for p in image or ():
        if not p.is_file():
            fail(f"--image {p}: no such file")
    if input_file is not None:
        try:
            text = input_file.read_text(encoding="utf-8")
        except OSError as e:
            fail(f"--input-file {input_file}: {e.strerror or e}")
        batch = [_turn(p, system, tool_list) for p in input_file_prompts(text)]
        if not batch:
            fail(f"--input-file {input_file}: no prompts in it")
    elif messages is not None:
        msgs = _read_json_file(messages, "--messages", list)
        if system:
            msgs = [{"role": "system", "content": system}] + msgs
        if tool_list:
            msgs = encoding.attach_tools(msgs, tool_list)
        if image_blocks:
            msgs = _with_images(msgs, image_blocks)
        batch = [msgs]
    elif prompt is not None:
        batch = [_turn(prompt, system, tool_list, image_blocks)]
    else:
        batch = []
    tool_list, batch = ctx.broadcast_object((tool_list, batch))  # every rank runs rank 0's prompts

    def encode(msgs, image_tags: bool = messages is None):
        """(prompt text, image records); `<image>path</image>` tags count in typed text, not in --messages."""
        try:
            return encoding.encode_messages_with_images(msgs, mode=mode, effort=effort_value, image_tags=image_tags)
        except (ValueError, TypeError, KeyError) as e:
            fail(f"cannot encode the messages: {e}")

    if print_prompt:
        if interactive:
            fail("--print-prompt needs a PROMPT, --messages or --input-file")
        for msgs in batch:
            sys.stdout.write(encode(msgs)[0] + ("\n" if len(batch) > 1 else ""))
        sys.stdout.flush()
        return

    from dsv41.model.engine import GenerationConfig, Generator, SamplingConfig

    model_dir = resolve_model_dir(model)
    net, args, tokenizer = load_on_ranks(model_dir, ctx)  # this rank's part of the model
    if use_dspark and not args.dspark_enabled:
        fail(f"--dspark: the checkpoint at {model_dir} has no DSpark drafter")
    engine = Generator(net, tokenizer, source=model_dir)  # named by the non-finite-logits error
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature, top_p, ctx.same_seed(seed)),
        stop_ids=(tokenizer.eos_id,), prefill_chunk=prefill_chunk, dspark=use_dspark,
        thinking_budget=thinking_budget if mode == "thinking" else None,
        think_end_id=tokenizer.token_to_id(encoding.THINK_END), ced=ced)
    if prefix_cache is not None:
        from dsv41.model.prefix_cache import PrefixCache

        try:
            config.prefix_cache = PrefixCache(prefix_cache)
        except OSError as e:
            fail(f"--prefix-cache {prefix_cache}: {e.strerror or e}")

    if interactive:
        _interactive(engine, tokenizer, config, mode, effort_value, system, tool_list, image_blocks, ctx)
        return
    for msgs in batch:
        prompt_text, records = encode(msgs)
        doc = run_one(engine, tokenizer, config, prompt_text, mode, stream=not as_json and ctx.is_main, images=records)
        if as_json:
            if len(batch) > 1:
                sys.stdout.write(json.dumps(doc) + "\n")
            else:
                print_json(doc)
        elif len(batch) > 1:
            out.print()


def _turn(text: str, system: str | None, tools: list | None, images: list[dict] | None = None) -> list[dict]:
    from dsv41.model import encoding

    content = text
    if images:  # the images first, then the text (whose <image>path</image> tags stay where they are)
        try:
            parsed = encoding.parse_image_tags(text)
        except ValueError as e:
            fail(f"cannot encode the messages: {e}")
        content = images + ([{"type": "text", "text": parsed}] if isinstance(parsed, str) else parsed)
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return encoding.attach_tools(msgs, tools) if tools else msgs


def _with_images(msgs: list, images: list[dict]) -> list:
    """--messages with --image: the images go first into the last user message."""
    users = [i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        fail("--image: the --messages list has no user message to put the images in")
    msgs = list(msgs)
    last = dict(msgs[users[-1]])
    content = last.get("content")
    blocks = content if isinstance(content, list) else ([{"type": "text", "text": content}] if content else [])
    last["content"] = images + blocks
    msgs[users[-1]] = last
    return msgs


def _read_json_file(path: Path, flag: str, kind: type):
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        fail(f"{flag} {path}: {e.strerror or e}")
    except json.JSONDecodeError as e:
        fail(f"{flag} {path}: not valid JSON ({e.msg} at line {e.lineno})")
    if not isinstance(value, kind):
        fail(f"{flag} {path}: expected a JSON {kind.__name__}")
    return value


class _Stream:
    """Incremental detokenization for the terminal: reasoning dimmed, then the answer."""

    def __init__(self, tokenizer, mode: str, enabled: bool):
        self.tok, self.enabled = tokenizer, enabled
        self.ids: list[int] = []
        self.shown = 0
        self.in_reasoning = mode == "thinking"
        if enabled and self.in_reasoning:
            out.print("[dim]Thinking…[/dim]")

    def __call__(self, token: int) -> None:
        if not self.enabled:
            return
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special=False)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        new, self.shown = text[self.shown:], len(text)
        if self.in_reasoning and "</think>" in text:
            before, _, after = new.partition("</think>")
            self._emit(before, dim=True)
            out.print("\n[dim]—[/dim]")
            self.in_reasoning = False
            new = after
        self._emit(new.replace("<｜end▁of▁sentence｜>", ""), dim=self.in_reasoning)

    def _emit(self, text: str, dim: bool) -> None:
        if text:
            out.print(text, end="", style="dim" if dim else None, markup=False, highlight=False)

    def close(self) -> None:
        if self.enabled:
            out.print()


def run_one(engine, tokenizer, config, prompt_text: str, mode: str, stream: bool, images: list | None = None,
            prompt_ids: list[int] | None = None) -> dict:
    """Generate for one encoded prompt; stream to the terminal or stay quiet; return the JSON document.
    `images`: the image records of the prompt's placeholders (each expands to its image's span).
    `prompt_ids`: the prompt's token ids when the caller has them (a conversation continued over the ids
    already generated); else `prompt_text` is tokenized."""
    from dsv41.model.completion import parse_completion

    ids = list(prompt_ids) if prompt_ids is not None else tokenizer.encode(prompt_text, allow_special=True)
    inputs = None
    if images or engine.args.image_token_id in ids:
        from dsv41.model.encoding import IMAGE_PLACEHOLDER
        from dsv41.model.vision import expand_image_placeholders

        placeholder = tokenizer.token_to_id(IMAGE_PLACEHOLDER)
        if engine.args.vision_enabled and placeholder is not None and placeholder != engine.args.image_token_id:
            fail(f"the tokenizer's {IMAGE_PLACEHOLDER} is id {placeholder} but the config's image_token_id is "
                 f"{engine.args.image_token_id}")
        try:
            ids, _, inputs = expand_image_placeholders(ids, images or [], engine.args)
        except ValueError as e:
            fail(str(e))
    streamer = _Stream(tokenizer, mode, stream)
    result = engine.generate(ids, config, on_token=streamer, images=inputs)
    streamer.close()
    completion = tokenizer.decode(result.output_ids, skip_special=False)
    parsed = parse_completion(completion, mode, finished=result.finish_reason == "stop")
    n_reason = _reasoning_tokens(result.output_ids, tokenizer, mode)
    doc = {
        "prompt_tokens": result.prompt_tokens,
        "output_ids": result.output_ids,
        "reasoning": parsed.reasoning,
        "content": parsed.content,
        "tool_calls": parsed.tool_calls,
        "finish_reason": result.finish_reason,
        "tokens": {"reasoning": n_reason, "content": len(result.output_ids) - n_reason,
                   "total": len(result.output_ids)},
        "stats": {
            "prefill_tokens_per_s": round(result.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(result.decode_tokens_per_s, 2),
            "peak_memory_bytes": result.peak_memory_bytes,
            "kv_bytes_per_token": round(result.kv_bytes_per_token, 2),
            "dspark": result.dspark and {k: result.dspark[k] for k in ("acceptance_per_position", "mean_accepted_per_step")},
        },
    }
    if result.prefill is not None:
        doc["prefill"] = result.prefill
    if parsed.errors:
        doc["parse_errors"] = parsed.errors
    if result.budget_forced:
        doc["thinking_budget_reached"] = True
    if stream:
        for call in parsed.tool_calls:
            out.print(f"[bold]tool call[/] {call['function']['name']}({call['function']['arguments']})")
        for e in parsed.errors:
            err.print(f"[yellow]warning:[/] {e}", markup=True)
        s = doc["stats"]
        line = (f"[dim]{result.prompt_tokens} prompt tokens · {len(result.output_ids)} generated "
                f"({n_reason} reasoning) · prefill {s['prefill_tokens_per_s']:.1f} tok/s · decode "
                f"{s['decode_tokens_per_s']:.1f} tok/s · peak {s['peak_memory_bytes'] / 2**20:.0f} MiB · "
                f"KV {s['kv_bytes_per_token']:.0f} B/token")
        if result.dspark:
            line += f" · DSpark {result.dspark['mean_accepted_per_step']:.2f} tokens/step"
        err.print(line + f" · {result.finish_reason}[/dim]", markup=True)
    return doc


def _reasoning_tokens(ids: list[int], tokenizer, mode: str) -> int:
    if mode != "thinking":
        return 0
    end = tokenizer.token_to_id("</think>")
    return ids.index(end) if end in ids else len(ids)


def _interactive(engine, tokenizer, config, mode, effort, system, tools, images=None, ctx=None) -> None:
    from dsv41.model import encoding
    from dsv41.model.parallel import current

    ctx = ctx or current()
    history: list[dict] = []
    # The conversation's token ids as the cache holds them after the last turn (prompts and generated ids),
    # or None: then the next prompt is the whole conversation, rendered again.
    cached_ids: list[int] | None = None
    pending_images = list(images or [])  # --image goes with the first message
    base = _turn("", system, tools)[:-1]  # the system message (and tools), if any
    if ctx.is_main:
        err.print("[dim]dsv41 chat — /exit to quit, /clear to forget the conversation[/dim]", markup=True)
    while True:
        try:
            line = ctx.on_main(input, ">>> ")  # rank 0 reads the console; every rank gets the line
        except EOFError:
            break
        if line.strip() == "/exit":
            break
        if line.strip() == "/clear":
            history, cached_ids = [], None
            continue
        if not line.strip():
            continue
        try:
            parsed = encoding.parse_image_tags(line)
        except ValueError as e:
            err.print(f"[red]error:[/] {e}", markup=True)
            continue
        if pending_images:
            parsed = pending_images + ([{"type": "text", "text": parsed}] if isinstance(parsed, str) else parsed)
            pending_images = []
        history.append({"role": "user", "content": parsed})
        try:
            prompt, records = encoding.encode_messages_with_images(base + history, mode=mode, effort=effort)
            prompt_ids = None
            if cached_ids is not None and not records:
                # Continue over what the cache holds: only the new turn, rendered after its context (no BOS,
                # no effort line). In thinking mode the model keeps its earlier reasoning, which the whole
                # rendering would drop (docs/generation.md).
                prompt = encoding.encode_messages(history[-1:], mode=mode, effort=effort, context=base + history[:-1])
                prompt_ids = cached_ids + tokenizer.encode(prompt, allow_special=True)
        except ValueError as e:
            history.pop()
            err.print(f"[red]error:[/] {e}", markup=True)
            continue
        continued = prompt_ids is not None
        if prompt_ids is None and not records:
            prompt_ids = tokenizer.encode(prompt, allow_special=True)
        doc = run_one(engine, tokenizer, config, prompt, mode, stream=ctx.is_main, images=records, prompt_ids=prompt_ids)
        reply = {"role": "assistant", "content": doc["content"]}
        if doc["reasoning"]:
            reply["reasoning_content"] = doc["reasoning"]
        if doc["tool_calls"]:
            reply["tool_calls"] = doc["tool_calls"]
        history.append(reply)
        # The next turn continues over these ids only if this turn is exactly the official rendering of the
        # new user message and the reply after their context (not after a cut or malformed reply, whose
        # history entry differs from what the model wrote, and never with images).
        cached_ids = None
        if not records:
            turn = (encoding.encode_messages(history[-2:], mode=mode, effort=effort, context=base + history[:-2])
                    if continued else encoding.encode_messages(base + history, mode=mode, effort=effort))
            if prompt + tokenizer.decode(doc["output_ids"], skip_special=False) == turn:
                cached_ids = prompt_ids + doc["output_ids"]
