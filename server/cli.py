"""The ``harpoon`` command: ``serve`` (start the engine process, then the HTTP server; drain gracefully on SIGTERM)
and ``generate`` (complete one prompt offline). The benchmarks run as ``python -m loadtest.serve`` and
``python -m loadtest.offline``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

# NOTE: only light modules here (no torch, transformers or FastAPI): the engine process starts first, and spawn
# imports this module again in it. The API's modules load while the engine loads the model (``serve``).
from engine.arg_utils import add_engine_arguments, engine_args_from, parse_memory
from engine.config import EngineConfig
from engine.gc_heap import freeze_startup_heap
from engine.model_loader import load_tokenizer, resolve_model, sampling_defaults
from engine.timeline import DEFAULT_CAPACITY
from server.engine_client import make_engine_client
from server.limits import DEFAULT_MAX_BODY_BYTES
from server.reasoning import REASONING_PARSERS
from server.tool_parsers import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from server.async_engine import AsyncEngine

logger = logging.getLogger("harpoon.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harpoon serve", description="Serve a model over the OpenAI API.")
    parser.add_argument("--model", default=os.environ.get("HARPOON_MODEL") or None,
                        help="local folder, .gguf file or hub id (default: SmolLM2-135M-Instruct, bundled)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("HARPOON_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (env HARPOON_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: the model's)")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="requests queued beyond max-num-seqs before new ones get 429")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish after SIGTERM")
    parser.add_argument("--max-request-body-bytes", type=_byte_size, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted (bytes, or e.g. 16MiB); larger ones get 413 "
                             "(default 8MiB)")
    parser.add_argument("--health-stall-timeout", type=float, default=60.0,
                        help="with requests in flight and no step finished for this long, /health turns 503 and "
                             "the engine is killed and started again")
    parser.add_argument("--in-process-engine", action="store_true",
                        help="run the engine on a thread of this process (debugging)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let tool_choice "auto" (the default with tools) read calls from the text; needs '
                             "--tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                        help="how the model writes tool calls (hermes: <tool_call>{json}</tool_call>, Qwen2.5/3)")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="split a reasoning model's thinking into reasoning_content (qwen3: <think> blocks, "
                             "Qwen3/Qwen3.5; deepseek_r1: thinking until </think>; gpt_oss: harmony channels)")
    parser.add_argument("--thinking-token-budget", type=int, default=None,
                        help="with --reasoning-parser: thinking tokens a request gets where it sets no "
                             "thinking_token_budget; the end marker is forced when they are spent")
    parser.add_argument("--thinking-deadline-ms", type=float, default=None,
                        help="with --reasoning-parser: milliseconds from arrival by which thinking is closed where a "
                             "request sets no thinking_deadline_ms")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (a file, or the template itself) in place of the tokenizer's")
    parser.add_argument("--generation-config", default="auto",
                        help="sampling values for the fields a request leaves out: 'auto' (the model's "
                             "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, "
                             "max_new_tokens), 'vllm' (none: the API's defaults) or a folder holding one")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--enable-debug-routes", action="store_true",
                        help="serve GET /dashboard and its data behind the API key: /debug/requests[/{id}] (the "
                             "latest requests, one's timeline), /debug/kv (the KV pool), /debug/memory (the memory "
                             "ledger), /debug/stats (the last minutes); keeps the last --request-timelines requests "
                             f"(default {DEFAULT_CAPACITY})")
    add_engine_arguments(parser)
    return parser


def chat_template_text(value: str) -> str:
    """--chat-template: the file it names, or the template itself (vLLM's rule)."""
    path = Path(value)
    return path.read_text() if path.is_file() else value


def _byte_size(text: str) -> int:
    size = parse_memory(text)
    if not isinstance(size, int) or size < 1:
        raise argparse.ArgumentTypeError(f"expected a size in bytes (e.g. 8388608 or 8MiB), got {text!r}")
    return size


class EngineStartError(RuntimeError):
    """No engine could be started: the server exits non-zero with this reason."""


class _DrainingServer(uvicorn.Server):
    """First SIGTERM/SIGINT: refuse new requests (503), wait for in-flight ones up to the timeout, then exit.
    A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.timeout = timeout
        self._draining = False

    def handle_exit(self, sig: int, frame: object) -> None:
        app = self.config.app
        if self._draining:
            return super().handle_exit(sig, frame)
        self._draining = True
        app.state.draining = True
        logger.info("%s: draining %d in-flight requests (up to %.0f s)", signal.Signals(sig).name,
                    self.engine.num_in_flight, self.timeout)
        asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True


async def serve(args: argparse.Namespace, engine_args: dict) -> None:
    files = resolve_model(args.model)  # in this process first: a GGUF file's config and tokenizer are read once, here
    try:
        defaults = sampling_defaults(files, args.generation_config)
    except ValueError as e:
        raise EngineStartError(str(e)) from None
    if defaults:
        logger.info("sampling defaults from generation_config.json (--generation-config %s): %s",
                    args.generation_config, ", ".join(f"{k}={v}" for k, v in defaults.items()))
    if args.enable_debug_routes and not engine_args.get("request_timelines"):
        engine_args = {**engine_args, "request_timelines": DEFAULT_CAPACITY}
    config = EngineConfig.from_kwargs(model=str(files.source), **engine_args)
    client = make_engine_client(config, in_process=args.in_process_engine)
    engine_started = asyncio.create_task(client.start())
    await asyncio.sleep(0)  # the engine process is spawned: its imports and the model load run from now on
    # The tokenizer and the API's modules load while the engine starts: transformers took ~2.4 s over a 128K
    # vocabulary of Llama 3's size (a random 8B file's, docs/history/benchmarks-2026-12.md), and the API's imports
    # (FastAPI, transformers) ~2 s.
    tokenizer_loaded = asyncio.create_task(asyncio.to_thread(load_tokenizer, files))
    from server.api import build_app
    from server.async_engine import AsyncEngine
    from server.metrics import Metrics
    from server.serving import ThinkingDefaults

    try:
        info = await engine_started
    except RuntimeError as e:
        await asyncio.gather(tokenizer_loaded, return_exceptions=True)  # the engine's reason is the one to report
        raise EngineStartError(str(e)) from None
    try:
        tokenizer = await tokenizer_loaded
    except BaseException:
        await client.shutdown()
        raise
    if args.chat_template is not None:
        tokenizer.chat_template = chat_template_text(args.chat_template)
    name = args.served_model_name or files.name
    engine = AsyncEngine(client, tokenizer, Metrics(name), stall_timeout=args.health_stall_timeout)
    auto_tool_parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    app = build_app(engine, name, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                    tool_call_parser=auto_tool_parser, max_body_bytes=args.max_request_body_bytes,
                    enable_debug_routes=args.enable_debug_routes, reasoning_parser=args.reasoning_parser,
                    thinking=ThinkingDefaults(args.thinking_token_budget, args.thinking_deadline_ms),
                    sampling_defaults=defaults)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                               timeout_graceful_shutdown=5, access_log=args.log_level == "debug")
    server = _DrainingServer(uv_config, engine, args.shutdown_timeout)

    def give_up(reason: str) -> None:  # no engine could be started again: exit, for a supervisor to restart us
        server.should_exit = True

    engine.on_fatal = give_up
    engine.start_watchdog()
    freeze_startup_heap()
    logger.info("serving %s as %r on %s (%s) | %s", files.name, name, info.device, info.dtype, info.kv_cache)
    logger.info("ready: http://%s:%d/v1  (max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d)",
                args.host, args.port, info.limits.max_model_len, info.max_num_seqs, info.max_num_batched_tokens)
    try:
        await server.serve()
    finally:
        await engine.close()
        await client.shutdown()
    if engine.fatal_reason is not None:
        raise EngineStartError(engine.fatal_reason)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if args.tool_call_parser == "openai" and args.reasoning_parser != "gpt_oss":
        parser.error("--tool-call-parser openai reads harmony messages: it needs --reasoning-parser gpt_oss")
    bounds = args.thinking_token_budget is not None or args.thinking_deadline_ms is not None
    if bounds and args.reasoning_parser is None:
        parser.error("--thinking-token-budget and --thinking-deadline-ms need --reasoning-parser")
    engine_args = engine_args_from(args, parser)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(args, engine_args))
    except EngineStartError as e:
        logger.critical("%s", e)
        sys.exit(f"harpoon serve: the engine could not start: {str(e).splitlines()[0]}")


def generate(argv: list[str]) -> None:
    """``harpoon generate PROMPT``: one completion, offline, printed."""
    parser = argparse.ArgumentParser(prog="harpoon generate", description="Complete one prompt and print it.")
    parser.add_argument("prompt")
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    engine_args = engine_args_from(args, parser)
    from engine import LLM, SamplingParams

    llm = LLM(args.model, **engine_args)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False
        )
    out = llm.generate([prompt], SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))[0]
    print((args.prompt if not args.chat else "") + out.outputs[0].text)


def harpoon(argv: list[str] | None = None) -> None:
    """The ``harpoon`` command: ``serve`` or ``generate``, then that command's options."""
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": main, "generate": generate}
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: harpoon {serve | generate} [options]; add --help after a command for its options")
        return
    if argv[0] not in commands:
        sys.exit(f"harpoon: unknown command {argv[0]!r}; expected one of: {', '.join(commands)}")
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
