"""The ``rollout`` command line: generate, demo and benchmarks."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model-path", required=True, help="Hugging Face model folder (config.json + *.safetensors)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight/activation dtype (auto: the checkpoint's; float16 -> bfloat16 on CPU)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests that bring none")
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool size in tokens (default: from memory)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences per batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=4096, help="tokens per forward (chunked prefill)")
    g.add_argument("--logprob-mode", default="processed", choices=["processed", "raw"],
                   help="processed: logprob under the distribution sampled from; raw: log-softmax of raw logits")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--min-new-tokens", type=int, default=0, help="EOS/stop tokens are masked before this many")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: generation_config or 1)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, (0, 1]")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (-1: off)")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the top probability")
    g.add_argument("--n", type=int, default=1, help="samples per prompt (sharing one prefill)")
    g.add_argument("--sample-seed", type=int, default=None, help="request seed (sample i uses seed + i)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=None, help="stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    g.add_argument("--repetition-penalty", type=float, default=None, help="Hugging Face style, over prompt+output")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI style, over the output")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI style, over the output")
    g.add_argument("--top-logprobs", type=int, default=0, help="also print the k most likely tokens per step")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per completion")


def _cmd_generate(args) -> int:
    from rollout import RolloutEngine, SamplingParams

    sp = SamplingParams(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
                        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, n=args.n,
                        seed=args.sample_seed, stop=args.stop, stop_token_ids=args.stop_token_id,
                        ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty,
                        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty)
    with RolloutEngine(args.model_path, dtype=args.dtype, device=args.device, seed=args.seed,
                       kv_cache_tokens=args.kv_cache_tokens, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, logprob_mode=args.logprob_mode) as engine:
        if args.chat:
            ids = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompt]
            outs = engine.generate(input_ids=ids, sampling_params=sp, top_logprobs_num=args.top_logprobs)
        else:
            outs = engine.generate(prompts=args.prompt, sampling_params=sp, top_logprobs_num=args.top_logprobs)
        for o in outs:
            if args.json:
                print(json.dumps({"prompt_index": o.prompt_index, "sample_index": o.sample_index, "text": o.text,
                                  "output_token_ids": o.output_token_ids, "output_logprobs": o.output_logprobs,
                                  "output_top_logprobs": o.output_top_logprobs, "finish_reason": o.finish_reason,
                                  "weight_version": o.weight_version}))
                continue
            print(f"--- prompt {o.prompt_index} sample {o.sample_index} ({o.finish_reason}, "
                  f"{len(o.output_token_ids)} tokens, sum logprob {sum(o.output_logprobs):.3f})")
            print(repr(o.text))
            pieces = [f"{t}:{lp:.3f}" for t, lp in zip(o.output_token_ids, o.output_logprobs)]
            print("tokens:logprobs ", " ".join(pieces))
    return 0


def _engine_option_flags(p: argparse.ArgumentParser) -> None:
    """Every ``EngineConfig`` option as a flag (``--max-num-seqs``, ``--enable-overlap`` / ``--no-...``); a
    group's options by their flat names (``--max-loaded-loras``, ``--kernel-fusion``)."""
    g = p.add_argument_group("engine (every EngineConfig option; see rollout/config.py; --request-timeout-s also "
                             "bounds each HTTP generation request, no limit when unset, as SGLang)")
    for name, where, kind, default in _engine_options():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default,
                           help=f"EngineConfig.{where} (default: {default})")
        elif kind is tuple:  # a list of names: comma-separated
            g.add_argument(flag, dest=name, type=lambda v: tuple(x for x in v.split(",") if x), default=default,
                           help=f"EngineConfig.{where}, comma-separated (default: none)")
        else:
            g.add_argument(flag, dest=name, type=kind, default=default, required=name == "model_path",
                           help=f"EngineConfig.{where}" + ("" if name == "model_path" else f" (default: {default})"))


def _engine_options() -> list[tuple[str, str, type, object]]:
    """(flag name, where it lands, type, default) of every engine option: the config's own fields, then each
    group's fields by their flat names."""
    import dataclasses
    import typing

    from rollout.config import GROUPS, EngineConfig

    def base(kind):  # Optional[X] -> X; tuple[str, ...] -> tuple
        if typing.get_origin(kind) is typing.Union:
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        return typing.get_origin(kind) or kind

    hints = typing.get_type_hints(EngineConfig)
    out = [(f.name, f.name, base(hints[f.name]), f.default) for f in dataclasses.fields(EngineConfig)
           if f.name not in GROUPS]
    for flat, (group, field_name) in EngineConfig.flat_options().items():
        cls = GROUPS[group]
        out.append((flat, f"{group}.{field_name}", base(typing.get_type_hints(cls)[field_name]),
                    cls.__dataclass_fields__[field_name].default))
    return out


def _cmd_serve(args) -> int:

    import uvicorn

    from rollout import RolloutEngine
    from rollout.server.app import ServerConfig, create_app
    from rollout.server.http import read_deadline_protocol

    options = {name: getattr(args, name) for name, *_ in _engine_options()}
    if args.enable_deterministic_inference or args.rl_on_policy_target:
        options["deterministic"] = True  # SGLang's spellings of the batch-invariant mode
    if args.stream_max_pending_mb * 2**20 < 4096:
        raise SystemExit(f"--stream-max-pending-mb {args.stream_max_pending_mb}: at least 4 KiB (0.004)")
    server = ServerConfig(api_key=args.api_key, admin_api_key=args.admin_api_key,
                          allowed_weight_dirs=args.allowed_weight_dirs or [], max_body_bytes=int(args.max_body_mb * 2**20),
                          request_timeout_s=args.request_timeout_s, served_model_name=args.served_model_name,
                          stream_stall_timeout_s=args.stream_stall_timeout_s,
                          stream_max_pending_bytes=int(args.stream_max_pending_mb * 2**20),
                          incremental_streaming_output=args.incremental_streaming_output,
                          enable_memory_saver=args.enable_memory_saver, host=args.host,
                          tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                          trust_request_chat_template=args.trust_request_chat_template,
                          tensor_handles=not args.no_tensor_handles,
                          render_timeout_s=args.render_timeout_s, max_top_logprobs_num=args.max_top_logprobs_num)
    adapters = _adapter_flags(args.lora_paths or []) + _adapter_flags(args.lora_modules or [])
    # uvicorn ends its graceful shutdown by raising the signal it caught again, under the handler that was
    # in place before it started: ours, which unwinds through the engine's ``with`` (its orderly stop: the
    # loop, the TP ranks, the buckets) instead of the default handler ending the process there
    previous = {sig: signal.signal(sig, _stop_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with RolloutEngine(options.pop("model_path"), **options) as engine:
            for name, path in adapters:  # the operator's adapters: links followed as for the model itself
                result = engine.load_lora_adapter(name, path)
                if not result.success:
                    raise SystemExit(f"--lora-paths {name}={path}: {result.message}")
            uvicorn.run(create_app(engine, server), host=args.host, port=args.port, log_level=args.log_level.lower(),
                        timeout_keep_alive=30, http=read_deadline_protocol(args.request_read_timeout_s))
    except _Stopped as stop:
        logging.getLogger("rollout.serve").info("stopped by %s: the engine is shut down", stop.name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


class _Stopped(Exception):
    """SIGTERM or SIGINT reached ``rollout serve`` outside uvicorn's own handling."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.name = signal.Signals(signum).name


def _stop_signal(signum, frame) -> None:
    raise _Stopped(signum)


def _adapter_flags(values: list[str]) -> list[tuple[str, str]]:
    """SGLang's ``--lora-paths`` / vLLM's ``--lora-modules``: ``NAME=PATH`` (or a bare PATH, named by
    its folder)."""
    out = []
    for v in values:
        name, sep, path = v.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(v)), v
        if not name or not path:
            raise SystemExit(f"--lora-paths {v!r}: give NAME=PATH")
        out.append((name, path))
    return out


def _cmd_demo(args) -> int:
    from rollout.tools.demo import main as demo_main

    return demo_main(args.rest)


BENCHMARKS = {"throughput": "rollout.bench.throughput", "weight-sync": "rollout.bench.sync",
              "rl-step": "rollout.bench.rl_step", "limits": "rollout.bench.limits",
              "server-load": "rollout.bench.server", "fidelity": "rollout.bench.fidelity",
              "soak": "rollout.bench.soak", "lora": "rollout.bench.lora", "acceptance": "rollout.bench.acceptance",
              "speculation": "rollout.bench.speculation",
              # the trainer side's (DeepSpeed ranks; the train extra)
              "push-floor": "trainer_bridge.bench.push_floor", "rl-modes": "trainer_bridge.bench.rl_modes"}


def _cmd_bench(args) -> int:
    import importlib

    if args.compare:
        from rollout.bench.common import print_compare

        print_compare(*args.compare)
        return 0
    if args.which is None:
        raise SystemExit(f"rollout bench: name a benchmark ({', '.join(BENCHMARKS)}) or --compare A.json B.json")
    importlib.import_module(BENCHMARKS[args.which]).main(args.rest)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rollout", description="rollout-worker: a rollout engine for RL training.")
    ap.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions with per-token logprobs",
                         description="Generate completions with per-token logprobs.")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    _add_engine_flags(gen)
    _add_sampling_flags(gen)
    gen.set_defaults(func=_cmd_generate)
    demo = sub.add_parser("demo", help="a rollout demo on the embedded tiny model (the RL main job is `make demo`)",
                          add_help=False)
    demo.add_argument("rest", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_cmd_demo)
    serve = sub.add_parser("serve", help="an HTTP server (SGLang and OpenAI routes) over one engine",
                           description="Serve one engine over HTTP: /generate, /v1/completions, /v1/chat/completions, "
                                       "the weight-refresh and control routes, /health, /metrics.")
    s = serve.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=30000, help="port to listen on")
    s.add_argument("--api-key", default=os.environ.get("ROLLOUT_API_KEY"),
                   help="every route but /health needs 'Authorization: Bearer KEY' (env ROLLOUT_API_KEY)")
    s.add_argument("--admin-api-key", default=os.environ.get("ROLLOUT_ADMIN_API_KEY"),
                   help="weight and control routes need this key instead (env ROLLOUT_ADMIN_API_KEY)")
    s.add_argument("--allowed-weight-dirs", nargs="*", default=None,
                   help="update_weights_from_disk reads only under these folders (the folder is opened once and "
                        "checked where it lies; its files are read through it, no symlink followed)")
    s.add_argument("--served-model-name", default=None, help="the model id of /v1/models (default: folder name)")
    s.add_argument("--max-body-mb", type=float, default=32.0,
                   help="larger request bodies are refused (413), counted as they arrive")
    s.add_argument("--request-read-timeout-s", type=float, default=30.0,
                   help="a request whose headers and body have not all arrived this long after its first byte "
                        "(or the connection's start) is dropped; never applies while a response is computed")
    s.add_argument("--incremental-streaming-output", action="store_true",
                   help="/generate stream events carry only what is new since a sample's last event (SGLang's "
                        "flag); default: the whole output so far, as SGLang's default")
    s.add_argument("--stream-stall-timeout-s", type=float, default=30.0,
                   help="a stream reader that takes nothing for this long is dropped and its request aborted")
    s.add_argument("--enable-memory-saver", action="store_true",
                   help="SGLang's flag, reported by /get_server_info (slime compares it with its own launch "
                        "arguments); release/resume_memory_occupation work either way")
    s.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", "hermes", "llama3_json"],
                   help="how /v1/chat/completions reads tool calls out of a reply (auto: from the chat template)")
    s.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", "think"],
                   help="split <think>...</think> into reasoning_content (auto: when the chat template has it)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="render chat template text a request sends (chat_template; vLLM's flag). Off: such requests "
                        "are refused (400) and only the model's template renders")
    s.add_argument("--no-tensor-handles", action="store_true",
                   help="refuse the RL frameworks' pickled tensor handles on /update_weights_from_tensor (veRL's, "
                        "slime's, miles' colocated pushes; read by default by an allowlist that runs nothing)")
    s.add_argument("--render-timeout-s", type=float, default=5.0,
                   help="one chat rendering's time limit (a request whose conversation takes longer answers 400)")
    s.add_argument("--stream-max-pending-mb", type=float, default=8.0,
                   help="the most bytes of a stream's events that wait in the server for a reader that falls behind "
                        "(an event is sent in pieces within it)")
    s.add_argument("--lora-paths", nargs="*", default=None, metavar="NAME=PATH",
                   help="PEFT LoRA adapters loaded at start (SGLang's flag; more with /load_lora_adapter)")
    s.add_argument("--lora-modules", nargs="*", default=None, metavar="NAME=PATH", help="vLLM's name for --lora-paths")
    s.add_argument("--max-top-logprobs-num", type=int, default=20,
                   help="the most ids /generate's top_logprobs_num may ask for at each position (-1: the whole "
                        "vocabulary, for a trainer's full-distribution check)")
    s.add_argument("--enable-deterministic-inference", action="store_true",
                   help="SGLang's flag for the batch-invariant mode: the same as --deterministic")
    s.add_argument("--rl-on-policy-target", default=None, metavar="TRAINER",
                   help="SGLang's true on-policy flag (e.g. fsdp): turns on the batch-invariant mode, whose logprobs "
                        "trainer_bridge.on_policy reproduces bit for bit in the trainer")
    s.add_argument("--enable-lora", action="store_true",
                   help="accepted for SGLang's and vLLM's command lines: adapters are always available here")
    _engine_option_flags(serve)
    serve.set_defaults(func=_cmd_serve)
    bench = sub.add_parser("bench", help="the benchmark suite (`rollout bench limits --help`; benchmarks/README.md)",
                           description="The benchmark suite: each writes JSON and a PNG (see benchmarks/README.md).")
    bench.add_argument("which", nargs="?", choices=list(BENCHMARKS), help="the benchmark; its flags follow it")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                       help="print every number of two results side by side, with B/A")
    bench.set_defaults(func=_cmd_bench)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


def run() -> None:
    """The ``rollout`` command: ``main`` over the process's arguments, then the process ends at once once its work
    is done (``rollout.worker.process_exit``: a server's restart, a benchmark's subprocess, no teardown to wait for)."""
    from rollout.worker.process_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    run()
