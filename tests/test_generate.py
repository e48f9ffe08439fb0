"""Generation: KV-cache decode equals full recomputation on every layout, sampling, EOS, padding, the CLI, and
load_params."""
import dataclasses
import json
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_fast

from meshtrain import checkpoint, config, mesh as mesh_lib, sharding
from meshtrain.cli import generate, train
from meshtrain.errors import UserError
from meshtrain.inference import generator, sampling as sampling_lib
from meshtrain.models.llama import ModelConfig, Transformer

NEW = 64
# Grouped-query attention (2 query heads per kv head) whose 8 kv heads split over tensor=8.
MODEL = dataclasses.replace(ModelConfig.from_config(config.base_config().model), num_layers=2, num_heads=16,
                            num_kv_heads=8, head_dim=8)
PROMPTS = [[72, 101, 108, 108, 111], list(range(40, 57)), [35]]  # 5, 17 and 1 tokens: one batch, left-padded
LAYOUTS = {  # name: (mesh sizes, rules preset)
    "data=8": ({"data": 8}, "dp"),
    "fsdp=8": ({"data": 1, "fsdp": 8}, "fsdp"),
    "tensor=8": ({"data": 1, "tensor": 8}, "tp"),
}


def random_params(model: ModelConfig) -> dict:
  """Random weights, scaled up so that the greedy choices are clear (at init the logits are nearly uniform and
  float rounding alone could flip an argmax between two programs)."""
  boxed = Transformer(model).init(jax.random.key(1), jnp.zeros((1, 1), jnp.int32))["params"]
  return jax.tree.map(lambda a: np.asarray(a * 3 if a.ndim > 1 else a), nn.meta.unbox(boxed))


def greedy_by_recompute(model: ModelConfig, params) -> list[list[int]]:
  """Greedy tokens of each prompt by running its whole sequence through the training forward pass for every new
  token, without a cache. Each row right-padded to one length (causal: what follows a token changes nothing
  before it), so one compiled program serves every step and row."""
  lengths = [len(p) for p in PROMPTS]
  tokens = np.zeros((len(PROMPTS), max(lengths) + NEW), np.int32)
  for row, prompt in enumerate(PROMPTS):
    tokens[row, :len(prompt)] = prompt
  forward = jax.jit(lambda p, t: Transformer(model).apply({"params": p}, t))
  rows = np.arange(len(PROMPTS))
  for step in range(NEW):
    at = np.asarray(lengths) + step
    tokens[rows, at] = np.argmax(np.asarray(forward(params, tokens))[rows, at - 1], axis=-1)
  return [tokens[row, n:n + NEW].tolist() for row, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def params():
  return random_params(MODEL)


@pytest.fixture(scope="module")
def reference(params):
  return greedy_by_recompute(MODEL, params)


def one_device(params, **kwargs):
  return generator.Generator(params, MODEL, num_ids=MODEL.vocab_size, **kwargs)


@pytest.fixture(scope="module")
def gen(params):
  """One generator for the one-device tests: its compiled programs are reused between them."""
  return one_device(params)


def test_kv_cache_greedy_equals_full_recompute_one_device(gen, reference):
  out = gen.generate(PROMPTS, NEW, stop_at_eos=False)
  assert out.token_ids == reference
  assert out.finish_reasons == ["max_new_tokens"] * 3 and out.decode_tokens == 3 * (NEW - 1)


def test_scanned_layer_stack_decodes_the_same(params, reference):
  # The cache with a leading layer axis, carried through nn.scan (Generator's default unrolls the layers).
  scanned = one_device(params, scan_layers=True)
  prefill, _ = scanned._programs(3, 32, NEW, sampling_lib.Sampling(), False)
  assert prefill.out_info["cache"].k_NBKSE.shape == (MODEL.num_layers, 3, 8, 32 + NEW - 1, 8)
  assert scanned.generate(PROMPTS, NEW, stop_at_eos=False).token_ids == reference


def test_other_backends_decode_the_scanned_stack_with_xlas_dot(params, reference, monkeypatch):
  """The CPU kernel is the CPU's choice, not the model's: on any other backend (here the CPU reporting itself as a
  GPU) the generator runs the scanned layer stack with the model's own weight layout and XLA's dot, and decodes the
  same tokens."""
  from meshtrain.kernels import cpu_matmul
  from meshtrain.models.llama import DenseProducts
  assert isinstance(generator.backend_choice()[1], cpu_matmul.OutInProducts)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  scan_layers, products = generator.backend_choice()
  assert scan_layers and type(products) is DenseProducts
  gpu = one_device(params)
  assert gpu.model_cfg.scan_layers and type(gpu.model_cfg.products) is DenseProducts
  assert gpu.generate(PROMPTS, NEW, stop_at_eos=False).token_ids == reference


def test_mixture_of_experts_decodes_like_full_recompute():
  # Routing is per token; only capacity couples tokens (an expert's overflow is dropped, and a decode step's group
  # is one token where the full sequence's is all of them). With room for every token (capacity_factor =
  # experts / experts_per_token) nothing is dropped, so the cached decode must choose what recomputation does.
  model = dataclasses.replace(MODEL, num_experts=4, experts_per_token=2, capacity_factor=2.0)
  params = random_params(model)
  out = generator.Generator(params, model, num_ids=model.vocab_size).generate(PROMPTS, NEW, stop_at_eos=False)
  assert out.token_ids == greedy_by_recompute(model, params)
  assert len({tuple(row) for row in out.token_ids}) == len(PROMPTS)  # three prompts, three different continuations


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_cache_greedy_equals_full_recompute_on_meshes(params, reference, layout):
  sizes, rules = LAYOUTS[layout]
  mesh = mesh_lib.make_mesh(sizes)
  gen = generator.Generator(params, MODEL, mesh=mesh, rules=sharding.rules_for(rules), num_ids=MODEL.vocab_size)
  prefill, _ = gen._programs(8, 32, NEW, sampling_lib.Sampling(), False)  # the program generate() below runs
  cache_spec = prefill.output_shardings["cache"].k_NBKSE[0].spec  # layer 0's [B, K, S, E]
  # The cache is sharded like the activations it holds: rows over the batch axes, kv heads over tensor.
  expected = {"data=8": ("data",), "fsdp=8": ("fsdp",), "tensor=8": (None, "tensor")}[layout]
  assert tuple(cache_spec)[:len(expected)] == expected
  assert gen.generate(PROMPTS, NEW, stop_at_eos=False).token_ids == reference


@pytest.mark.slow
def test_open_model_features_decode_like_full_recompute_on_a_tensor_mesh():
  """Qwen2's biases, Qwen3's q/k norms, Llama 3's rotary scaling and Mistral's window (8 tokens: prompts and
  generations run past it) through the cache with heads and kv heads split over tensor=8."""
  model = dataclasses.replace(MODEL, attention_bias=True, qk_norm=True, rope_type="llama3", rope_factor=8.0,
                              rope_original_max_len=16, sliding_window=8)
  params = random_params(model)
  gen = generator.Generator(params, model, mesh=mesh_lib.make_mesh({"data": 1, "tensor": 8}),
                            rules=sharding.rules_for("tp"), num_ids=model.vocab_size)
  assert gen.generate(PROMPTS, NEW, stop_at_eos=False).token_ids == greedy_by_recompute(model, params)


def test_prompts_in_one_batch_equal_each_alone(gen):
  together = gen.generate(PROMPTS, NEW, stop_at_eos=False).token_ids
  # Alone, the 5- and 1-token prompts are padded to 16 columns, not 32, and sit in a batch of one.
  assert together == [gen.generate([p], NEW, stop_at_eos=False).token_ids[0] for p in PROMPTS]


def test_one_prompt_decodes_beside_a_padding_row_without_copying_the_cache(gen):
  # With a single row, XLA's CPU backend copied every layer's cache (keys transposed) every token; decode runs a
  # padding row beside it (generator.DECODE_MIN_ROWS). That it changes no token: the test above.
  prefill, decode = gen._programs(1, 16, NEW, sampling_lib.Sampling(), False)
  k_BKSE = prefill.out_info["cache"].k_NBKSE[0]
  assert k_BKSE.shape[0] == 2 and prefill.out_info["out_BT"].shape[0] == 2
  copied = [np.prod([int(n) for n in dims.split(",")]) for dims in
            re.findall(r"f32\[([0-9,]+)\]\{[0-9,]*\} copy\(", decode.as_text())]
  assert np.prod(k_BKSE.shape) // 2 not in copied and np.prod(k_BKSE.shape) not in copied, copied


def test_seeded_sampling_is_reproducible(gen):
  sampling = sampling_lib.Sampling(temperature=1.0, top_k=50, top_p=0.9)
  first = gen.generate(PROMPTS, NEW, sampling, seed=3, stop_at_eos=False).token_ids
  assert gen.generate(PROMPTS, NEW, sampling, seed=3, stop_at_eos=False).token_ids == first
  assert gen.generate(PROMPTS, NEW, sampling, seed=4, stop_at_eos=False).token_ids != first
  assert first != gen.generate(PROMPTS, NEW, stop_at_eos=False).token_ids  # not greedy


def test_eos_stops_its_sequence_only(params, reference):
  # An id that row 0 makes at index 6 and never before, and row 1 never: declared the end-of-sequence id.
  row0, row1 = reference[0], reference[1]
  k = next(i for i in range(6, NEW) if row0[i] not in row0[:i] and row0[i] not in row1)
  out = one_device(params, eos_id=row0[k]).generate(PROMPTS[:2], NEW)
  assert out.token_ids[0] == row0[:k + 1] and out.finish_reasons[0] == "eos"
  assert out.token_ids[1] == row1 and out.finish_reasons[1] == "max_new_tokens"


def test_context_limit_and_bad_input(params):
  gen = one_device(params, max_len=20)
  out = gen.generate(PROMPTS, 10, stop_at_eos=False)
  assert [len(t) for t in out.token_ids] == [10, 3, 10]  # the 17-token prompt has room for 3 tokens in 20
  assert out.finish_reasons == ["max_new_tokens", "context", "max_new_tokens"]
  with pytest.raises(UserError, match="prompt 0 is 20 tokens.*context.*20"):
    gen.generate([list(range(20))], 4)
  for kwargs, match in [(dict(max_new_tokens=0), "at least 1"),
                        (dict(sampling=sampling_lib.Sampling(-1.0)), "temperature"),
                        (dict(sampling=sampling_lib.Sampling(1.0, top_p=0.0)), "top-p")]:
    with pytest.raises(UserError, match=match):
      gen.generate(PROMPTS, **{"max_new_tokens": 4, **kwargs})



TWO_PROCESS_API = """
import json, pickle
from meshtrain import mesh as mesh_lib, sharding
from meshtrain.inference import generator
params, model, prompts = pickle.loads(open(sys.argv[3], "rb").read())
# tensor=8 over two processes of 4 devices: every layer's heads split across both (mesh.nodes.tensor=2).
mesh = mesh_lib.make_mesh({"data": 1, "tensor": 4, "nodes": {"tensor": 2}})
gen = generator.Generator(params, model, mesh=mesh, rules=sharding.rules_for("tp"), num_ids=model.vocab_size)
print("ids", json.dumps(gen.generate(prompts, 16, stop_at_eos=False).token_ids))
"""


def test_generator_api_in_two_processes(params, reference, tmp_path):
  # The importable API in multi-process code: host (numpy) parameters placed over a mesh of both processes'
  # devices, and every process gets the whole Output back.
  import pickle

  import two_processes
  (tmp_path / "inputs.pkl").write_bytes(pickle.dumps((params, MODEL, PROMPTS)))
  outputs = two_processes.run(TWO_PROCESS_API, tmp_path, str(tmp_path / "inputs.pkl"), timeout=300)
  for out in outputs:
    ids = [line for line in out.splitlines() if line.startswith("ids ")]
    assert ids and json.loads(ids[0][4:]) == [row[:16] for row in reference], out[-2000:]


# --- a trained workdir: load_params and the command line ---


def train_tiny(workdir):
  """A 2-layer tiny model trained 4 steps into `workdir` (what the generation and serving tests read)."""
  assert train.main(["--config", "configs/tiny.py", "--workdir", str(workdir), "--config.steps=4",
                     "--config.seq_len=64", "--config.batch_size=8", "--config.eval_every=0",
                     "--config.model.num_layers=2", "--config.log_every=2"]) == 0
  return workdir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return train_tiny(tmp_path_factory.mktemp("trained"))


def test_load_params_on_host_and_on_a_mesh(workdir):
  host, meta = checkpoint.load_params(workdir)
  assert meta["config"]["steps"] == 4 and isinstance(host["layers"]["attn"]["q"], np.ndarray)
  assert host["layers"]["attn"]["q"].shape == (2, 128, 8, 16) and "opt_state" not in host
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sharded, _ = checkpoint.load_params(workdir, step=4, mesh=mesh)
  assert sharded["layers"]["attn"]["q"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  jax.tree.map(np.testing.assert_array_equal, host, jax.device_get(sharded))
  with pytest.raises(UserError, match="no complete checkpoint at step 3; it has steps 4"):
    checkpoint.load_params(workdir, step=3)
  with pytest.raises(UserError, match="no such directory"):
    checkpoint.load_params(workdir / "missing")


def test_cli_streams_text_and_prints_json(workdir, capsys):
  # In-process (the test's 8 devices): a data=2 x tensor=4 mesh.
  argv = ["--workdir", str(workdir), "--max-new-tokens", "12", "--config.cpu_devices=8",
          "--config.mesh.data=2", "--config.mesh.tensor=4", "--config.sharding.rules=tp"]
  assert generate.main([*argv, "--prompt", "def f(", "--json"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert {"completions", "token_ids", "prefill_tokens_per_sec", "decode_tokens_per_sec"} <= result.keys()
  assert len(result["token_ids"][0]) == 12 or result["finish_reasons"][0] == "eos"
  assert result["prefill_tokens_per_sec"] > 0 and result["decode_tokens_per_sec"] > 0
  assert generate.main([*argv, "--prompt", "def f(", "--max-new-tokens", "40"]) == 0
  streamed = capsys.readouterr()
  assert "decode" in streamed.err and streamed.out.endswith("\n")
  assert generate.main([*argv, "--prompt-ids", "100,101", "--prompt-ids", "35"]) == 0
  lines = capsys.readouterr().out
  assert "[0] " in lines and "[1] " in lines


def test_cli_subprocess_one_device(workdir, tmp_path):
  prompt = tmp_path / "prompt.txt"
  prompt.write_text("import os\n")
  proc = subprocess.run([sys.executable, "-m", "meshtrain.generate", "--workdir", str(workdir), "--prompt-file",
                         str(prompt), "--max-new-tokens", "8", "--json"], capture_output=True, text=True,
                        env=xla_fast.env(), timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert len(json.loads(proc.stdout)["completions"]) == 1



def test_cli_two_processes_equal_one_process(workdir, capsys):
  # fsdp=8 over two processes of 4 devices: every weight and the 8 batch rows are split across both processes
  # (rows 0-3 on process 0's devices, 4-7 on process 1's), so the restore, the decode's collectives and the gather
  # of the ids all cross processes. Five prompts of 5, 17, 1, 3 and 9 tokens in one batch (the fifth is made on
  # process 1); the same ids as one process with 8 devices, printed once, by process 0.
  prompts = [["--prompt-ids", ",".join(map(str, ids))] for ids in
             (range(100, 105), range(40, 57), [35], [72, 101, 108], range(60, 69))]
  prompts = sum(prompts, [])
  args = ["--workdir", str(workdir), *prompts, "--max-new-tokens", "24", "--json", "--config.mesh.data=1",
          "--config.sharding.rules=fsdp"]
  proc = subprocess.run([sys.executable, "-m", "meshtrain.launch", "--processes", "2", "--devices-per-process", "4",
                         "--module", "meshtrain.generate", "--", *args, "--config.mesh.fsdp=4",
                         "--config.mesh.nodes.fsdp=2"], capture_output=True, text=True, env=xla_fast.env(),
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()  # only the JSON: the collectives' "[Gloo] Rank ..." lines go to stderr
  assert len(lines) == 1 and lines[0].startswith("[p0] {"), proc.stdout[-3000:]
  got = json.loads(lines[0][len("[p0] "):])
  assert generate.main([*args, "--config.mesh.fsdp=8", "--config.cpu_devices=8"]) == 0  # one process, 8 devices
  expected = json.loads(capsys.readouterr().out)
  assert len(expected["token_ids"]) == 5 and len(set(map(tuple, expected["token_ids"]))) > 1
  assert got["token_ids"] == expected["token_ids"] and got["completions"] == expected["completions"]



def test_processes_given_different_prompts_all_exit_2(workdir):
  # Two processes (the launcher's variables, as srun would set SLURM's) whose prompts differ, as prompt files that
  # differ between hosts would: both refuse before compiling, instead of waiting on each other forever.
  from meshtrain.runtime.launcher import free_port
  address = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen([sys.executable, "-m", "meshtrain.generate", "--workdir", str(workdir), "--prompt", prompt,
                             "--max-new-tokens", "4", "--config.cpu_devices=4"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**xla_fast.env(), "JAX_COORDINATOR_ADDRESS": address, "MESHTRAIN_NUM_PROCESSES": "2",
                                 "MESHTRAIN_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu"})
           for i, prompt in enumerate(["def f(", "import os"])]
  outputs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [2, 2], outputs
  for out, err in outputs:
    assert out == "" and "error: the processes were not all given the same prompts and settings: process(es) 1 " \
        "differ from process 0" in err, err[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature -1.0 must be"),
    (["--prompt", "x", "--top-p", "1.5"], "--top-p 1.5 must be in"),
    (["--prompt", "x", "--top-k", "-1"], "--top-k -1 must be 0"),
    (["--prompt", "x", "--step", "9"], "--step 9: .* has checkpoints at steps 4"),
    (["--prompt", "x" * 64, "--config.cpu_devices=8"], "prompt 0 is 64 tokens, but the model's context"),
    (["--prompt-ids", "1,x"], "--prompt-ids '1,x' must be comma-separated non-negative integers"),
    (["--prompt", "x", "--config.model.num_layers=3"], "cannot be set for generation"),
])
def test_cli_bad_input_exits_2_with_one_line(workdir, capsys, args, message):
  assert generate.main(["--workdir", str(workdir), *args]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1
  import re
  assert re.search(message, err), err


def test_cli_missing_workdir(tmp_path, capsys):
  assert generate.main(["--workdir", str(tmp_path / "none"), "--prompt", "x"]) == 2
  assert "no such directory" in capsys.readouterr().err


def test_docs_example(workdir, capsys):
  import pathlib
  import re
  page = (pathlib.Path(__file__).parents[1] / "docs" / "generation.md").read_text()
  section = page.split("\n## In your own code\n", 1)[1].split("\n## ", 1)[0]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1).replace('"runs/tiny"', repr(str(workdir)))
  exec(compile(code, "docs/generation.md example", "exec"), {})
  out = capsys.readouterr().out
  assert "tokens/s" in out and "(1, 3, 384)" in out and "P(None, 'fsdp', 'tensor', None)" in out
