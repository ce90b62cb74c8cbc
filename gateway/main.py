"""`kvpool-gateway`: serve kvpoold's model through an OpenAI-compatible HTTP API (Starlette on Uvicorn)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvpool.client.flags import add_flags, given

from .settings import GatewayConfig, GatewayConfigError, default_state_file


def parse_args(argv: Sequence[str] | None) -> GatewayConfig:
    ap = argparse.ArgumentParser(prog="kvpool-gateway", description=__doc__)
    names = add_flags(ap, GatewayConfig)
    settings = given(ap.parse_args(argv), names)
    settings["aliases"] = tuple(settings.get("aliases", ()))
    settings.setdefault("state_file", default_state_file())
    return GatewayConfig(**settings)


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
