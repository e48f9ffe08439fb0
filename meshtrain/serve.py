"""Serve a trained (or converted) language model over an OpenAI-compatible HTTP API, with continuous batching.

  python -m meshtrain.serve --workdir W [--step N | --follow-s 10] [--port 8000] [--host 127.0.0.1] [--slots 8]
      [--max-queue 64] [--api-key KEY] [--grace-s 30] [--max-len N] [--warm]
      [--config.mesh.*=... --config.sharding.rules=... --config.cpu_devices=N --config.model.dtype=float32]

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream: true for server-sent events),
GET /health, GET /metrics. The engine (meshtrain/inference/engine.py) decodes `--slots` requests at once on the mesh
the --config.mesh.* sizes give (as generate; one device on the CPU unless --config.cpu_devices says more); the HTTP
layer is meshtrain/inference/server.py. Without --step it serves the newest checkpoint and, while the run trains,
swaps in each newer one it finds (looked for every --follow-s seconds; 0: never), with nothing compiled again.
Under a multi-process launch (meshtrain.launch, srun) process 0 serves HTTP and every process runs the engine's
steps on its devices. SIGTERM stops accepting (503), lets the requests in flight finish within --grace-s seconds,
and exits 0.

Exit codes: 0 stopped, 2 a bad argument or workdir (one `error:` line, before JAX starts).
"""
import gc
import pathlib
import signal
import sys

from meshtrain import config as config_lib, runtime
from meshtrain.errors import ArgumentParser, UserError
from meshtrain.inference.live import LiveCheckpoints


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
  parser.add_argument("--grace-s", type=float, default=30.0, help="how long SIGTERM waits for requests in flight")
  parser.add_argument("--max-len", type=int, default=None,
                      help="longest prompt + completion in tokens (default: the run's seq_len, its trained context)")
  parser.add_argument("--warm", action="store_true",
                      help="compile and run every program (each prompt bucket's prefill, each decode span) first")
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
  workdir = pathlib.Path(args.workdir).expanduser()
  from meshtrain import checkpoint  # Orbax: only once the arguments are checked
  step, meta = checkpoint.run_meta(args.workdir, args.step, "a training run or of a converted model")
  args.task = checkpoint.task_of(meta)
  if args.task == "dit":
    from meshtrain.inference import dit_sampler
    cfg = dit_sampler.run_config(meta["config"], overrides)
  elif args.task == "lm":
    cfg, args.dtype = config_lib.inference_config(overrides, "serving")
  else:
    raise UserError(f"{args.workdir} was trained with task={args.task}; serve needs a language model or a DiT run")
  return args, cfg, workdir, step


def cpu_dtype_note(platform: str, dtype) -> str | None:
  """A start-up note when bfloat16 is served on the CPU. Each decode step writes every slot's new keys and values at
  the slot's own position (a scatter); XLA's CPU backend has no bfloat16 scatter and converts each layer's whole
  cache to float32 and back around it: a bfloat16 run's decode step took 3.8-4.0 ms against 1.1 ms in float32 and
  0.9 ms in float16 (tiny model, 8 slots, context 1,024; benchmarks/2026-12-05-serve-10.md). Generate's loop
  writes every row at one position (no scatter)."""
  import jax.numpy as jnp
  if platform != "cpu" or jnp.dtype(dtype) != jnp.bfloat16:
    return None
  return ("note: serving in bfloat16 on the CPU, where XLA converts the KV cache to float32 and back around each "
          "decode step's write; --config.model.dtype=float32 avoids it (a step 3.6x faster at a context of 1,024)")


def language_engine(workdir, cfg, args):
  import jax
  from meshtrain import mesh as mesh_lib, sharding
  from meshtrain.inference.engine import Engine
  from meshtrain.inference.generator import Generator
  # The --step asked for, else the newest (read again if a live run's retention deletes it while it is read).
  generator = Generator.from_workdir(workdir, args.step, mesh=mesh_lib.make_mesh(cfg.mesh),
                                     rules=sharding.rules_for(cfg.sharding.rules), max_len=args.max_len,
                                     dtype=args.dtype)
  if (note := cpu_dtype_note(jax.default_backend(), generator.model_cfg.dtype)) and jax.process_index() == 0:
    print(note, file=sys.stderr, flush=True)
  step = generator.step
  live = LiveCheckpoints(workdir, step, args.follow_s) if args.step is None and args.follow_s > 0 else None
  engine = Engine(generator, slots=args.slots, max_queue=args.max_queue, step=step, live=live)
  if args.warm:
    engine.warm()
  return engine


def image_engine(workdir, step: int, cfg, args):
  import jax
  from meshtrain.inference import image_engine as images
  if jax.process_count() > 1:
    raise UserError("a DiT run is served by one process (its mesh over this host's devices); several processes "
                    "serve a language model")
  return images.from_workdir(workdir, step, cfg, max_queue=args.max_queue, asked=args.step is not None)


def main(argv: list[str] | None = None) -> int:
  try:
    args, cfg, workdir, step = parse_args(sys.argv[1:] if argv is None else argv)
    runtime.start(cfg)  # XLA flags, CPU devices: as train and generate
    from meshtrain.inference.server import Server  # after runtime.start: it imports JAX
    engine = (image_engine(workdir, step, cfg, args) if args.task == "dit" else
              language_engine(workdir, cfg, args))
    # What start-up built (JAX's modules, the model, every compiled program) lives as long as the server: frozen out
    # of the collector's sight, a full collection no longer walks its ~300K objects, which took 80-90 ms with every
    # thread of the process stopped, inside a request's latency (benchmarks/2026-12-04-serve-5.md); what requests
    # allocate is still collected. vLLM and SGLang freeze after their warm-up too.
    gc.collect()
    gc.freeze()
    if not engine.leader:
      # The other processes run process 0's plans until it stops; a signal (srun and the launcher send every process
      # one) is process 0's to act on: it drains, then ends their loop.
      for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
      engine.follow()
      return 0
    server = Server(engine, workdir.resolve().name, workdir=workdir, api_key=args.api_key, grace_s=args.grace_s)
    what = ("images" if args.task == "dit" else
            f"{engine.slots} slots, context {engine.max_len}, {engine.processes} process(es)")
    ready = lambda port: print(f"serving {server.model_name} on http://{args.host}:{port}/v1 ({what})",
                               file=sys.stderr, flush=True)
    server.serve(args.host, args.port, on_ready=ready)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print("stopped", file=sys.stderr)
  return 0


if __name__ == "__main__":
  runtime.run_main(main)
