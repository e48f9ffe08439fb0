"""Text generation from a meshtrain Transformer: a compiled prefill, then a KV-cache decode loop on the device.

Prompts of different lengths share one batch: they are left-padded to a common length, each row keeps its own
rotary positions and never attends to its padding (meshtrain/models/llama.py, KVCache), so a prompt gets the same
tokens alone or in a batch. The decode loop is a `lax.while_loop` on the device that stops when every row has met
its end-of-sequence token or its length limit; the host only wakes up between chunks of `stream_every` tokens, to
hand them over (streaming). Temperature 0 is greedy.

How the model runs is the backend's choice (`backend_choice`): on the CPU unrolled layers and dense weights held
[out, in] for meshtrain/kernels/cpu_matmul.py; elsewhere the scanned layer stack with XLA's dot, as training runs it.

Several processes (hosts): every process builds the same Generator over a mesh spanning every process's devices
and makes the same calls; the generated ids are gathered onto every process.

What a request asks for (`Sampling`, the prompt `bucket`) and what it gets (`Output`) are JAX-free, in
meshtrain/inference/sampling.py: the commands check their arguments with them before JAX loads.
"""
import dataclasses
import functools
import hashlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import checkpoint, config as config_lib, layout, mesh as mesh_lib, sharding
from meshtrain.data import tokenization as tokenizer_lib
from meshtrain.errors import UserError
from meshtrain.inference.sampling import Output, Sampling, bucket
from meshtrain.kernels import cpu_matmul
from meshtrain.models.llama import DenseProducts, ModelConfig, Transformer, init_cache, layers_as
from meshtrain.runtime import startup

# Decode runs at least this many rows (the rest padding). With one row XLA's CPU backend drops the unit batch
# dimension and then copies every layer's keys transposed and its cache updates, every token: at the 125m shape 60
# copies, ~90 MB of memory traffic per token beside ~500 MB of weights. With two there are none, and the extra row
# costs nothing measurable in a step that streams every weight anyway. Prefill keeps its own rows (its work grows
# with them); its state is padded at its end.
DECODE_MIN_ROWS = 2


def kv_cache_bytes(c, rows: int, slots: int) -> int:
  """The bytes of a KV cache of `rows` rows of `slots` positions: keys and values of every layer (model fields c)."""
  return 2 * c.num_layers * rows * c.num_kv_heads * slots * c.head_dim * jnp.dtype(c.dtype).itemsize


def drawable(x_XV, num_ids: int | None):
  """x (logits or logprobs over the vocabulary, last axis) with the ids >= num_ids at -inf: the ids a sampler may
  draw (a vocabulary padded past its tokenizer's has ids that stand for nothing). Unchanged when num_ids is None."""
  V = x_XV.shape[-1]
  return x_XV if num_ids is None or num_ids >= V else jnp.where(jnp.arange(V) < num_ids, x_XV, -jnp.inf)


def sample(logits_BV, key, sampling: Sampling, num_ids: int | None = None):
  """Next token id per row, [B] int32, among ids < num_ids (all when None)."""
  logits_BV = drawable(logits_BV, num_ids)
  if sampling.temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / sampling.temperature
  if sampling.top_k:
    kth_B1 = jax.lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  if sampling.top_p < 1:
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)
    p_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # Keep an id while the probability of the more likely ones is still below top_p: the most likely always stays.
    keep_BV = jnp.cumsum(p_BV, axis=-1) - p_BV < sampling.top_p
    cutoff_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


@functools.lru_cache
def _transpose(perm: tuple[int, ...], out_sharding):
  """Axes permuted by `perm` into `out_sharding`, compiled once per permutation and sharding (the layers share
  them); the identity permutation is a no-op."""
  if perm == tuple(range(len(perm))):
    return lambda a: a
  return jax.jit(lambda a: a.transpose(perm), out_shardings=out_sharding)


def place(x, sharding):
  """`x` as a jax Array with `sharding`. A value this process holds whole (numpy, or a jax Array on this process's
  devices) for a sharding whose devices span several processes is assembled from every process's own shards of it
  (each process holds the whole value: the same prompts, the same parameters): `jax.device_put` refuses devices
  of other processes for a jax Array ("must be a Device or a Sharding which represents addressable devices")."""
  if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
    return jax.device_put(x, sharding)
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def backend_choice(scan_layers: bool | None = None):
  """(scan_layers, products) that decoding runs the model with on this backend: on the CPU unrolled layers (unless
  `scan_layers` says otherwise) and meshtrain/kernels/cpu_matmul.py's OutInProducts, dense weights held [out, in]
  for its kernel (where the kernel cannot be built, XLA's dot on the same layout, and one warning); elsewhere the
  scanned stack and the model's own layout with XLA's dot, as training runs it."""
  if jax.default_backend() == "cpu":
    return (False if scan_layers is None else scan_layers), cpu_matmul.OutInProducts()
  return (True if scan_layers is None else scan_layers), DenseProducts()


class Generator:
  """Prefill + KV-cache decode of a meshtrain Transformer on a mesh; reusable across calls (compiled programs are
  kept per batch size, padded prompt length, new-token count and sampling setting).

    gen = Generator.from_workdir("runs/tiny")                  # a run's latest parameters, on one device
    out = gen.generate(["def main(", "import "], max_new_tokens=64)
    out.texts, out.token_ids, out.decode_tokens_per_sec

  or from parameters in memory: Generator(params, model_cfg, tokenizer=tok, mesh=mesh) with `params` the Flax
  tree (numpy or jax arrays; they are placed in the mesh's shardings) and `model_cfg` a ModelConfig or the `model`
  config group. `max_len` bounds prompt + new tokens (a run's seq_len by default for from_workdir; None: no bound).
  `add_bos` puts the tokenizer's BOS in front of every text prompt (prompts given as ids are used as they are): a
  converted Hugging Face Llama expects it, meshtrain's own runs train without it, so from_workdir's default (None)
  turns it on only for a converted checkpoint whose tokenizer is not bytes and has a BOS.
  Ids the tokenizer does not have (model.vocab_size is often rounded up) are never generated: they were never a
  training target and decode to nothing. `num_ids` overrides that bound (None: the tokenizer's vocabulary size),
  `eos_id` the id that ends a row (None: the tokenizer's).
  How the model runs is the backend's choice (`backend_choice`). On the CPU the layers run unrolled, on per-layer
  weights (`layer_i`, split from the stacked `layers` once, here): inside the decode loop a scanned stack slices
  each layer's weights out of [N, ...] arrays, and XLA's CPU backend copies every slice, every token (dynamic-slice
  fusions; measured: see benchmarks/). While they are split, the stacked and the per-layer weights both exist:
  twice the parameters' memory for a moment. And the dense weights are held [out, in] (OutInProducts of
  meshtrain/kernels/cpu_matmul.py, ModelConfig.products), each turned on the devices once, here: its kernel
  multiplies a few rows against them, reading each weight row once. Elsewhere (GPU) the model runs as training
  runs it: the scanned stack, the model's own weight layout, XLA's dot. `scan_layers` overrides the stack's choice
  (True: one compiled block, a smaller program for very deep models).

  Several processes (jax.distributed, a mesh over every process's devices): every process builds the Generator and
  calls generate with the same arguments (same prompts, settings and stream_every; the calls run collectives
  together), and every process gets the same whole Output back (ids gathered from the devices that hold them) and
  the same on_tokens calls; printing it once is the caller's choice (process 0: `jax.process_index() == 0`).
  Before the first run of each newly compiled program the processes wait for each other (meshtrain.runtime.barrier,
  up to `barrier_timeout_s`): the CPU backend's collectives give a late peer only 30 s.
  """

  def __init__(self, params, model_cfg, *, tokenizer=None, mesh=None, rules=None, max_len: int | None = None,
               add_bos: bool = False, num_ids: int | None = None, eos_id: int | None = None,
               scan_layers: bool | None = None, barrier_timeout_s: int = config_lib.BARRIER_TIMEOUT_S):
    # JAX and the modules that import it: after runtime.start (module docstring).
    if not isinstance(model_cfg, ModelConfig):
      model_cfg = ModelConfig.from_config(model_cfg)
    self.step: int | None = None  # the checkpoint step of `params`, when from_workdir read them from a run
    scan_layers, products = backend_choice(scan_layers)
    # Generation runs the plain layer stack: no pipeline, no remat (nothing is differentiated), attention by the
    # cache path; a checkpoint trained pipelined (sequential layer order) has the same parameter tree.
    # A mixture of experts routes without capacity drops here (slots for every token at every expert: the
    # capacity factor that gives C = S), as transformers' Mixtral does; training keeps its capacity_factor.
    no_drop = (model_cfg.num_experts / model_cfg.experts_per_token if model_cfg.num_experts
               else model_cfg.capacity_factor)
    self.model_cfg = dataclasses.replace(model_cfg, pipeline_stages=1, pipeline_microbatches=1, remat="none",
                                         scan_layers=scan_layers, products=products, capacity_factor=no_drop)
    self.model = Transformer(self.model_cfg)
    self.tokenizer = tokenizer if tokenizer is not None else tokenizer_lib.load("byte")
    if self.tokenizer.vocab_size > self.model_cfg.vocab_size:
      raise UserError(f"the tokenizer has {self.tokenizer.vocab_size} ids but the model only "
                      f"{self.model_cfg.vocab_size} "
                      "(model.vocab_size); use the tokenizer the model was trained with")
    self.mesh = mesh if mesh is not None else mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
    for axis in ("stage", "sequence"):
      if self.mesh.shape.get(axis, 1) > 1:
        raise UserError(f"generation does not split over mesh.{axis}={self.mesh.shape[axis]}; set mesh.{axis}=1 and "
                        "use mesh.data, mesh.fsdp or mesh.tensor")
    self.rules = sharding.for_mesh(rules or sharding.rules_for("fsdp_tp"), self.mesh)
    sharding.check_mesh_uses_rules(self.mesh, self.rules, has_experts=self.model_cfg.num_experts > 0)
    shapes = lambda cfg: jax.eval_shape(Transformer(cfg).init, jax.random.key(0),
                                        jax.ShapeDtypeStruct((1, 1), jnp.int32))["params"]
    boxed, given = shapes(self.model_cfg), shapes(dataclasses.replace(self.model_cfg, products=DenseProducts()))
    sharding.param_table(boxed, self.mesh, self.rules)  # a weight the mesh cannot split evenly: UserError naming it
    self.param_shardings = sharding.shardings_of(boxed, self.mesh, self.rules)
    is_leaf = lambda x: isinstance(x, nn.LogicallyPartitioned)
    self._given_shardings = sharding.shardings_of(given, self.mesh, self.rules)
    self._perms = jax.tree.map(lambda g, b: tuple(g.names.index(n) for n in b.names), given, boxed, is_leaf=is_leaf)
    self.params = self.place_params(params)
    self.batch_ways = int(np.prod([self.mesh.shape[a] for a in mesh_lib.BATCH_AXES]))
    self.max_len = max_len
    self.add_bos = add_bos
    self.num_ids = num_ids if num_ids is not None else self.tokenizer.vocab_size
    self.pad_id = self.tokenizer.pad_id
    self.eos_id = eos_id if eos_id is not None else self.tokenizer.eos_id
    self._replicated = NamedSharding(self.mesh, P())
    self._batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
    self._compiled = {}
    self.barrier_timeout_s = barrier_timeout_s

  @classmethod
  def from_config(cls, cfg, workdir, step: int | None = None, *, max_len: int | None = None, dtype=None):
    """`from_workdir` on the mesh and rules of `cfg` (an inference config: meshtrain.config.inference_config), over
    every process's devices, once every process is ready to restore."""
    mesh = mesh_lib.make_mesh(cfg.mesh)
    startup.barrier("the parameter restore", cfg.distributed.barrier_timeout_s)
    return cls.from_workdir(workdir, step, mesh=mesh, rules=sharding.rules_for(cfg.sharding.rules), max_len=max_len,
                            dtype=dtype, barrier_timeout_s=cfg.distributed.barrier_timeout_s)

  @classmethod
  def from_workdir(cls, workdir, step: int | None = None, *, mesh=None, rules=None, max_len: int | None = None,
                   tokenizer=None, dtype: str | None = None, num_ids: int | None = None,
                   add_bos: bool | None = None, barrier_timeout_s: int = config_lib.BARRIER_TIMEOUT_S) -> "Generator":
    """The parameters of `workdir`'s checkpoint `step` (default the newest), its model config and tokenizer, on
    `mesh` (default one device). max_len defaults to the run's seq_len, the context it was trained on; `dtype`
    replaces the run's compute dtype (model.dtype, e.g. bfloat16), not the stored parameters'."""
    if mesh is None:
      mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
    if tokenizer is None:  # the run's own, checked against the checkpoint's record of it before any restore
      tokenizer = tokenizer_lib.from_workdir(workdir, checkpoint.run_meta(str(workdir), step, "a run")[1].get(
          "tokenizer"))
    params, meta, read = checkpoint.read_params(workdir, step, step is not None, mesh=mesh,
                                                rules=sharding.for_mesh(rules or sharding.rules_for("fsdp_tp"), mesh))
    saved = meta["config"]
    model = dict(saved["model"], **({"dtype": dtype} if dtype else {}))
    generator = cls(params, model, tokenizer=tokenizer, mesh=mesh, rules=rules,
                    max_len=max_len if max_len is not None else saved.get("seq_len"),
                    add_bos=add_bos if add_bos is not None else (
                        bool(meta.get("params_only")) and tokenizer.kind != "byte" and tokenizer.bos_id is not None),
                    num_ids=num_ids, barrier_timeout_s=barrier_timeout_s)
    generator.step = read  # the newest when none was asked for, read again if a live run's retention deleted one
    return generator

  def place_params(self, params):
    """`params` (the model's tree as a checkpoint holds it: host or device arrays) placed as this generator holds
    its own: the same shardings and layout, so every program compiled for `self.params` runs on them too (a newer
    checkpoint of the same run, swapped in without compiling anything)."""
    # Placed as given (the model's layout), then turned to the held layout on the devices, one weight at a time.
    return jax.tree.map(lambda x, s, perm, held: _transpose(perm, held)(place(x, s)),
                        layers_as(params, self.model_cfg.num_layers, self.model_cfg.scan_layers),
                        self._given_shardings, self._perms, self.param_shardings)

  def load_step(self, workdir, step: int):
    """The parameters of `workdir`'s checkpoint at `step`, placed as `place_params` places them (LiveCheckpoints)."""
    return self.place_params(checkpoint.load_params(workdir, step, mesh=self.mesh, rules=self.rules)[0])

  # --- prompts ---

  def encode(self, prompts) -> list[np.ndarray]:
    """Token ids of each prompt: a string is encoded by the tokenizer, a sequence of ints is taken as ids."""
    out = []
    for i, prompt in enumerate(prompts):
      if isinstance(prompt, (str, bytes)):
        ids = np.asarray(self.tokenizer.encode(prompt), np.int32)
      else:
        ids = np.asarray(prompt, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.model_cfg.vocab_size):
          raise UserError(f"prompt {i} has token id {int(ids.min() if ids.min() < 0 else ids.max())} outside the "
                          f"model's vocabulary 0..{self.model_cfg.vocab_size - 1}")
        ids = ids.astype(np.int32)
      if self.add_bos and isinstance(prompt, (str, bytes)):
        ids = np.concatenate([[self.tokenizer.bos_id], ids]).astype(np.int32)
      if ids.size == 0:
        # Nothing to condition on: start where a training document starts, after an end-of-sequence token.
        ids = np.asarray([self.eos_id if self.eos_id is not None else self.pad_id], np.int32)
      out.append(ids)
    return out

  # --- compiled programs ---

  def _programs(self, B: int, P: int, T: int, sampling: Sampling, stop_at_eos: bool):
    """(prefill, decode) compiled for B rows, prompts padded to P, up to T new tokens; cached."""
    key = (B, P, T, sampling, stop_at_eos)
    if key not in self._compiled:
      self._compiled[key] = self._compile(B, P, T, sampling, stop_at_eos)
      startup.barrier("generation's first run of a compiled program", self.barrier_timeout_s)
    return self._compiled[key]

  @staticmethod
  def _check_same_on_every_process(tokens_BP, limit_B, sampling, seed, stream_every, stop_at_eos) -> None:
    """UserError on every process unless all of them were asked for the same generation (prompts read from
    files that differ between hosts, a seed drawn per process, ...): they would compile different programs and wait
    for each other forever, or mix their rows. One small collective, before anything is compiled."""
    if jax.process_count() == 1:
      return
    asked = hashlib.sha256(repr((tokens_BP.shape, tokens_BP.tobytes(), limit_B.tobytes(), sampling, seed,
                                 stream_every, stop_at_eos)).encode()).digest()
    every = np.asarray(multihost_utils.process_allgather(np.frombuffer(asked, np.uint8)))
    differ = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
    if differ:
      raise UserError(f"the processes were not all given the same prompts and settings: process(es) "
                      f"{', '.join(map(str, differ))} differ from process 0; every process must run the same "
                      "command with the same prompts (a --prompt-file must hold the same text on every host)")

  def _fetch(self, x) -> np.ndarray:
    """`x` whole, as numpy, on every process (a collective when other processes hold parts of it)."""
    if x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    # Replicated onto every device (a collective every process runs), then read from one of this process's.
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  def _check_cache_fits(self, B: int, S: int, T: int) -> None:
    """Refuses, before compiling, a generation whose KV cache (keys and values of every layer for B rows of S
    slots, split over the mesh's batch and kv-head axes at best) cannot fit in a device's memory: a long
    --max-new-tokens with a large --max-len would otherwise end in an allocator failure."""
    per_device = (kv_cache_bytes(self.model_cfg, B, S) + B * T * 4) // self.mesh.size
    capacity, source = layout.device_memory(self.mesh)
    if per_device > capacity:
      raise UserError(f"{B} prompt row(s) of up to {S + 1:,} tokens (prompt + --max-new-tokens, within --max-len) "
                      f"need a KV cache of {per_device / 1e9:,.1f} GB per device, more than the {capacity / 1e9:,.1f} "
                      f"GB a device has ({source}); lower --max-new-tokens or --max-len, or spread the batch over "
                      "more devices")

  def _compile(self, B: int, P: int, T: int, sampling: Sampling, stop_at_eos: bool):
    c, model, pad, eos, num_ids = self.model_cfg, self.model, self.pad_id, self.eos_id, self.num_ids
    S = P + T - 1  # slots: the prompt, then every new token but the last (it is never fed back)
    check_eos = stop_at_eos and eos is not None

    def stopped(token_B, t, limit_B):
      """Rows whose token at index t ends them: their end-of-sequence token, or their last allowed token."""
      done_B = t + 1 >= limit_B
      return done_B | (token_B == eos) if check_eos else done_B

    def prefill(params, tokens_BP, start_B, limit_B, key_data):
      # The key comes as its raw data: a typed key array cannot be placed on another process's devices.
      key = jax.random.wrap_key_data(key_data)
      cache = init_cache(c, B, S, start_B)
      logits_B1V, cache = model.apply({"params": params}, tokens_BP, cache=cache)
      live_B = limit_B > 0  # rows that only pad the batch to a multiple of the batch axes have limit 0
      token_B = jnp.where(live_B, sample(logits_B1V[:, 0], jax.random.fold_in(key, 0), sampling, num_ids), pad)
      out_BT = jnp.full((B, T), pad, jnp.int32).at[:, 0].set(token_B)
      done_B = ~live_B | stopped(token_B, 0, limit_B)
      R = max(B, DECODE_MIN_ROWS)  # rows decode runs: padding rows are done from the start, with limit 0
      grow = lambda a, value: jnp.pad(a, [(0, R - B)] + [(0, 0)] * (a.ndim - 1), constant_values=value)
      return {"cache": cache.padded(R), "out_BT": grow(out_BT, pad), "t": jnp.ones((), jnp.int32),
              "done_B": grow(done_B, True), "limit_B": grow(limit_B, 0), "key": key}

    def decode(params, state, t_stop):
      """Tokens t .. t_stop-1 (fewer if every row stops first), in one while loop on the device."""
      def body(s):
        t = s["t"]
        token_B1 = jax.lax.dynamic_slice_in_dim(s["out_BT"], t - 1, 1, axis=1)
        logits_B1V, cache = model.apply({"params": params}, token_B1, cache=s["cache"])
        new_B = sample(logits_B1V[:, 0], jax.random.fold_in(s["key"], t), sampling, num_ids)
        token_B = jnp.where(s["done_B"], pad, new_B)
        out_BT = jax.lax.dynamic_update_slice(s["out_BT"], token_B[:, None], (0, t))
        return {**s, "cache": cache, "out_BT": out_BT, "t": t + 1,
                "done_B": s["done_B"] | stopped(token_B, t, s["limit_B"])}
      return jax.lax.while_loop(lambda s: (s["t"] < t_stop) & ~jnp.all(s["done_B"]), body, state)

    tokens = jax.ShapeDtypeStruct((B, P), jnp.int32, sharding=self._batch_sharding)
    rows = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=self._replicated)
    key_data = jax.random.key_data(jax.random.key(0))
    key = jax.ShapeDtypeStruct(key_data.shape, key_data.dtype, sharding=self._replicated)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.params)
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      prefill_c = jax.jit(prefill).lower(params, tokens, rows, rows, key).compile()
      state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                           prefill_c.out_info, prefill_c.output_shardings)
      # The state is donated: the cache is updated in place, not copied, every call.
      decode_c = jax.jit(decode, donate_argnums=1).lower(
          params, state, jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)).compile()
    return prefill_c, decode_c

  # --- generation ---

  def generate(self, prompts, max_new_tokens: int = 128, sampling: Sampling | None = None, seed: int = 0,
               stream_every: int | None = None, on_tokens=None, stop_at_eos: bool = True) -> Output:
    """Completions of `prompts` (strings or lists of token ids), up to max_new_tokens each.

    With stream_every=N the decode loop returns to the host every N tokens and `on_tokens(t, out_BT, done_B)`
    sees the tokens so far (numpy, [rows, tokens], rows past len(prompts) are padding) and which rows stopped;
    without it the whole decode is one device call. stop_at_eos=False runs every row to its limit (benchmarks).
    """
    sampling = sampling or Sampling()
    sampling.check(self.model_cfg.vocab_size)
    if max_new_tokens <= 0:
      raise UserError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    if not len(prompts):
      raise UserError("no prompt given; pass --prompt TEXT, --prompt-file FILE, --prompt-ids 1,2,3 or --messages "
                      "CHAT.json")
    ids = self.encode(prompts)
    lengths = np.asarray([len(x) for x in ids])
    if self.max_len is not None:
      longest = int(np.argmax(lengths))
      if lengths[longest] >= self.max_len:
        raise UserError(f"prompt {longest} is {lengths[longest]} tokens, but the model's context (max_len, the seq_len "
                        f"it was trained with) is {self.max_len}, which leaves no room for a new token; shorten the "
                        f"prompt or pass a larger --max-len")
      limits = np.minimum(max_new_tokens, self.max_len - lengths)
    else:
      limits = np.full(len(ids), max_new_tokens)
    n = len(ids)
    B = -(-n // self.batch_ways) * self.batch_ways  # rows split evenly over the batch axes
    P = bucket(int(lengths.max()))
    T = int(limits.max())
    self._check_cache_fits(B, P + T - 1, T)
    tokens_BP = np.full((B, P), self.pad_id, np.int32)
    start_B = np.full(B, P - 1, np.int32)
    limit_B = np.zeros(B, np.int32)
    for i, x in enumerate(ids):
      tokens_BP[i, P - len(x):] = x
      start_B[i] = P - len(x)
      limit_B[i] = limits[i]
    self._check_same_on_every_process(tokens_BP, limit_B, sampling, seed, stream_every, stop_at_eos)
    prefill, decode = self._programs(B, P, T, sampling, stop_at_eos)
    # Inputs are placed before the clock starts: the timings are the device programs, not the host transfer.
    tokens_BP = place(tokens_BP, self._batch_sharding)
    start_B, limit_B_dev = (place(a, self._replicated) for a in (start_B, limit_B))
    key = place(np.asarray(jax.random.key_data(jax.random.key(seed))), self._replicated)
    t0 = time.perf_counter()
    state = jax.block_until_ready(prefill(self.params, tokens_BP, start_B, limit_B_dev, key))
    t1 = time.perf_counter()
    t = 1
    step = stream_every or T
    # Every process takes the same turns through this loop (done_B and t are gathered whole everywhere), so all of
    # them run the same device calls and collectives in the same order.
    gather_every_chunk = on_tokens is not None or jax.process_count() > 1
    while True:
      done_B = self._fetch(state["done_B"])
      if gather_every_chunk:
        out_BT = self._fetch(state["out_BT"])
        if on_tokens is not None:
          on_tokens(t, out_BT[:, :t], done_B)
      if t >= T or done_B.all():
        break
      state = decode(self.params, state, place(np.int32(min(t + step, T)), self._replicated))
      t = int(self._fetch(state["t"]))
    out_BT = self._fetch(state["out_BT"])
    t2 = time.perf_counter()
    texts, token_ids, reasons = [], [], []
    for i in range(n):
      row = out_BT[i, :limits[i]]
      stop = np.flatnonzero(row == self.eos_id) if stop_at_eos and self.eos_id is not None else []
      if len(stop):
        row, reason = row[:stop[0] + 1], "eos"
      else:
        reason = "max_new_tokens" if limits[i] == max_new_tokens else "context"
      token_ids.append(row.tolist())
      texts.append(self.tokenizer.decode(row))
      reasons.append(reason)
    return Output(texts, token_ids, reasons, int(lengths.sum()), t1 - t0, t2 - t1,
                  sum(max(len(r) - 1, 0) for r in token_ids), [x.tolist() for x in ids])

