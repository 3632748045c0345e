"""The `loraplex` command: manage the base model and start the server."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from app.model_store import ModelStoreError, pull_default_model, resolve_model
from app.settings import Settings

logger = logging.getLogger(__name__)

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LOG_DATE_FORMAT = "%H:%M:%S"
# Exit status of a command interrupted with Ctrl-C, as shells report it (128 + SIGINT).
_EXIT_INTERRUPTED = 130

Handler = Callable[[argparse.Namespace, Settings], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `loraplex` command and return its exit status."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT, datefmt=_LOG_DATE_FORMAT, stream=sys.stderr)
    settings = Settings.from_env()
    handler: Handler = args.handler
    try:
        return handler(args, settings)
    except ModelStoreError as exc:
        print(f"loraplex: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("loraplex: interrupted", file=sys.stderr)
        return _EXIT_INTERRUPTED


def _models_pull(args: argparse.Namespace, settings: Settings) -> int:
    print(pull_default_model(settings.home, force=args.force))
    return 0


def _models_path(args: argparse.Namespace, settings: Settings) -> int:
    print(resolve_model(settings.model, settings.home))
    return 0


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    # Imported here: the engine (and torch) load only for commands that run it.
    from app.demo import run_demo
    from engine.errors import EngineError

    try:
        run_demo(settings)
    except EngineError as exc:
        print(f"loraplex: {exc}", file=sys.stderr)
        return 1
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraplex",
        description="A multi-tenant multi-LoRA gateway: one base model, many tenants' adapters.",
        epilog="Environment: LORAPLEX_HOME (data folder), LORAPLEX_MODEL ('default' or a model folder).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    models = commands.add_parser("models", help="manage the base model")
    model_commands = models.add_subparsers(dest="models_command", required=True, metavar="COMMAND")
    pull = model_commands.add_parser(
        "pull", help="download and convert the default model into the data folder; print its folder"
    )
    pull.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    pull.set_defaults(handler=_models_pull)
    path = model_commands.add_parser(
        "path", help="print the folder of the configured model (pulling the default one if needed)"
    )
    path.set_defaults(handler=_models_path)

    serve = commands.add_parser("serve", help="start the server")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    serve.set_defaults(handler=_serve)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
