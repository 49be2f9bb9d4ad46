"""`dsv41 generate`: chat and thinking generation with the V4.1 chat encoding."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, List, Optional

import typer

from dsv41_cli.common import DeviceOpt, ModelOpt, load_on_ranks, resolve_model_dir, start_ranks
from dsv41_cli.console import err, fail, note, out, print_json

EPILOG = """Examples:

\b
  dsv41 generate --effort 75 "Add: 7 3 9 2 5"
  echo "Add: 7 3 9 2 5" | dsv41 generate --temperature 0 --max-new-tokens 128
  dsv41 generate --input-file prompts.txt --json > replies.jsonl
  dsv41 generate --interactive --mode chat
"""

# what a --tools entry looks like (the OpenAI tool list; the encoder renders each "function" object)
TOOL_FORM = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'


def input_file_prompts(text: str) -> list[str]:
    """The prompts of an `--input-file`: blank-line separated, each stripped, empty ones dropped."""
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def command(
    prompt: Optional[str] = typer.Argument(None, help="The user message (one turn). Omitted or -: read from stdin "
                                                      "(a terminal with no prompt is a usage error)."),
    messages: Optional[Path] = typer.Option(None, "--messages", help="JSON file: a message list in the official encoder's schema."),
    tools: Optional[Path] = typer.Option(None, "--tools", help="JSON file: an OpenAI tool list, attached to the system message."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message placed first."),
    input_file: Optional[Path] = typer.Option(None, "--input-file", help="A batch: prompts separated by blank lines, "
                                              "one turn each. With --json: JSON Lines, one document per prompt."),
    interactive: bool = typer.Option(False, "--interactive", help="Chat with history; /exit quits, /clear forgets. "
                                     "Ctrl-C cancels the reply being written; Ctrl-C at an empty prompt or Ctrl-D ends."),
    mode: str = typer.Option("thinking", "--mode", help="thinking|chat"),
    effort: str = typer.Option("high", "--effort", help="Reasoning effort 1..100, or low|high|max (50|75|100)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1, help="At most this many generated tokens "
                                       "(capped, with a note, where the prompt leaves less of the model's context)."),
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
    max_batch_size: int = typer.Option(32, "--max-batch-size", min=1, help="--input-file: at most this many "
                                       "prompts decoding at once (continuous batching)."),
    max_batch_tokens: Optional[int] = typer.Option(None, "--max-batch-tokens", min=1, show_default=False,
                                                   help="--input-file: the prompts in flight reserve their prompt and "
                                                   "--max-new-tokens; at most this many positions in all (default: "
                                                   "--max-batch-size x the model's context)."),
    engines: int = typer.Option(0, "--engines", min=0, show_default=False,
                                help="--input-file: engines decoding at once on the CPU, one process each with "
                                     "--max-batch-size rows (default: one per CPU core, at most 8; 1 on a GPU). The "
                                     "replies do not depend on it."),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs", help="On CUDA, replay the decode step "
                                     "from CUDA graphs (DSV41_CUDA_GRAPHS=0 also turns them off)."),
    print_prompt: bool = typer.Option(False, "--print-prompt", help="Print the exact prompt text and exit (no weights loaded)."),
    model: Optional[str] = ModelOpt,
    device: str = DeviceOpt,
    as_json: bool = typer.Option(False, "--json", help="Print JSON on stdout instead of streaming text (logs go to "
                                 "stderr): one document; with --input-file JSON Lines, one document per prompt."),
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
    from_stdin = prompt == "-" or not sources  # `dsv41 generate` with no prompt reads it from stdin, as `-` does
    if prompt is not None and not from_stdin:
        _check_prompt(prompt, "the prompt", bool(image))

    # one process, or one rank of `torchrun --nproc-per-node N -m dsv41_cli generate`: rank 0 owns the console
    ctx = start_ranks(device)
    if engines > 1 and (ctx.distributed or ctx.device != "cpu"):
        fail(f"--engines {engines}: several engines run on the CPU in one command (one process each), not on "
             f"{ctx.device} or under torchrun")
    if from_stdin:
        prompt = ctx.on_main(_read_stdin_prompt, prompt == "-")  # rank 0 reads it; every rank gets it
        _check_prompt(prompt, "the prompt read from stdin", bool(image))
    tool_list = _check_tools(_read_json_file(tools, "--tools", object), f"--tools {tools}") if tools else None
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
        for i, m in enumerate(msgs, 1):  # tools inside the file: named as clearly as --tools's
            if isinstance(m, dict) and m.get("tools") is not None:
                _check_tools(m["tools"], f"--messages {messages}: message {i} ({m.get('role')!r}) tools")
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

    if not cuda_graphs:
        os.environ["DSV41_CUDA_GRAPHS"] = "0"
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
    if input_file is not None:  # the whole file to the engine at once; replies in the file's order
        from dsv41.evals.engine_pool import EnginePool, default_engines

        # several engines (worker processes, evals/engine_pool.py) where each can take its share: the CPU, one
        # process of the command, no token budget across the whole batch (the pool itself keeps requests with a
        # prefix cache, an object of this process, in this process)
        spread = not ctx.distributed and max_batch_tokens is None
        pool = EnginePool(engine, model_dir, engines or default_engines(ctx.device), max_batch_size) if spread else None
        try:
            with pool or contextlib.nullcontext():
                run_batch(engine, tokenizer, config, [encode(msgs) for msgs in batch], mode, as_json,
                          notes=ctx.is_main, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                          pool=pool)
        except ContextFull as e:
            fail(str(e))
        return
    for msgs in batch:
        prompt_text, records = encode(msgs)
        try:
            doc = run_one(engine, tokenizer, config, prompt_text, mode, stream=not as_json and ctx.is_main,
                          images=records, notes=ctx.is_main)
        except ContextFull as e:
            fail(str(e))
        if as_json:
            if input_file is not None:  # JSON Lines: one compact document per prompt, each flushed as it is done
                sys.stdout.write(json.dumps(doc) + "\n")
                sys.stdout.flush()
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


def _read_stdin_prompt(explicit: bool) -> str:
    """The prompt piped on stdin (one trailing line break dropped). A terminal on stdin without `-` is a
    usage error, not a wait for input that nothing announced; with `-`, the prompt is typed up to Ctrl-D."""
    stdin = sys.stdin
    if stdin is None:
        fail("no prompt: give PROMPT (stdin is closed)")
    try:
        tty = stdin.isatty()
    except (OSError, ValueError):
        tty = False
    if tty and not explicit:
        fail("no prompt: give PROMPT, pipe it on stdin (or pass - and type it, Ctrl-D to end), "
             "or use --messages FILE, --input-file FILE or --interactive")
    if tty:
        err.print("[dim]reading the prompt from stdin; end it with Ctrl-D[/dim]", markup=True)
    try:
        data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode("utf-8")
    except (OSError, ValueError) as e:
        fail(f"cannot read the prompt from stdin: {e}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"the prompt read from stdin is not UTF-8 ({e.reason} at byte {e.start})")
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


def _check_prompt(text: str, what: str, has_images: bool) -> None:
    """An empty or whitespace-only prompt is bad input (exit 2), unless images make up the message."""
    if not text.strip() and not has_images:
        fail(f"{what} is empty: give some text (or --image FILE)")


def _kind(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _check_tools(tools, where: str) -> list:
    """An OpenAI tool list, or a one-line error naming what is wrong with it (the encoder reads each entry's
    "function" object: a name, and a JSON Schema object under "parameters")."""
    if not isinstance(tools, list):
        hint = " (a single tool? put it in [ ])" if isinstance(tools, dict) and "function" in tools else ""
        fail(f"{where}: expected a JSON list of tools, got a JSON {_kind(tools)}{hint}; each tool: {TOOL_FORM}")
    for i, tool in enumerate(tools, 1):
        what = f"{where}: tool {i}"
        if not isinstance(tool, dict):
            fail(f"{what} is a JSON {_kind(tool)}, not an object; expected {TOOL_FORM}")
        fn = tool.get("function")
        if fn is None:
            hint = (" (it looks like a bare function: wrap it as {\"type\": \"function\", \"function\": {...}})"
                    if "name" in tool else "")
            fail(f"{what} has no \"function\" object{hint}; expected {TOOL_FORM}")
        if tool.get("type", "function") != "function":
            fail(f"{what}: \"type\" is {json.dumps(tool['type'])}; only \"function\" tools exist")
        if not isinstance(fn, dict):
            fail(f"{what}: \"function\" is a JSON {_kind(fn)}, not an object; expected {TOOL_FORM}")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            fail(f"{what}: \"function\" has no \"name\" (a non-empty string)")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            fail(f"{what} ({name}): \"parameters\" is a JSON {_kind(fn['parameters'])}; "
                 "expected a JSON Schema object, e.g. {\"type\": \"object\", \"properties\": {...}}")
        if "description" in fn and not isinstance(fn["description"], str):
            fail(f"{what} ({name}): \"description\" is a JSON {_kind(fn['description'])}, not a string")
    return tools


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


class ContextFull(ValueError):
    """The prompt leaves no room in the model's context for a reply."""


class _Cancel(Exception):
    """Ctrl-C during a reply of `--interactive`: the reply is dropped, the conversation goes on."""


def cap_to_context(config, n_prompt: int, context: int | None):
    """`config` with `max_new_tokens` at most what the context leaves after the prompt (prompt and reply
    together at most `context` positions), and the cap applied or None. ContextFull if nothing is left."""
    if config is None or not context:
        return config, None
    room = context - n_prompt
    if room <= 0:
        raise ContextFull(f"the prompt is {n_prompt} tokens and the model's context is {context}: "
                          "no room left for a reply")
    if config.max_new_tokens <= room:
        return config, None
    return dataclasses.replace(config, max_new_tokens=room), room


@contextlib.contextmanager
def _ctrl_c_cancels(enabled: bool):
    """While a reply is written: the first Ctrl-C asks to stop at the next token (the streamer raises
    _Cancel there, so no forward is cut in the middle); a second one stops at once (a long prefill).
    Yields the question 'was Ctrl-C pressed?'."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    asked = []

    def handler(signum, frame):
        if asked:
            raise _Cancel()
        asked.append(True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)


def _typed_text() -> bool:
    """Whether the line being typed at the prompt held text (readline's buffer; False without readline)."""
    readline = sys.modules.get("readline")
    try:
        return bool(readline and readline.get_line_buffer().strip())
    except Exception:  # noqa: BLE001 - an unusual readline: treat the line as empty
        return False


class _Stream:
    """The reply on the terminal as it is written: the completion parser's stream (model/completion.py
    CompletionStream) prints reasoning dimmed, then the answer; DSML markup and special tokens never show
    (tool calls are listed after the reply)."""

    def __init__(self, tokenizer, mode: str, enabled: bool):
        self.enabled = enabled
        self.parser = None
        self.in_reasoning = False
        if enabled:
            from dsv41.model.completion import CompletionStream

            self.parser = CompletionStream(tokenizer, mode)
            if mode == "thinking":
                out.print("[dim]Thinking…[/dim]")
                self.in_reasoning = True

    def __call__(self, token: int) -> None:
        if self.enabled:
            self._show(self.parser.feed(token))

    def _show(self, events) -> None:
        for e in events:
            if e.kind == "reasoning" and e.text:
                out.print(e.text, end="", style="dim", markup=False, highlight=False)
            elif e.kind == "content" and e.text:
                if self.in_reasoning:
                    out.print("\n[dim]—[/dim]")
                    self.in_reasoning = False
                out.print(e.text, end="", markup=False, highlight=False)

    def close(self, finish_reason: str = "length") -> None:
        if self.enabled:
            self._show(self.parser.close(finish_reason))
            out.print()


def run_one(engine, tokenizer, config, prompt_text: str, mode: str, stream: bool, images: list | None = None,
            prompt_ids: list[int] | None = None, cancelled: Callable[[], bool] | None = None,
            notes: bool | None = None) -> dict:
    """Generate for one encoded prompt; stream to the terminal or stay quiet; return the JSON document.
    `images`: the image records of the prompt's placeholders (each expands to its image's span).
    `prompt_ids`: the prompt's token ids when the caller has them (a conversation continued over the ids
    already generated); else `prompt_text` is tokenized. `--max-new-tokens` beyond what the model's
    context leaves after the prompt is capped with a note (ContextFull if nothing is left).
    `cancelled`: asked after every token; True raises _Cancel (the reply is abandoned). `notes`: print the
    cap's note on stderr (default: when streaming)."""
    ids, inputs, config, capped = _prepare(engine, tokenizer, config, prompt_text, images, prompt_ids,
                                           stream if notes is None else notes)
    streamer = _Stream(tokenizer, mode, stream)
    on_token = streamer
    if cancelled is not None:
        def on_token(token: int) -> None:
            streamer(token)
            if cancelled():
                raise _Cancel()
    try:
        result = engine.generate(ids, config, on_token=on_token, images=inputs)
    except _Cancel:
        streamer.close()
        raise
    streamer.close(result.finish_reason)
    return _document(result, tokenizer, mode, capped, stream)


def run_batch(engine, tokenizer, config, encoded: list[tuple], mode: str, as_json: bool, notes: bool,
              max_batch_size: int = 32, max_batch_tokens: int | None = None, pool=None) -> None:
    """`--input-file`: every prompt (encoded: (prompt text, image records)) to the engine at once
    (continuous batching; over the engines of `pool`, an evals.engine_pool.EnginePool, when given). Replies
    come out in the file's order, each as soon as it and every reply before it are done: a JSON line each
    with --json (flushed), else the reply as `generate` streams it (reasoning dimmed, then the answer, then
    the stats line), written whole."""
    from dsv41.model.engine import Request, RequestTooLarge

    prepared = [_prepare(engine, tokenizer, config, text, records, None, notes) for text, records in encoded]
    requests = [Request(ids, cfg, inputs) for ids, inputs, cfg, _ in prepared]
    docs: dict[int, tuple] = {}
    shown = [0]

    def done(i, result):
        docs[i] = result
        while shown[0] in docs:
            k = shown[0]
            result = docs.pop(k)
            if as_json:
                sys.stdout.write(json.dumps(_document(result, tokenizer, mode, prepared[k][3], False)) + "\n")
                sys.stdout.flush()
            else:
                streamer = _Stream(tokenizer, mode, True)
                for token in result.output_ids:
                    streamer(token)
                streamer.close(result.finish_reason)
                _document(result, tokenizer, mode, prepared[k][3], True)
                if k + 1 < len(prepared):
                    out.print()
            shown[0] += 1

    try:
        if pool is not None:
            pool.generate_many(requests, on_done=done)
        else:
            engine.generate_many(requests, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                                 on_done=done)
    except RequestTooLarge as e:
        fail(f"--max-batch-tokens: {e}")


def _prepare(engine, tokenizer, config, prompt_text: str, images, prompt_ids, notes: bool):
    """(prompt ids with image spans expanded, the ImageInputs, the config capped to the context, the cap)."""
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
    asked = config.max_new_tokens if config is not None else None
    config, capped = cap_to_context(config, len(ids), getattr(engine.args, "max_position_embeddings", None))
    if capped is not None and notes:
        note(f"--max-new-tokens {asked} capped to {capped}: the model's context is "
             f"{engine.args.max_position_embeddings} tokens and the prompt takes {len(ids)}")
    return ids, inputs, config, capped


def _document(result, tokenizer, mode: str, capped, stream: bool) -> dict:
    """The JSON document of a finished reply; with `stream`, also its tool calls, parser warnings and
    the stats line on the terminal."""
    from dsv41.model.completion import parse_completion

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
    if capped is not None:
        doc["max_new_tokens_capped_to"] = capped
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
    # Ctrl-C cancels the reply being written (one process; under torchrun, torchrun stops its workers)
    local = ctx.is_main and not getattr(ctx, "distributed", False)
    if local and sys.stdin is not None and sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing for input(), and the typed line for Ctrl-C
    if ctx.is_main:
        err.print("[dim]dsv41 chat — /exit to quit, /clear to forget the conversation; Ctrl-C cancels a reply, "
                  "Ctrl-D (or Ctrl-C at an empty prompt) ends[/dim]", markup=True)
    while True:
        try:
            line = ctx.on_main(input, ">>> ")  # rank 0 reads the console; every rank gets the line
        except EOFError:
            break
        except KeyboardInterrupt:
            if local and _typed_text():  # Ctrl-C with text typed: drop the line, as a shell does
                out.print()
                continue
            if ctx.is_main:
                out.print()
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
        try:
            with _ctrl_c_cancels(local) as cancelled:
                doc = run_one(engine, tokenizer, config, prompt, mode, stream=ctx.is_main, images=records,
                              prompt_ids=prompt_ids, cancelled=cancelled if local else None)
        except _Cancel:  # the turn is dropped (message and partial reply); the cache ids stay the last turn's
            history.pop()
            err.print("[dim]reply cancelled; the conversation goes on without that message[/dim]", markup=True)
            continue
        except ContextFull as e:
            history.pop()
            err.print(f"[red]error:[/] {e} (/clear starts over)", markup=True)
            continue
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
