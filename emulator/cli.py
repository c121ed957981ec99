"""``kvferry emulate``: run an emulated vLLM server from the command line."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from emulator.config import KV_LOAD_FAILURE_POLICIES, ROLES, ConfigError, EmulatorConfig
from emulator.server import serve_forever
from emulator.tokenizer_files import write_tokenizer_files
from kvferry import logs
from kvferry.flags import finite_float
from kvferry.tasks import run_process

_DEFAULTS = EmulatorConfig()


def build_parser() -> argparse.ArgumentParser:
    """Flags of the emulator; defaults mirror ``EmulatorConfig``."""
    parser = argparse.ArgumentParser(
        prog="kvferry emulate",
        description="A vLLM stand-in: OpenAI HTTP API, NIXL-like KV transfer, KV events.",
    )
    _add_engine_flags(parser)
    _add_endpoint_flags(parser)
    _add_transfer_flags(parser)
    _add_timing_flags(parser)
    logs.add_level_flag(parser)
    return parser


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Where the HTTP API listens, what it serves, and how big the engine is."""
    add = parser.add_argument
    add("--host", default=_DEFAULTS.host, help="HTTP bind address")
    add("--port", type=int, default=_DEFAULTS.port, help="HTTP port (0 = any free)")
    add("--role", choices=ROLES, default=_DEFAULTS.role, help="deployment role")
    add("--model", default=_DEFAULTS.model, help="served model name")
    add("--api-key", default=_DEFAULTS.api_key, help="key that /v1/... requests must bear (vLLM's --api-key)")
    add("--block-size", type=int, default=_DEFAULTS.block_size, help="tokens per KV block")
    add("--num-blocks", type=int, default=_DEFAULTS.num_blocks, help="KV blocks in the pool")
    add("--max-model-len", type=int, default=_DEFAULTS.max_model_len, help="longest sequence")
    add("--engine-id", default=None, help="fixed engine id (default: fresh uuid per start)")
    add(
        "--write-tokenizer",
        metavar="DIR",
        default=None,
        help="write the engine's tokenizer as a model's tokenizer files (tokenizer.json, "
        "tokenizer_config.json) into DIR, for `kvferry router --tokenizer DIR`, and exit",
    )


def _add_endpoint_flags(parser: argparse.ArgumentParser) -> None:
    """Where the KV side channel and the KV-event publisher listen."""
    add = parser.add_argument
    add("--side-channel-host", default=_DEFAULTS.side_channel_host, help="KV side-channel host")
    add(
        "--side-channel-port",
        type=int,
        default=_DEFAULTS.side_channel_port,
        help="KV side-channel port (0 = any free)",
    )
    add("--kv-events-host", default=_DEFAULTS.kv_events_host, help="KV-event bind interface")
    add("--kv-events-port", type=int, default=0, help="KV-event ZMQ PUB port (0 = off)")
    add(
        "--kv-events-replay-port",
        type=int,
        default=0,
        help="KV-event ZMQ ROUTER replay port (0 = off)",
    )
    add("--kv-events-topic", default=_DEFAULTS.kv_events_topic, help="KV-event topic")


def _add_transfer_flags(parser: argparse.ArgumentParser) -> None:
    """How KV moves between engines and how long it is held (vLLM's connector settings)."""
    add = parser.add_argument
    add(
        "--bidirectional-kv-xfer",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.bidirectional_kv_xfer,
        help="as decoder, pin finished requests' blocks for the next turn's prefiller",
    )
    add(
        "--kv-recompute-threshold",
        type=int,
        default=_DEFAULTS.kv_recompute_threshold,
        help="as prefiller, recompute pulls of fewer tokens",
    )
    add(
        "--decoder-kv-blocks-ttl",
        type=finite_float,
        default=_DEFAULTS.decoder_kv_blocks_ttl,
        help="seconds a decoder keeps finished requests' blocks pinned",
    )
    add(
        "--kv-abort-timeout",
        type=finite_float,
        default=_DEFAULTS.kv_abort_timeout,
        help="seconds a prefiller holds blocks for its decoder",
    )
    add(
        "--stream-kv-transfer-params",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.stream_kv_transfer_params,
        help="a stream's final chunk carries kv_transfer_params (vLLM PR 40186; 0.32 streams carry none)",
    )
    add(
        "--kv-load-failure-policy",
        choices=KV_LOAD_FAILURE_POLICIES,
        default=_DEFAULTS.kv_load_failure_policy,
        help="on a failed pull: fail the request or recompute",
    )
    add(
        "--chat-prompt-token-ids",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.chat_prompt_token_ids,
        help="take a chat request's kv_transfer_params.prompt_token_ids as its prompt, as vLLM 0.32 "
        "does (--no-...: render the messages, as releases before vLLM PR 48145)",
    )


def _add_timing_flags(parser: argparse.ArgumentParser) -> None:
    """The timing model, and local prefix caching."""
    add = parser.add_argument
    add("--prefill-ms-per-token", type=finite_float, default=_DEFAULTS.prefill_ms_per_token)
    add("--decode-ms-per-token", type=finite_float, default=_DEFAULTS.decode_ms_per_token)
    add("--transfer-ms-per-block", type=finite_float, default=_DEFAULTS.transfer_ms_per_block)
    add(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="disable local prefix caching (and KV events)",
    )


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """The validated settings of parsed flags."""
    config = EmulatorConfig(
        host=args.host,
        port=args.port,
        role=args.role,
        model=args.model,
        api_key=args.api_key,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        engine_id=args.engine_id,
        side_channel_host=args.side_channel_host,
        side_channel_port=args.side_channel_port,
        kv_events_host=args.kv_events_host,
        kv_events_port=args.kv_events_port or None,
        kv_events_replay_port=args.kv_events_replay_port or None,
        kv_events_topic=args.kv_events_topic,
        bidirectional_kv_xfer=args.bidirectional_kv_xfer,
        kv_recompute_threshold=args.kv_recompute_threshold,
        decoder_kv_blocks_ttl=args.decoder_kv_blocks_ttl,
        kv_abort_timeout=args.kv_abort_timeout,
        kv_load_failure_policy=args.kv_load_failure_policy,
        chat_prompt_token_ids=args.chat_prompt_token_ids,
        enable_prefix_caching=args.enable_prefix_caching,
        prefill_ms_per_token=args.prefill_ms_per_token,
        decode_ms_per_token=args.decode_ms_per_token,
        transfer_ms_per_block=args.transfer_ms_per_block,
    )
    config.validate()
    return config


async def _run(config: EmulatorConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await serve_forever(config, stop)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run until SIGINT/SIGTERM; 0 on a clean stop, 2 on bad flags."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        parser.print_usage(sys.stderr)
        print(f"kvferry emulate: error: {exc}", file=sys.stderr)
        return 2
    if args.write_tokenizer is not None:
        try:
            print(write_tokenizer_files(Path(args.write_tokenizer), config.model, config.max_model_len))
        except OSError as exc:
            print(f"kvferry emulate: error: --write-tokenizer {args.write_tokenizer}: {exc}", file=sys.stderr)
            return 2
        return 0
    logs.configure(args.log_level)
    return run_process("emulate", _run(config), use_uvloop=False)


if __name__ == "__main__":
    raise SystemExit(main())
