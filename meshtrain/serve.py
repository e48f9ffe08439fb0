"""Serve a trained (or converted) language model over an OpenAI-compatible HTTP API, with continuous batching.

  python -m meshtrain.serve --workdir W [--step N] [--port 8000] [--host 127.0.0.1] [--slots 8]
      [--max-queue 64] [--api-key KEY] [--grace-s 30] [--max-len N] [--warm]
      [--config.mesh.*=... --config.sharding.rules=... --config.cpu_devices=N]

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream: true for server-sent events),
GET /health, GET /metrics. The engine (meshtrain/inference/engine.py) decodes `--slots` requests at once on the mesh
the --config.mesh.* sizes give (as generate; one device on the CPU unless --config.cpu_devices says more); the HTTP
layer is meshtrain/inference/server.py. SIGTERM stops accepting (503), lets the requests in flight finish within
--grace-s seconds, and exits 0.

Exit codes: 0 stopped, 2 a bad argument or workdir (one `error:` line, before JAX starts).
"""
import pathlib
import sys

from meshtrain import config as config_lib, runtime
from meshtrain.errors import ArgumentParser, UserError


def parse_args(argv: list[str]):
  parser = ArgumentParser(prog="python -m meshtrain.serve", description=__doc__.split("\n\n")[0],
                          epilog="Mesh and sharding as for train: --config.mesh.tensor=8 --config.cpu_devices=8")
  parser.add_argument("--workdir", required=True, help="a training run's (or a converted model's) directory")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
  parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
  parser.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
  parser.add_argument("--slots", type=int, default=8, help="requests decoded at once")
  parser.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
  parser.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' on every call")
  parser.add_argument("--grace-s", type=float, default=30.0, help="how long SIGTERM waits for requests in flight")
  parser.add_argument("--max-len", type=int, default=None,
                      help="longest prompt + completion in tokens (default: the run's seq_len, its trained context)")
  parser.add_argument("--warm", action="store_true", help="compile every prompt bucket's prefill before serving")
  args, overrides = parser.parse_known_args(argv)
  if not 0 <= args.port <= 65535:
    raise UserError(f"--port {args.port} must be between 0 and 65535")
  for name in ("slots", "max_queue"):
    if getattr(args, name) < 1:
      raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
  if args.grace_s < 0:
    raise UserError(f"--grace-s {args.grace_s} must be >= 0")
  if args.max_len is not None and args.max_len < 2:
    raise UserError(f"--max-len {args.max_len} must be at least 2 (one prompt token and one new token)")
  workdir = pathlib.Path(args.workdir).expanduser()
  from meshtrain import checkpoint  # Orbax: only once the arguments are checked
  step, meta = checkpoint.run_meta(args.workdir, args.step, "a training run or of a converted model")
  if (task := checkpoint.task_of(meta)) != "lm":
    raise UserError(f"{args.workdir} was trained with task={task}; serve needs a language model (task=lm)")
  cfg, args.dtype = config_lib.inference_config(overrides, "serving")
  return args, cfg, workdir, step


def main(argv: list[str] | None = None) -> int:
  try:
    args, cfg, workdir, step = parse_args(sys.argv[1:] if argv is None else argv)
    runtime.start(cfg)  # XLA flags, CPU devices: as train and generate
    from meshtrain import mesh as mesh_lib, sharding  # after runtime.start: they import JAX
    from meshtrain.inference.engine import Engine
    from meshtrain.inference.generator import Generator
    from meshtrain.inference.server import Server
    generator = Generator.from_workdir(workdir, step, mesh=mesh_lib.make_mesh(cfg.mesh),
                                       rules=sharding.rules_for(cfg.sharding.rules), max_len=args.max_len,
                                       dtype=args.dtype)
    engine = Engine(generator, slots=args.slots, max_queue=args.max_queue)
    if args.warm:
      engine.warm()
    name = f"{workdir.resolve().name}@{step}"
    server = Server(engine, name, workdir=workdir, api_key=args.api_key, grace_s=args.grace_s)
    ready = lambda port: print(f"serving {name} on http://{args.host}:{port}/v1 ({engine.slots} slots, context "
                               f"{engine.max_len})", file=sys.stderr, flush=True)
    server.serve(args.host, args.port, on_ready=ready)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print("stopped", file=sys.stderr)
  return 0


if __name__ == "__main__":
  runtime.run_main(main)
