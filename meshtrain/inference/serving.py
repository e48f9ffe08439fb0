"""What `python -m meshtrain.serve` runs once its arguments are checked: the runtime, the engine of the run (a
language model's continuous batching, or a DiT's image sampler), then the HTTP server on process 0 while the other
processes follow its plans.
"""
import gc
import signal
import sys

import jax
import jax.numpy as jnp

from meshtrain import mesh as mesh_lib, sharding
from meshtrain.errors import UserError
from meshtrain.inference import image_engine as images
from meshtrain.inference.engine import Engine
from meshtrain.inference.generator import Generator
from meshtrain.inference.live import LiveCheckpoints
from meshtrain.inference.server import Server
from meshtrain.runtime import startup


def cpu_dtype_note(platform: str, dtype) -> str | None:
  """A start-up note when bfloat16 is served on the CPU. Each decode step writes every slot's new keys and values at
  the slot's own position (a scatter); XLA's CPU backend has no bfloat16 scatter and converts each layer's whole
  cache to float32 and back around it, several times slower per step than float32. Generate's loop writes every row
  at one position (no scatter)."""
  if platform != "cpu" or jnp.dtype(dtype) != jnp.bfloat16:
    return None
  return ("note: serving in bfloat16 on the CPU, where XLA converts the KV cache to float32 and back around each "
          "decode step's write; --config.model.dtype=float32 avoids it (a step 3.6x faster at a context of 1,024)")


def language_engine(workdir, cfg, options) -> Engine:
  # The --step asked for, else the newest (read again if a live run's retention deletes it while it is read).
  generator = Generator.from_workdir(workdir, options.step, mesh=mesh_lib.make_mesh(cfg.mesh),
                                     rules=sharding.rules_for(cfg.sharding.rules), max_len=options.max_len,
                                     dtype=options.dtype)
  if (note := cpu_dtype_note(jax.default_backend(), generator.model_cfg.dtype)) and startup.is_main():
    print(note, file=sys.stderr, flush=True)
  step = generator.step
  follow = options.step is None and options.follow_s > 0
  live = LiveCheckpoints(workdir, step, options.follow_s) if follow else None
  # Warmed before the first request (on the engine thread while the server listens: /health says `warming`),
  # unless --lazy: then each program compiles when a request first needs it.
  return Engine(generator, slots=options.slots, max_queue=options.max_queue, step=step, live=live,
                warm_first=not options.lazy)


def image_engine(workdir, step: int, cfg, options) -> images.ImageEngine:
  if jax.process_count() > 1:
    raise UserError("an image run is served by one process (its mesh over this host's devices); several processes "
                    "serve a language model")
  return images.from_workdir(workdir, step, cfg, max_queue=options.max_queue, asked=options.step is not None,
                             follow_s=options.follow_s, warm_first=not options.lazy)


def serve(cfg, workdir, step: int, options) -> None:
  """Serves the run in `workdir` (its checkpoint `step`, and newer ones while it trains) until SIGTERM; `options`
  are the command's (meshtrain/cli/serve.py)."""
  startup.start(cfg)  # XLA flags, CPU devices: as train and generate
  engine = (image_engine(workdir, step, cfg, options) if options.task in ("dit", "t2i") else
            language_engine(workdir, cfg, options))
  # What start-up built (JAX's modules, the model, every compiled program) lives as long as the server: frozen out
  # of the collector's sight, a full collection no longer walks its objects with every thread of the process
  # stopped, inside a request's latency; what requests allocate is still collected. vLLM and SGLang freeze after
  # their warm-up too.
  gc.collect()
  gc.freeze()
  if not engine.leader:
    # The other processes run process 0's plans until it stops; a signal (srun and the launcher send every process
    # one) is process 0's to act on: it drains, then ends their loop.
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, signal.SIG_IGN)
    engine.follow()
    return
  server = Server(engine, workdir.resolve().name, workdir=workdir, api_key=options.api_key, grace_s=options.grace_s,
                  served_name=options.served_model_name)
  what = ("images" if options.task in ("dit", "t2i") else
          f"{engine.slots} slots, context {engine.max_len}, {engine.processes} process(es)")
  ready = lambda port: print(f"serving {server.model_name} on http://{options.host}:{port}/v1 ({what})",
                             file=sys.stderr, flush=True)

  def listening(port: int) -> None:
    if not server.ready:
      print(f"listening on http://{options.host}:{port}: compiling {len(engine.programs())} programs before serving "
            "(GET /health answers 503 `warming` until then; --lazy compiles on first use instead)",
            file=sys.stderr, flush=True)

  server.serve(options.host, options.port, on_listening=listening, on_ready=ready)
