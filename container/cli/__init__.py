"""The ``sagelmi`` command.

sagelmi serve  [--model-dir DIR] [--port N]   run the server (what the image runs)
sagelmi config [--model-dir DIR] [--json]     print the resolved settings and their sources
sagelmi tiny-model DIR [--arch ...]           a tiny random Llama (or T5, BERT, Idefics3) to try the engine offline
sagelmi engine-args [--write]                 vLLM's engine arguments, as the packaged list holds them
sagelmi openapi [--write]                     the OpenAPI document GET /openapi.json serves (from the installed types)
sagelmi lmi-options [--write]                 LMI's option names and what sagelmi does with each (docs/lmi_options.md)
sagelmi vllm-surface                          check that the installed vLLM has every vLLM name sagelmi uses
sagelmi ray-node [--model-dir DIR]            this node's part of the cluster's Ray cluster, until stopped
sagelmi plan [--model-dir DIR | --model-id ID] [--instance TYPE | --gpus N --gpu-memory GIB] [--json] [NAME=VALUE ...]
                                              size a deployment before paying for it (container/core/plan.py)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import sys
from pathlib import Path

from container.cli import plan as plan_cli
from container.cli import ray_node as ray_node_cli
from container.core import logs
from container.core.artifacts import ArtifactError
from container.core.devices import discover_devices, plan_groups
from container.core.engine_args import EngineOptionError, check_engine_options
from container.core.handler_choice import describe_handler, missing_model, mpirun_groups
from container.core.plan import PlanError
from container.core.settings import (
    DEFAULT_MODEL_DIR,
    SettingsError,
    describe_settings,
    reference_table,
    resolve_settings,
)

log = logging.getLogger("sagelmi")


def _version() -> str:
    try:
        return importlib.metadata.version("sagelmi")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sagelmi", description="SageMaker-compatible LLM serving")
    parser.add_argument("--version", action="version", version=f"sagelmi {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the model server (the container's command)")
    serve.add_argument(
        "--model-dir",
        default=DEFAULT_MODEL_DIR,
        help=f"model directory with serving.properties / model.py (default {DEFAULT_MODEL_DIR})",
    )
    serve.add_argument("--port", type=int, default=None, help="HTTP port (default: SAGEMAKER_BIND_TO_PORT, else 8080)")

    config = sub.add_parser("config", help="print the resolved settings and where each value came from")
    config.add_argument("--model-dir", default=DEFAULT_MODEL_DIR, help="model directory to read")
    config.add_argument("--json", action="store_true", help="print JSON instead of a table")
    config.add_argument(
        "--reference", action="store_true", help="print the reference of every setting (Markdown) instead"
    )
    tiny = sub.add_parser("tiny-model", help="write a tiny random-weight Llama (no download) to try the engine")
    tiny.add_argument("directory", help="where to write it")
    tiny.add_argument("--max-model-len", type=int, default=1024, help="context length (default 1024)")
    tiny.add_argument(
        "--arch",
        choices=("llama", "t5", "bert", "idefics3"),
        default="llama",
        help="llama (default: vLLM and text-generation), t5 (text2text-generation) or bert "
        "(classification, fill-mask, embeddings), the two for the Accelerate engine, or idefics3 "
        "(vision-language, for vLLM: images in chat messages)",
    )
    tiny.add_argument(
        "--special-token",
        action="append",
        default=[],
        metavar="TOKEN",
        help="llama: one more special token in the vocabulary, e.g. <think> for a reasoning parser (repeatable)",
    )
    engine_args = sub.add_parser(
        "engine-args",
        help="print the list of vLLM engine arguments built from the "
        "installed vLLM (what container/core/vllm_engine_args.json holds)",
    )
    engine_args.add_argument("--write", action="store_true", help="write it to container/core/vllm_engine_args.json")
    openapi = sub.add_parser(
        "openapi",
        help="print the OpenAPI document built from the request types "
        "(vLLM's included), as container/frontend/openapi.json holds it",
    )
    openapi.add_argument("--write", action="store_true", help="write it to container/frontend/openapi.json")
    lmi_options = sub.add_parser(
        "lmi-options",
        help="print the page of LMI's option names and what sagelmi does with each, from "
        "container/core/lmi_options.json, as docs/lmi_options.md holds it",
    )
    lmi_options.add_argument("--write", action="store_true", help="write it to docs/lmi_options.md")
    sub.add_parser(
        "vllm-surface",
        help="check that the installed vLLM has every vLLM name sagelmi uses (container/core/vllm_surface.py); "
        "exit 1 naming those it lacks",
    )
    plan_cli.add_parser(sub)
    ray_node_cli.add_parser(sub)
    return parser


def _engine_args(write: bool) -> int:
    from container.cli.engine_args import engine_arg_list
    from container.core.engine_arg_list import ENGINE_ARGS_FILE

    listing = engine_arg_list()
    # One argument a line, so that a vLLM upgrade shows as a readable diff.
    rows = ",\n".join(f"  {json.dumps(name)}: {json.dumps(kind)}" for name, kind in listing["engine_args"].items())
    text = f'{{\n "vllm_version": {json.dumps(listing["vllm_version"])},\n "engine_args": {{\n{rows}\n }}\n}}\n'
    return _emit(text, ENGINE_ARGS_FILE, write)


def _vllm_surface() -> int:
    from container.core.known_bad import installed_vllm
    from container.core.vllm_surface import SURFACE, WRITTEN_FOR, missing

    lacking = missing()
    uses = {symbol.name: symbol.use for symbol in SURFACE}
    for name in lacking:
        print(f"missing: {name} ({uses[name]})")
    build = " ".join(installed_vllm() or ("no vLLM",))
    print(
        f"{len(SURFACE) - len(lacking)} of the {len(SURFACE)} vLLM names sagelmi uses are in the installed {build} "
        f"(the list is written for vLLM {WRITTEN_FOR}.x)"
    )
    return 1 if lacking else 0


def _emit(text: str, path: Path, write: bool) -> int:
    """A generated file: written to ``path`` (its name printed) with --write, else printed."""
    if write:
        path.write_text(text)
        print(path)
    else:
        print(text, end="")
    return 0


def _openapi(write: bool) -> int:
    from container.cli import openapi
    from container.frontend.openapi import DOCUMENT_FILE

    return _emit(openapi.render(openapi.build()), DOCUMENT_FILE, write)


# docs/ is in the source tree only: --write is for a checkout
LMI_OPTIONS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "lmi_options.md"


def _lmi_options(write: bool) -> int:
    from container.core.lmi_options import reference_page

    return _emit(reference_page(), LMI_OPTIONS_PAGE, write)


def _print_config(settings, as_json: bool) -> None:
    rows = describe_settings(settings)
    if as_json:
        print(json.dumps({key: {"value": value, "source": source} for key, value, source in rows}, indent=2))
        return
    width = max(len(key) for key, _, _ in rows)
    vwidth = min(40, max(len(value) for _, value, _ in rows))
    print(f"{'setting':<{width}}  {'value':<{vwidth}}  source")
    for key, value, source in rows:
        print(f"{key:<{width}}  {value:<{vwidth}}  {source}")
    print()
    print(f"handler: {describe_handler(settings, Path(settings.model_dir))}")
    print(f"worker groups: {_describe_groups(settings)}")


def _describe_groups(settings) -> str:
    """The worker groups ``serve`` would start here; a layout that cannot start is warned about."""
    devices = discover_devices(settings)
    try:
        plans = plan_groups(settings, devices)
    except SettingsError as exc:
        log.warning("serve would stop: %s", exc)
        return f"none ({exc})"
    first = plans[0]
    where = "on the CPU" if not devices else f"on {len(devices)} visible device(s) ({','.join(devices)})"
    per = f"tp {first.tensor_parallel_degree} x pp {first.pipeline_parallel_degree}"
    kind = "MPI ranks" if mpirun_groups(settings) else "processes" if first.world_size > 1 else "process"
    groups = "; ".join(f"{p.index}: {p.cuda_visible_devices or 'cpu'}" for p in plans)
    return f"{len(plans)} {where}, {first.world_size} {kind} each ({per}): {groups}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logs.configure("serve")
    if getattr(args, "reference", False):
        print(reference_table())
        return 0
    if args.command == "tiny-model":
        from container.tools.tiny_model import WRITERS

        if args.special_token and args.arch != "llama":
            log.error("--special-token applies to the llama tiny model")
            return 2
        extra = {"extra_tokens": tuple(args.special_token)} if args.special_token else {}
        print(WRITERS[args.arch](args.directory, args.max_model_len, **extra))
        return 0
    if args.command == "engine-args":
        return _engine_args(args.write)
    if args.command == "openapi":
        return _openapi(args.write)
    if args.command == "lmi-options":
        return _lmi_options(args.write)
    if args.command == "vllm-surface":
        return _vllm_surface()
    if args.command == "plan":
        try:
            return plan_cli.run(args)
        except (PlanError, SettingsError, ArtifactError) as exc:
            log.error("%s", exc)
            return 2
    try:
        settings = resolve_settings(os.environ, args.model_dir, port=getattr(args, "port", None))
        if args.command == "ray-node":  # Ray alone: no engine, so no engine option to check
            return ray_node_cli.run(settings)
        missing = missing_model(settings) if args.command == "serve" else None
        if missing is not None:
            raise SettingsError(missing)
        # before the supervisor starts, installs requirements.txt or downloads anything
        check_engine_options(settings, Path(settings.model_dir))
    except (SettingsError, EngineOptionError) as exc:
        log.error("%s", exc)
        return 2
    if args.command == "config":
        _print_config(settings, args.json)
        return 0
    logs.configure("serve", settings.log_level, settings.log_format)
    for key, value, source in describe_settings(settings):
        if source != "default":
            log.info("setting %s=%s (%s)", key, value, source)
    from container.supervisor import serve  # keeps `sagelmi config` light

    return serve(settings)


def run(argv: list[str] | None = None) -> int:
    """``main``, for a shell: output cut short by a closed pipe (``sagelmi config | head -1``)
    ends the command quietly, as other command-line tools do."""
    try:
        code = main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit would fail again
        return 0


if __name__ == "__main__":
    sys.exit(run())
