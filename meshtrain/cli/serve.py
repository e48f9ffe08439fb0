"""Serve a trained (or converted) language model over an OpenAI-compatible HTTP API, with continuous batching.

  python -m meshtrain.serve --workdir W [--step N | --follow-s 10] [--port 8000] [--host 127.0.0.1] [--slots 8]
      [--max-queue 64] [--api-key KEY] [--served-model-name NAME] [--grace-s 30] [--max-len N] [--lazy]
      [--config.mesh.*=... --config.sharding.rules=... --config.cpu_devices=N --config.model.dtype=float32]

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream: true for server-sent events),
POST /tokenize and /detokenize, GET /tokenizer_info, GET /health, GET /metrics. Every program a request can need
is compiled before it prints "serving" (meanwhile it listens, and /health answers 503 `warming`); --lazy compiles
each on first use instead. The engine
(meshtrain/inference/engine.py) decodes `--slots` requests at once on the mesh the --config.mesh.* sizes give (as
generate; one device on the CPU unless --config.cpu_devices says more); the HTTP layer is
meshtrain/inference/server.py. Without --step it serves the newest checkpoint and, while the run trains, swaps in
each newer one it finds (looked for every --follow-s seconds; 0: never), with nothing compiled again. Under a
multi-process launch (meshtrain.launch, srun) process 0 serves HTTP and every process runs the engine's steps on its
devices. SIGTERM stops accepting (503), lets the requests in flight finish within --grace-s seconds, and exits 0
(while warming: after the program in hand).

Exit codes: 0 stopped, 2 a bad argument or workdir (one `error:` line, before JAX starts).
"""
import pathlib
import socket
import sys

from meshtrain import cli, config as config_lib
from meshtrain.errors import ArgumentParser, UserError
from meshtrain.inference import dit_request


def check_port(host: str, port: int) -> None:
  """Refuses, before the model loads, an address this process cannot listen on (the port in use, a host that is
  not this machine's). Another process may still take the port before uvicorn binds it; that is uvicorn's error."""
  if port == 0:
    return
  try:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket does not count
      s.bind((host, port))
  except OSError as e:
    raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}; pass another --port (0: a free one), or "
                    "stop what holds it") from None


def parse_args(argv: list[str]):
  parser = ArgumentParser(prog="python -m meshtrain.serve", description=__doc__.split("\n\n")[0],
                          epilog="Mesh and sharding as for train: --config.mesh.tensor=8 --config.cpu_devices=8")
  parser.add_argument("--workdir", required=True, help="a training run's (or a converted model's) directory")
  parser.add_argument("--step", type=int, default=None,
                      help="serve this checkpoint step only (default: the newest, then each newer one)")
  parser.add_argument("--follow-s", type=float, default=10.0,
                      help="seconds between looks for a newer checkpoint of the run (0: serve one step only)")
  parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
  parser.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
  parser.add_argument("--slots", type=int, default=8, help="requests decoded at once")
  parser.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
  parser.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' on every call")
  parser.add_argument("--served-model-name", default=None,
                      help="the model's one name in /v1/models and every response (default: RUN@STEP), e.g. the "
                           "Hugging Face repo of its tokenizer, for clients that look one up by the model's name")
  parser.add_argument("--grace-s", type=float, default=30.0, help="how long SIGTERM waits for requests in flight")
  parser.add_argument("--max-len", type=int, default=None,
                      help="longest prompt + completion in tokens (default: the run's seq_len, its trained context)")
  parser.add_argument("--lazy", action="store_true",
                      help="serve at once and compile each program when a request first needs it (for development; "
                           "by default every program is compiled before serving)")
  args, overrides = parser.parse_known_args(argv)
  if not 0 <= args.port <= 65535:
    raise UserError(f"--port {args.port} must be between 0 and 65535")
  for name in ("slots", "max_queue"):
    if getattr(args, name) < 1:
      raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
  for name in ("grace_s", "follow_s"):
    if getattr(args, name) < 0:
      raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 0")
  if args.max_len is not None and args.max_len < 2:
    raise UserError(f"--max-len {args.max_len} must be at least 2 (one prompt token and one new token)")
  check_port(args.host, args.port)
  workdir = pathlib.Path(args.workdir).expanduser()
  from meshtrain import checkpoint  # Orbax (and JAX): only once the arguments are checked
  step, meta = checkpoint.run_meta(args.workdir, args.step, "a training run or of a converted model")
  args.task = checkpoint.task_of(meta)
  if args.task in ("dit", "t2i"):
    cfg = dit_request.run_config(meta["config"], overrides)
  elif args.task == "lm":
    cfg, args.dtype = config_lib.inference_config(overrides, "serving")
  else:
    raise UserError(f"{args.workdir} was trained with task={args.task}; serve needs a language model or an image run")
  return args, cfg, workdir, step


@cli.command
def main(argv: list[str]) -> int:
  args, cfg, workdir, step = parse_args(argv)
  from meshtrain.inference import serving  # JAX: once the arguments are checked
  serving.serve(cfg, workdir, step, args)
  print("stopped", file=sys.stderr)
  return 0
