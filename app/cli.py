"""The `strata` command line: `generate`, `serve`, `bench`, `autoconfig`, `stage`, and alone (`launch`) the
server with the settings saved for this machine."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from app.engine.config import (
    PARK_DISK,
    PARK_MEMORY,
    STREAMED_WINDOW_TOKENS,
    WINDOW_TOKENS,
    EngineConfig,
    default_park_dir,
)
from app.engine.protocol import MAX_SPEC_TOKENS
from app.errors import StrataError
from app.models.placement import PLACEMENTS

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _size(text: str) -> int:
    """Bytes from '2GiB', '512MiB', '1.5G' or a plain number."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB or 512MiB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _groups(text: str) -> int | None:
    """`--batch-groups`: auto (None) or a count."""
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected auto or a number of groups, got {text!r}")
    return int(text)


def _numbers(what: str) -> Callable[[str], tuple[int, ...]]:
    """A comma-separated list of `what` (`--remote-stages` 1 or 2,3; `--stage-gpus` 0,1 or 0,0)."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            numbers = tuple(int(n) for n in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} such as 1 or 2,3, got {text!r}") from None
        if any(n < 0 for n in numbers):
            raise argparse.ArgumentTypeError(f"expected {what} of 0 or more, got {text!r}")
        return numbers

    return parse


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument(
        "--model", help="HF model directory or GGUF file (default: the built-in demo model strata-demo)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    parser.add_argument(
        "--dtype",
        default=defaults.dtype,
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weight dtype (auto: the checkpoint's)",
    )
    parser.add_argument("--parallel", type=int, default=defaults.parallel, help="batch slots")
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=defaults.max_batched_tokens,
        help=f"token budget of a window (default {WINDOW_TOKENS}; {STREAMED_WINDOW_TOKENS} where an expert "
        "tier copies host experts over PCIe)",
    )
    parser.add_argument("--kv-memory", type=_size, default=defaults.kv_memory, help="KV pool size, e.g. 2GiB")
    parser.add_argument(
        "--kv-dtype",
        choices=("auto", "bf16", "fp8", "int8"),
        default=defaults.kv_dtype,
        help="how keys and values are kept: auto (the activations' dtype), bf16, or 8 bits a value with a "
        "scale per token and head (fp8 e4m3, int8): about half the bytes of bf16, so twice the context",
    )
    parser.add_argument(
        "--kv-resident",
        type=int,
        default=defaults.kv_resident,
        metavar="TOKENS",
        help="tokens of the KV pool (--kv-memory) kept on the device; the rest lives in host RAM and is "
        "streamed in for attention layer by layer (default: the whole pool on the device)",
    )
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per KV block")
    parser.add_argument(
        "--decode-share",
        type=float,
        default=defaults.decode_share,
        help="share of solo speed a decoding slot keeps while prompts are read (docs/BATCHING.md)",
    )
    parser.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    parser.add_argument(
        "--backend",
        default=defaults.backend,
        help="compute backends (auto, triton, torch, cpu; auto: triton on CUDA, cpu on a CPU)",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="fixed kernel tiles for every window size, dense projections included (docs/KERNELS.md)",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs: every window runs eagerly"
    )
    parser.add_argument(
        "--expert-cache",
        type=int,
        metavar="N",
        help="experts of each MoE layer kept on the device; the rest live in host RAM, and each window's "
        "misses run on the CPU or are copied over PCIe, as this machine's measured costs say "
        "(default: all on the device)",
    )
    parser.add_argument(
        "--expert-vram",
        type=_size,
        metavar="SIZE",
        help="instead of --expert-cache: as many experts of each MoE layer on the device as SIZE "
        "(e.g. 10GiB) holds in the weights' dtype",
    )
    parser.add_argument(
        "--expert-placement",
        choices=PLACEMENTS,
        default=defaults.expert_placement,
        help="with --expert-cache or --expert-vram: spread keeps the same number of experts on the device "
        "in every layer (best where routing favours some experts); layers fills whole layers with that "
        "budget and leaves the others in host RAM (best where routing is even: fewer layers stop for misses)",
    )
    parser.add_argument(
        "--adapt-async",
        action="store_true",
        help="with --expert-cache: copy the experts that move onto the device on a side stream while windows "
        "run, into a few spare slots a layer, instead of before the next window",
    )
    parser.add_argument(
        "--pcie-frac",
        type=float,
        metavar="F",
        help="with --expert-cache on a GPU: send this share (0..1) of each window's missed experts over "
        "PCIe, the rest to the CPU, instead of the measured costs' split (for experiments)",
    )
    parser.add_argument(
        "--adapt-every",
        type=int,
        default=defaults.adapt_every,
        metavar="N",
        help="with --expert-cache: every N windows the most routed experts move onto the device (0: frozen)",
    )
    parser.add_argument(
        "--layer-split",
        metavar="SPEC",
        help="cut the model's layers into stages, one process and GPU each (over torch.distributed; on a "
        "CPU, processes of this machine): auto (as few GPUs as hold the weights), a stage count, or each "
        "stage's layers, e.g. 20,28 (default: the whole model in one process)",
    )
    parser.add_argument(
        "--batch-groups",
        type=_groups,
        metavar="auto|G",
        help="with --layer-split: the slots form G groups that take turns down the stages, so that each "
        "stage runs another group's window (auto: one group per stage on GPUs, one on a CPU)",
    )
    parser.add_argument(
        "--split-rendezvous",
        metavar="tcp://HOST:PORT",
        help="with --layer-split: where the stages meet (this engine listens there), so that stages of "
        "--remote-stages can join from other hosts with `strata stage` (default: a file on this host)",
    )
    parser.add_argument(
        "--remote-stages",
        type=_numbers("stage numbers"),
        default=(),
        metavar="K,...",
        help="with --layer-split and --split-rendezvous: the stages started elsewhere (`strata stage`), "
        "not by this engine",
    )
    parser.add_argument(
        "--stage-gpus",
        type=_numbers("GPU numbers"),
        default=(),
        metavar="G,...",
        help="with --layer-split on GPUs: each stage's GPU, stage 0's first and GPU 0 (default: stage k on "
        "GPU k); stages may share a card, e.g. 0,0, their tensors then going through host memory",
    )
    parser.add_argument(
        "--spec",
        choices=("off", "ngram", "mtp"),
        default=defaults.spec,
        help="draft tokens for decoding requests, verified in their window: ngram guesses them from the "
        "conversation's own earlier tokens, mtp with the model's multi-token-prediction head (greedy and "
        "seeded outputs stay the same; docs/BATCHING.md)",
    )
    parser.add_argument(
        "--spec-tokens",
        type=int,
        default=defaults.spec_tokens,
        metavar="K",
        help="with --spec: the most draft tokens a request adds to a window",
    )
    parser.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="plan each window only after the one before has run (no host work hidden behind the device's)",
    )
    parser.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="read every prompt from its start (no KV blocks or recurrent states reused across requests)",
    )
    parser.add_argument(
        "--park-memory",
        type=_size,
        default=PARK_MEMORY,
        help="host RAM for finished conversations awaiting a follow-up, e.g. 4GiB (0: none)",
    )
    parser.add_argument(
        "--park-dir",
        type=Path,
        default=default_park_dir(),
        help="where parked conversations are kept across restarts (default: the user cache directory)",
    )
    parser.add_argument(
        "--park-disk",
        type=_size,
        default=PARK_DISK,
        help="disk budget of --park-dir, e.g. 20GiB (0: no files)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine options describe; bad values end as a one-line error."""
    checks = [
        (args.parallel >= 1, "--parallel must be at least 1"),
        (
            args.max_batched_tokens is None or args.max_batched_tokens >= 1,
            "--max-batched-tokens must be at least 1",
        ),
        (args.block_size >= 1, "--block-size must be at least 1"),
        (0 < args.decode_share <= 1, "--decode-share must be in (0, 1]"),
        (args.pcie_frac is None or 0 <= args.pcie_frac <= 1, "--pcie-frac must be in [0, 1]"),
        (args.max_model_len is None or args.max_model_len >= 1, "--max-model-len must be at least 1"),
        (1 <= args.spec_tokens <= MAX_SPEC_TOKENS, f"--spec-tokens must be 1 to {MAX_SPEC_TOKENS}"),
    ]
    for ok, message in checks:
        if not ok:
            raise StrataError(message)
    return EngineConfig(
        model=args.model,
        device=args.device or "auto",
        dtype=args.dtype,
        parallel=args.parallel,
        max_batched_tokens=args.max_batched_tokens,
        kv_memory=args.kv_memory,
        kv_dtype=args.kv_dtype,
        kv_resident=args.kv_resident,
        block_size=args.block_size,
        decode_share=args.decode_share,
        max_model_len=args.max_model_len,
        backend=args.backend,
        exact=args.exact,
        enforce_eager=args.enforce_eager,
        overlap=args.overlap,
        expert_cache=args.expert_cache,
        expert_vram=args.expert_vram,
        expert_placement=args.expert_placement,
        adapt_every=args.adapt_every,
        pcie_frac=args.pcie_frac,
        adapt_async=args.adapt_async,
        layer_split=args.layer_split,
        batch_groups=args.batch_groups,
        split_rendezvous=args.split_rendezvous,
        remote_stages=args.remote_stages,
        stage_gpus=args.stage_gpus,
        spec=args.spec,
        spec_tokens=args.spec_tokens,
        prefix_cache=args.prefix_cache,
        park_memory=args.park_memory,
        park_dir=str(args.park_dir),
        park_disk=args.park_disk,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="strata", description="Serve Mixture-of-Experts language models.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from a prompt")
    _add_engine_options(gen)
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (default: 'Hello')")
    prompt.add_argument("--prompt-token-ids", type=_token_ids, help="prompt as token ids, e.g. 1,2,3")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 turns it off")
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON object with token_ids and text")

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    _add_engine_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    key = serve.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on the API and /metrics")
    key.add_argument("--api-key-file", help="read the API key from this file")
    serve.add_argument("--served-model-name", help="the model id clients send (default: the directory name)")
    serve.add_argument(
        "--metrics-per-expert",
        action="store_true",
        help="/metrics also has a series per (MoE layer, expert): where it lives, its share of the routing",
    )

    bench = commands.add_parser("bench", help="measure concurrent requests offline (no HTTP)")
    _add_engine_options(bench)
    bench.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[4],
        help="requests at once; several values run one after the other on one engine, a JSON line each",
    )
    bench.add_argument("--prompt-len", type=int, default=512)
    bench.add_argument("--output-len", type=int, default=64)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="every request's output follows this JSON schema (JSON text), as with response_format",
    )
    bench.add_argument(
        "--follow-up",
        action="store_true",
        help="time a follow-up turn of a --prompt-len conversation: cached, restored from disk, read again",
    )
    launch = commands.add_parser(
        "launch",
        help="what `strata` alone runs: serve with the settings saved for this machine (chosen by autoconfig "
        "and saved on the first launch), then open the chat in the browser; later flags override them",
    )
    launch.add_argument("flags", nargs="*", help="`strata serve` flags over the saved ones")
    commands.add_parser(
        "install-launcher", help="put `strata` (alone: serve and open the chat) in the desktop's menu (Linux)"
    )
    auto = commands.add_parser(
        "autoconfig", help="print the settings this machine suits for a model, and why (app/autoconfig.py)"
    )
    auto.add_argument("--model", help="an HF model directory or a .gguf file (default: the demo model)")
    auto.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the weights' dtype (bfloat16)"
    )
    auto.add_argument(
        "--calibrate",
        action="store_true",
        help="time the choice and its neighbours with every slot busy (an engine started for each) and keep "
        "the fastest",
    )
    auto.add_argument(
        "--save", action="store_true", help="write the settings to the file `strata` alone reads"
    )
    stage = commands.add_parser(
        "stage", help="run one stage of an engine's layer split on this host (--remote-stages)"
    )
    stage.add_argument("--rendezvous", required=True, metavar="tcp://HOST:PORT", help="the engine's address")
    stage.add_argument("--stage", type=int, required=True, help="which stage this is (1 or more)")
    stage.add_argument("--stages", type=int, required=True, help="how many stages the split has")
    stage.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if _has_cuda() else "cpu")
    stage.add_argument("--gpu", type=int, default=0, help="which GPU of this host (with --device cuda)")
    stage.add_argument("--model", help="where this host keeps the model (default: the engine's path)")
    return parser


def run_autoconfig(args: argparse.Namespace) -> None:
    """Print the machine, the settings `app.autoconfig.choose` picks for the model with the reason for each,
    and the `strata serve` command that uses them; with --calibrate the fastest of the candidates timed on
    this machine (app/calibrate.py); with --save also write them to the settings file."""
    from app.autoconfig import for_model
    from app.default_model import default_model_dir

    model = args.model or str(default_model_dir())
    machine, settings = for_model(model, args.dtype)
    print(f"machine: {machine.describe()}")
    if args.calibrate:
        from app.calibrate import bench_measure, calibrate

        print("timing the candidates with every slot busy:", flush=True)
        settings = calibrate(settings, bench_measure(model))
    for reason in settings.reasons:
        print(f"- {reason}")
    print(" ".join(["strata serve --model", model, *settings.flags()]))
    if args.save:
        from app.launch import settings_path, write_settings

        write_settings(settings_path(), model, settings)


def run_launch(args: argparse.Namespace) -> None:
    """`strata` alone: the settings saved for this machine (autoconfig's for the default model on the first
    launch, written to the settings file then), any flags given over them, `strata serve` with them, and the
    chat opened in the browser once the server answers (not with STRATA_NO_BROWSER=1)."""
    from app.launch import browser_when_ready, saved_flags

    flags = saved_flags()
    serve = build_parser().parse_args(["serve", *flags, *args.flags])
    if os.environ.get("STRATA_NO_BROWSER") != "1":
        browser_when_ready(serve.host, serve.port)
    run_serve(serve)


def run_install_launcher(args: argparse.Namespace) -> None:
    """`strata install-launcher`: write the desktop entry and say where."""
    from app.launch import install_launcher

    print(f"strata: the desktop's menu now has Strata ({install_launcher()})")


def _has_cuda() -> bool:
    """Whether this host has an NVIDIA GPU (without importing torch for --help)."""
    return Path("/proc/driver/nvidia/gpus").exists()


def run_stage(args: argparse.Namespace) -> None:
    """`strata stage`: join an engine's layer split as one of its stages, until the engine stops."""
    from app.engine.stage_worker import run_stage as serve_stage

    if not 1 <= args.stage < args.stages:
        raise StrataError(f"--stage must be 1 to {args.stages - 1} (stage 0 is the engine)")
    gpu = args.gpu if args.device == "cuda" else None
    serve_stage(args.stage, args.stages, args.rendezvous, gpu, args.model)


def run_generate(args: argparse.Namespace) -> None:
    """`strata generate`: start the engine, read the prompt, print the continuation."""
    from app.default_model import default_model_dir
    from app.engine.client import EngineClient
    from app.engine.protocol import SamplingParams
    from app.text.tokenizer import Tokenizer

    if args.chat and args.prompt_token_ids is not None:
        raise StrataError("--chat takes --prompt text, not --prompt-token-ids")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    params.validate()
    config = engine_config(args)
    with EngineClient.start(config) as client:
        tokenizer = Tokenizer.load(args.model or default_model_dir())
        if args.prompt_token_ids is not None:
            prompt = args.prompt_token_ids
        elif args.chat:
            prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt or "Hello"}])
        else:
            prompt = tokenizer.encode(args.prompt or "Hello")
        done = client.generate(prompt, params)
    if args.json:
        print(json.dumps({"token_ids": done.token_ids, "text": done.text}, ensure_ascii=False))
    else:
        print(done.text)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning `serve` prints when it binds beyond this machine without an API key, else None."""
    import ipaddress

    if api_key or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: it may resolve anywhere
        pass
    return (
        f"strata: warning: serving on {host} without --api-key: anyone who can reach this address can use "
        "the model, read /metrics and the Monitor"
    )


def run_serve(args: argparse.Namespace) -> None:
    """`strata serve`: start the engine and the web server; Ctrl+C stops both."""
    from pathlib import Path

    import uvicorn

    from webui.app import create_app
    from webui.settings import ServerSettings

    api_key = args.api_key
    if args.api_key_file:
        try:
            api_key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise StrataError(f"cannot read --api-key-file {args.api_key_file}: {e.strerror}") from None
        if not api_key:
            raise StrataError(f"--api-key-file {args.api_key_file} is empty")
    if not 0 < args.port < 65536:
        raise StrataError("--port must be in 1..65535")
    warning = exposure_warning(args.host, api_key)
    if warning:
        print(warning, file=sys.stderr)
    settings = ServerSettings(
        engine=engine_config(args),
        host=args.host,
        port=args.port,
        api_key=api_key,
        model_name=args.served_model_name,
        metrics_per_expert=args.metrics_per_expert,
    )
    failures: list[str] = []

    def failed(message: str) -> None:
        failures.append(message)
        server.should_exit = True

    app = create_app(settings, announce=True, on_failed=failed)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    server.run()
    if failures:
        raise StrataError(failures[0])
    if not server.started:
        raise StrataError(f"the server did not start on {args.host}:{args.port} (see the messages above)")


def run_bench(args: argparse.Namespace) -> None:
    """`strata bench`: print the JSON summary of a synthetic concurrent run."""
    from app.bench import run_benches, run_follow_up

    if min(args.concurrency) < 1 or args.prompt_len < 1 or args.output_len < 1:
        raise StrataError("--concurrency, --prompt-len and --output-len must be at least 1")
    if args.follow_up:
        print(json.dumps(run_follow_up(engine_config(args), args.prompt_len, args.output_len, args.seed)))
    else:
        grammar = None
        if args.json_schema is not None:
            from app.engine.grammar_source import check_grammar
            from app.engine.protocol import Grammar, InvalidRequest

            grammar = Grammar("json_schema", args.json_schema, "--json-schema")
            try:
                check_grammar(grammar)
            except InvalidRequest as e:
                raise StrataError(str(e)) from None
        config = engine_config(args)
        for summary in run_benches(
            config, args.concurrency, args.prompt_len, args.output_len, args.seed, grammar
        ):
            print(json.dumps(summary), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `strata` console script; errors end as one line on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] == "launch" and not {"-h", "--help"} & set(argv)):
        args = argparse.Namespace(command="launch", flags=argv[1:])  # the flags are `strata serve`'s
    else:
        args = build_parser().parse_args(argv)
    try:
        commands = {
            "generate": run_generate,
            "serve": run_serve,
            "bench": run_bench,
            "stage": run_stage,
            "autoconfig": run_autoconfig,
            "launch": run_launch,
            "install-launcher": run_install_launcher,
        }
        commands[args.command](args)
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
