"""What a decode step costs, program by program (issue 27): `Generator.generate`'s while loop against the serving
engine's decode program (a chunk of steps, and single steps), and the engine's program with its per-row sampling
replaced by an argmax (what the `lax.cond` around the draw and the top-k/top-p sort costs: on a GPU a conditional
may read its predicate back to the host every step), and single steps of fewer rows (the engine's row counts: what
a step costs with fewer requests in flight). Each timed back to back on the device, no host work between
calls; one process, every program compiled before it is timed. On the CPU it says whether the engine's gap to
static batching is in its program or between calls; the GPU call (`experiments/gpu_serve.sh`) runs it too.

  python experiments/decode_step_bench.py --workdir runs/bench_tiny [--max-len 1024] [--slots 8] [--steps 64]
      [--out benchmarks/results/decode_step_bench.json]

Rows: `slots` prompts of 37 ids (a 48-slot bucket), greedy; the engine's span is the fewest of `Engine.attends`
holding the prompt bucket and `steps` tokens (the generator's own cache holds exactly those).
"""
import argparse
import json
import pathlib
import time


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--max-len", type=int, default=1024)
  parser.add_argument("--slots", type=int, default=8)
  parser.add_argument("--steps", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="benchmarks/results/decode_step_bench.json")
  args = parser.parse_args()
  from meshtrain import config as config_lib
  from meshtrain.runtime import startup
  cfg = config_lib.base_config()
  cfg.cpu_devices = 1
  startup.start(cfg)
  import jax
  import jax.numpy as jnp

  from meshtrain.inference import engine as engine_lib
  from meshtrain.inference.generator import Generator, bucket
  gen = Generator.from_workdir(args.workdir, max_len=args.max_len)
  prompts = [list(range(3 + i, 40 + i)) for i in range(args.slots)]

  def best(f, n):
    """Seconds per call of f, the best of `repeats` timings of n calls (after one untimed call)."""
    f()
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      for _ in range(n):
        f()
      times.append((time.perf_counter() - t0) / n)
    return min(times)

  # The generator's loop: (T + 1 tokens) - (1 token) = T decode steps, the prefill cancelling out.
  one = best(lambda: gen.generate(prompts, 1, stop_at_eos=False), 3)
  many = best(lambda: gen.generate(prompts, args.steps + 1, stop_at_eos=False), 3)
  results = {"generator_loop_ms": (many - one) / args.steps * 1e3}

  def program_ms(engine, steps, rows=None):
    span = next(n for n in engine.attends if n >= bucket(len(prompts[0])) + args.steps)
    call = engine._decode(steps, span, rows or engine.slots)

    def run():
      engine.state, out = call(engine.params, engine.state)
      return out["token"]

    def calls():  # enough calls for `steps` tokens per row, waited for once at the end
      for _ in range(args.steps // steps):
        tokens_KB = run()
      tokens_KB.block_until_ready()
    return best(calls, 1) / (args.steps // steps * steps) * 1e3, span

  engine = engine_lib.Engine(gen, slots=args.slots)
  results["engine_chunk_ms"], span = program_ms(engine, engine.chunk)
  results["engine_single_step_ms"], _ = program_ms(engine, 1)
  # What a step costs with fewer requests in flight: single steps of the first `rows` slots (Engine.row_counts).
  for rows in engine.row_counts[:-1]:
    results[f"engine_single_step_{rows}_rows_ms"], _ = program_ms(engine, 1, rows)
  sample_rows = engine_lib.sample_rows
  try:  # the same program with an argmax for its sampling (read when the program is traced)
    engine_lib.sample_rows = lambda logits_BV, keys_B, temp_B, top_p_B, top_k_B, num_ids: jnp.argmax(
        jnp.where(jnp.arange(logits_BV.shape[-1]) < num_ids, logits_BV, -jnp.inf), axis=-1).astype(jnp.int32)
    results["engine_chunk_argmax_ms"], _ = program_ms(engine_lib.Engine(gen, slots=args.slots), engine.chunk)
  finally:
    engine_lib.sample_rows = sample_rows
  results = {k: round(v, 4) for k, v in results.items()}
  out = {"device": jax.devices()[0].device_kind, "slots": args.slots, "steps": args.steps, "span": span,
         "generator_cache_slots": bucket(len(prompts[0])) + args.steps, "per_step": results,
         "engine_chunk_vs_generator": round(results["engine_chunk_ms"] / results["generator_loop_ms"], 3)}
  pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
  print(json.dumps(out))


if __name__ == "__main__":
  main()
