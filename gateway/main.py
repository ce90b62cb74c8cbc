"""`kvpool-gateway`: serve kvpoold's model through an OpenAI-compatible HTTP API (Starlette on Uvicorn)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .settings import GatewayConfig, GatewayConfigError, default_state_file


def parse_args(argv: Sequence[str] | None) -> GatewayConfig:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="kvpool-gateway", description=__doc__)
    ap.add_argument("--host", default=env("KVPOOL_GATEWAY_HOST", "127.0.0.1"), help="address to listen on")
    ap.add_argument("--port", type=int, default=int(env("KVPOOL_GATEWAY_PORT", "8080")))
    ap.add_argument("--daemon", default=None, help="kvpoold's address (default: $KVPOOL_ADDRESS, else its default)")
    ap.add_argument("--api-key", default=env("KVPOOL_GATEWAY_API_KEY", ""), help="required as Authorization: Bearer")
    ap.add_argument("--health-check", default="/health", help="path of the health check")
    ap.add_argument("--log-file", default="", help="also log to this file")
    ap.add_argument("--state-file", default=None, help="where conversations are mapped to sessions")
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each answer from kvpoold")
    ap.add_argument(
        "--resume-wait",
        type=float,
        default=30.0,
        help="seconds an answer cut short (a daemon restart) waits to be continued; 0: the caller gets the error",
    )
    ap.add_argument(
        "--no-reuse", action="store_true", help="run every request on a fresh session (nothing kept between turns)"
    )
    ap.add_argument(
        "--no-tool-result-prefill",
        action="store_true",
        help="do not compute the opening of a tool call's result while the tool runs (docs/gateway.md)",
    )
    ap.add_argument(
        "--chat-template",
        default="auto",
        help="auto (the GGUF's own; a transcript for a GGUF without one), gemma3, chatml, transcript, or a .jinja file",
    )
    ap.add_argument(
        "--curve-server-key",
        default=env("KVPOOL_CURVE_SERVER_KEY", ""),
        metavar="FILE",
        help="a tcp:// daemon's public key file (with --curve-client-key)",
    )
    ap.add_argument(
        "--curve-client-key",
        default=env("KVPOOL_CURVE_CLIENT_KEY", ""),
        metavar="FILE",
        help="this gateway's secret key file, listed in the daemon's curve_clients_dir",
    )
    ap.add_argument(
        "--max-inflight",
        type=int,
        default=0,
        help="generations dispatched to kvpoold at once (default: what it allows this gateway, at most half its "
        "max_sessions); more requests wait in the gateway's queue",
    )
    ap.add_argument("--queue-size", type=int, default=512, help="requests that may wait (429 with Retry-After beyond)")
    ap.add_argument(
        "--queue-per-key",
        type=int,
        default=0,
        help="requests one client (its `user`, else its address) may have waiting (0: no limit)",
    )
    ap.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another name /v1/models lists for the model (repeatable)",
    )
    args = ap.parse_args(argv)
    return GatewayConfig(
        host=args.host,
        port=args.port,
        daemon=args.daemon,
        api_key=args.api_key,
        health_path=args.health_check,
        log_file=args.log_file,
        state_file=Path(args.state_file) if args.state_file else default_state_file(),
        max_body_bytes=args.max_body_bytes,
        timeout=args.timeout,
        resume_wait=args.resume_wait,
        chat_template=args.chat_template,
        reuse=not args.no_reuse,
        prefill_tool_results=not args.no_tool_result_prefill,
        curve_server_key=args.curve_server_key,
        curve_client_key=args.curve_client_key,
        max_inflight=args.max_inflight,
        queue_size=args.queue_size,
        queue_per_key=args.queue_per_key,
        aliases=tuple(args.alias),
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        config.check()
        import uvicorn

        from .app import build_app
    except GatewayConfigError as exc:
        print(f"kvpool-gateway: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"kvpool-gateway: {exc.name} is missing: pip install 'kvpool[gateway]'.", file=sys.stderr)
        return 2
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if config.log_file:
        handlers.append(logging.FileHandler(config.log_file))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=handlers)
    logging.getLogger("kvpool.gateway").info("serving kvpoold through http://%s:%d/v1", config.host, config.port)
    uvicorn.run(build_app(config), host=config.host, port=config.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
